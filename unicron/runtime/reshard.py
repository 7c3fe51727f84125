"""Restoring a snapshot into a different tensor-parallel size (``unicron update`` of a task's TP).

A snapshot holds one tensor-parallel shard: the parameters and Adam moments of TP rank ``k`` of ``T``
(:class:`TpLayout`, recorded in the snapshot by :meth:`ReplicaState.state_dict`). Restoring it into
TP size ``T'`` needs every old shard: each rank brings its own snapshot (or, for a checkpointer shared
by the ranks, the shard file of its rank number), the ranks agree on the newest iteration for which
all ``T`` shards are present, one owner per old shard broadcasts it to the world, and every rank joins
the shards of each tensor along its partition dimension and keeps its own slice of ``T'``.

Which tensors are split, and how, is what Megatron-core records on each parameter
(``tensor_model_parallel``, ``partition_dim``, ``partition_stride``); Megatron's CPU initialisation
splits a master weight into ``stride * T`` contiguous chunks and gives rank ``r`` chunks ``r, r + T,
...`` (``_initialize_affine_weight_cpu``), and :func:`split` / :func:`join` are that and its inverse.
A parameter without the attributes is replicated: every shard holds all of it.

The model's persistent buffers (a MoE router's expert bias: trained, not a parameter) are replicated on
every tensor-parallel rank: the owner of old shard 0 broadcasts its snapshot's, and a snapshot whose
buffers do not match the model's shapes claims nothing.

Every rank holds all ``T`` shards at once while joining (a full copy of the parameters and both
moments): fine for the models a CPU runs; a model near the memory limit would stream tensor by tensor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ckpt.api import Checkpointer, NoValidCheckpoint, Restored
from unicron.kernel.errors import PermanentError
from unicron.runtime.checkpoint import TorchSaveCheckpointer
from unicron.runtime.comm import CommGroup, broadcast_flat

if TYPE_CHECKING:  # state.py builds on this module's layout and split
    from unicron.runtime.state import ReplicaState


class ReshardError(PermanentError):
    """The snapshot cannot be restored into this launch's tensor-parallel size (what is missing is named)."""


@dataclass(frozen=True)
class TpLayout:
    """Which tensor-parallel shard a state is: rank ``rank`` of ``tp``."""

    #: tensor-parallel size
    tp: int
    #: this shard's tensor-parallel rank
    rank: int

    def to_dict(self) -> dict[str, int]:
        return {"tp": self.tp, "rank": self.rank}


#: the layout of a model without tensor parallelism
UNSPLIT = TpLayout(1, 0)


def layout_of(snapshot: Mapping[str, Any]) -> TpLayout | None:
    """The layout a snapshot records (None: written before layouts were recorded, taken as the
    current one)."""
    raw = snapshot.get("layout")
    if not isinstance(raw, Mapping):
        return None
    return TpLayout(int(raw["tp"]), int(raw["rank"]))


@dataclass(frozen=True)
class Partition:
    """How a tensor-parallel parameter is split: along ``dim``, in ``stride`` interleaved chunks."""

    dim: int
    stride: int = 1


def partition_of(param: torch.Tensor) -> Partition | None:
    """Megatron-core's split of ``param`` (None: replicated on every tensor-parallel rank)."""
    if not getattr(param, "tensor_model_parallel", False):
        return None
    return Partition(int(getattr(param, "partition_dim", 0)), int(getattr(param, "partition_stride", 1)))


def split(full: torch.Tensor, part: Partition, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full`` among ``tp`` (Megatron's CPU split of a master weight)."""
    size = full.size(part.dim)
    if size % (tp * part.stride):
        raise ReshardError(f"a dimension of {size} does not split into {tp} x stride {part.stride} shards")
    chunks = torch.split(full, size // (tp * part.stride), dim=part.dim)
    return torch.cat(chunks[rank :: tp], dim=part.dim)


def join(shards: Sequence[torch.Tensor], part: Partition) -> torch.Tensor:
    """The full tensor whose :func:`split` among ``len(shards)`` gives ``shards`` (rank order)."""
    tp = len(shards)
    pieces = [torch.chunk(s, part.stride, dim=part.dim) for s in shards]
    return torch.cat([pieces[r][j] for j in range(part.stride) for r in range(tp)], dim=part.dim)


def shard_shape(shape: torch.Size, part: Partition | None, from_tp: int, to_tp: int) -> torch.Size:
    """The shape a tensor of ``shape`` (a shard of ``from_tp``) has as a shard of ``to_tp``."""
    if part is None:
        return shape
    dims = list(shape)
    full = dims[part.dim] * from_tp
    if full % to_tp:
        raise ReshardError(f"a dimension of {full} does not split into {to_tp} tensor-parallel shards")
    dims[part.dim] = full // to_tp
    return torch.Size(dims)


@dataclass(frozen=True)
class Slot:
    """One tensor of a replica's state, in the order of ``ReplicaState.tensors()``."""

    #: where the current state holds it
    target: torch.Tensor
    #: its split (None: replicated)
    part: Partition | None


def shard_tensors(snapshot: Mapping[str, Any], names: Sequence[str]) -> list[torch.Tensor]:
    """The snapshot's tensors in the order of ``ReplicaState.tensors()``: per trainable parameter
    (``names``, in order), its value, Adam's two moments and step."""
    model, opt = snapshot["model"], snapshot["optimizer"]["state"]
    out: list[torch.Tensor] = []
    for i, name in enumerate(names):
        if name not in model or i not in opt:
            raise ReshardError(f"the snapshot lacks parameter {name!r} or its optimizer state: another model")
        st = opt[i]
        out += [model[name], st["exp_avg"], st["exp_avg_sq"], st["step"]]
    return out


def reshard(slots: Sequence[Slot], shards: Sequence[Sequence[torch.Tensor]], to_tp: int, rank: int) -> None:
    """Write into each slot's target its ``rank``-of-``to_tp`` slice of the tensor whose old shards are
    ``shards[k][i]`` (old TP rank ``k``, slot ``i``)."""
    for i, slot in enumerate(slots):
        if slot.part is None:
            value = shards[0][i]
        else:
            value = split(join([s[i] for s in shards], slot.part), slot.part, to_tp, rank)
        if value.shape != slot.target.shape:
            raise ReshardError(
                f"a tensor of shape {tuple(slot.target.shape)} would get {tuple(value.shape)}: the snapshot "
                "is of another model or split")
        slot.target.copy_(value)


# --- the collective: every rank of the new launch calls restore_resharded --------------------------

NO_CLAIM = (-1, -1, -1)
#: the most snapshots one rank claims (torch-save keeps 2): the claim table every rank gathers is
#: this many rows per rank
MAX_CLAIMS = 8


def own_snapshots(checkpointer: Checkpointer, rank: int, mine: Restored | None) -> list[Restored]:
    """What this rank brings to a reshard, newest first: ``mine`` (already restored), and from a
    checkpointer whose files every rank shares (one writer per shard) every snapshot of the shard
    numbered like this rank, so that an iteration every shard holds is found even where some shard's
    newest is newer; from any other, its newest valid snapshot when ``mine`` is None."""
    found = [] if mine is None else [mine]
    if isinstance(checkpointer, TorchSaveCheckpointer):
        found += checkpointer.read_shard(rank, MAX_CLAIMS - len(found))
    elif mine is None:
        with contextlib.suppress(NoValidCheckpoint):
            found.append(checkpointer.restore())
    return found


def claim_of(snapshot: Mapping[str, Any], slots: Sequence[Slot], names: Sequence[str], tp: int,
             buffers: Sequence[tuple[str, torch.Tensor]] = ()) -> tuple[int, int, int]:
    """(iteration, TP size, TP rank) of a usable snapshot: one whose tensors have the shapes and dtypes a
    shard of its layout must have, and whose ``buffers`` (name, the model's own) are the model's shapes;
    :data:`NO_CLAIM` otherwise."""
    layout = layout_of(snapshot)
    if layout is None:
        return NO_CLAIM
    try:
        tensors = shard_tensors(snapshot, names)
        wanted = [shard_shape(s.target.shape, s.part, tp, layout.tp) for s in slots]
        held = buffer_tensors(snapshot, [n for n, _ in buffers])
    except ReshardError:
        return NO_CLAIM
    if any(t.shape != w or t.dtype != s.target.dtype for t, w, s in zip(tensors, wanted, slots, strict=True)):
        return NO_CLAIM
    if any(t.shape != b.shape or t.dtype != b.dtype for t, (_, b) in zip(held, buffers, strict=True)):
        return NO_CLAIM
    return int(snapshot["iteration"]), layout.tp, layout.rank


def buffer_tensors(snapshot: Mapping[str, Any], names: Sequence[str]) -> list[torch.Tensor]:
    """The snapshot's buffers ``names``, in that order."""
    model = snapshot["model"]
    missing = [n for n in names if not isinstance(model.get(n), torch.Tensor)]
    if missing:
        raise ReshardError(f"the snapshot lacks buffer {missing[0]!r}: another model")
    return [model[n] for n in names]


def choose(claims: Sequence[tuple[int, int, int]], per_rank: int = 1) -> tuple[int, int, list[int]]:
    """(iteration, old TP size, owner per old shard) of the newest iteration for which every shard of
    one layout is claimed; the lowest claiming rank owns a shard. ``claims``: ``per_rank`` per rank,
    rank by rank; an owner is an index into ``claims`` (its rank: the index // ``per_rank``)."""
    for it in sorted({c[0] for c in claims if c[0] >= 0}, reverse=True):
        for tp in sorted({c[1] for c in claims if c[0] == it}):
            owners = [next((r for r, c in enumerate(claims) if c == (it, tp, k)), -1) for k in range(tp)]
            if min(owners) >= 0:
                return it, tp, owners
    held = sorted({c for c in claims if c != NO_CLAIM})
    raise ReshardError(
        "no iteration has every tensor-parallel shard of its layout among this launch's "
        f"{len(claims) // per_rank} ranks (held: {[f'it {i} shard {k}/{t}' for i, t, k in held]}); "
        "relaunch with the old --tp, or with at least as many ranks as the old TP size")


def restore_resharded(state: ReplicaState, checkpointer: Checkpointer, world: CommGroup, tp: int,
                      tp_rank: int, mine: Restored | None) -> tuple[str, int]:
    """Every rank of the launch: restore the newest complete snapshot into ``state``, a shard of ``tp``,
    whatever TP size wrote it. ``mine``: the snapshot this rank already restored, if any. Returns where
    this rank's data came from (its snapshot's tier when it owned a shard, else "replica") and the TP
    size that wrote the snapshot."""
    held = own_snapshots(checkpointer, world.rank(), mine)
    slots = state.slots()
    buffers = state.persistent_buffers()
    claims = [claim_of(r.state, slots, state.names, tp, buffers) for r in held]
    table = claims + [NO_CLAIM] * (MAX_CLAIMS - len(claims))
    device = state.device  # the collectives' (NCCL: CUDA); the old shards are joined on the CPU
    gathered = [torch.empty(MAX_CLAIMS, 3, dtype=torch.int64, device=device) for _ in range(world.size())]
    world.allgather([gathered], [torch.tensor(table, dtype=torch.int64, device=device)]).wait()
    iteration, old_tp, owners = choose([(int(c[0]), int(c[1]), int(c[2])) for t in gathered for c in t],
                                       MAX_CLAIMS)
    shards: list[list[torch.Tensor]] = []
    served: Restored | None = None
    for owner in owners:
        if owner // MAX_CLAIMS == world.rank():
            served = held[owner % MAX_CLAIMS]
            tensors = shard_tensors(served.state, state.names)
        else:
            tensors = [torch.empty(shard_shape(s.target.shape, s.part, tp, old_tp), dtype=s.target.dtype)
                       for s in slots]
        broadcast_flat(world, owner // MAX_CLAIMS, tensors, device)
        shards.append(tensors)
    reshard(slots, shards, tp, tp_rank)
    first = owners[0] // MAX_CLAIMS
    if first == world.rank():
        values = buffer_tensors(held[owners[0] % MAX_CLAIMS].state, [n for n, _ in buffers])
    else:
        values = [torch.empty_like(b, device="cpu") for _, b in buffers]
    broadcast_flat(world, first, values, device)
    for (_, target), value in zip(buffers, values, strict=True):
        target.copy_(value)
    state.iteration = iteration
    checkpointer.resume_from(iteration)  # it may have restored a newer one of its own, unused
    return (served.tier.value if served is not None else "replica"), old_tp
