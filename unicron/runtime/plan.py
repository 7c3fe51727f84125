"""Who computes which micro-batch: pure functions of the batch layout and the live replicas.

A global batch is ``B`` micro-batches with stable indices ``0..B-1``. They are grouped into ``V``
contiguous *blocks* (``V`` is fixed for the whole job, normally the initial data-parallel degree): a
block is the unit of the canonical summation order of deterministic mode, and with ``V`` replicas
replica ``i`` owns block ``i``: the ``k = B/DP`` micro-batches of paper Eq. 6.

A *replica* is one model-parallel copy of the model (``tp`` consecutive global ranks); micro-batches
are assigned to replicas, and every rank of a replica computes the same ones in lockstep.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from unicron.kernel.errors import ConfigError

Plan = dict[int, list[int]]
"""replica id -> ascending micro-batch indices it must compute."""


@dataclass(frozen=True)
class BatchLayout:
    """The shape of a global batch."""

    #: micro-batches per global batch (B)
    micro_batches: int
    #: canonical reduction blocks (V); must divide ``micro_batches``
    blocks: int

    def __post_init__(self) -> None:
        if self.micro_batches < 1:
            raise ConfigError(f"global batch: need at least one micro-batch, got {self.micro_batches}")
        if self.blocks < 1 or self.micro_batches % self.blocks:
            raise ConfigError(
                f"blocks={self.blocks} must be >= 1 and divide the {self.micro_batches} micro-batches "
                "(set --blocks, default: the initial data-parallel size)"
            )

    @property
    def block_size(self) -> int:
        return self.micro_batches // self.blocks

    def block_of(self, mb: int) -> int:
        return mb // self.block_size

    def block_start(self, block: int) -> int:
        return block * self.block_size

    def block_range(self, block: int) -> range:
        return range(block * self.block_size, (block + 1) * self.block_size)


@dataclass(frozen=True)
class Topology:
    """Global ranks arranged as replicas of ``tp`` consecutive ranks (Megatron's tp-fastest order)."""

    world_size: int
    tp: int

    def __post_init__(self) -> None:
        if self.tp < 1 or self.world_size < 1 or self.world_size % self.tp:
            raise ConfigError(
                f"--tp {self.tp} must be >= 1 and divide WORLD_SIZE={self.world_size}"
            )

    @property
    def replicas(self) -> int:
        return self.world_size // self.tp

    def replica_of(self, rank: int) -> int:
        return rank // self.tp

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def ranks_of(self, replica: int) -> list[int]:
        return list(range(replica * self.tp, (replica + 1) * self.tp))

    def replicas_in(self, members: Iterable[int]) -> list[int]:
        """Replicas all of whose ranks are in ``members``, ascending."""
        live = set(members)
        return [r for r in range(self.replicas) if all(x in live for x in self.ranks_of(r))]

    def full_replica_members(self, ranks: Iterable[int]) -> list[int]:
        """The ranks of ``ranks`` that belong to complete replicas, ascending."""
        return [x for r in self.replicas_in(ranks) for x in self.ranks_of(r)]

    def dp_peers(self, members: Sequence[int], rank: int) -> list[int]:
        """Members with the same tensor-parallel rank as ``rank``: its data-parallel group."""
        t = self.tp_rank(rank)
        return sorted(x for x in members if self.tp_rank(x) == t)


def initial_plan(layout: BatchLayout, replicas: Sequence[int]) -> Plan:
    """Failure-free assignment: whole blocks round-robin while at least one per replica remains,
    then the remaining blocks' micro-batches one by one round-robin."""
    if not replicas:
        raise ConfigError("no live replica to assign micro-batches to")
    reps = sorted(replicas)
    n = len(reps)
    plan: Plan = {r: [] for r in reps}
    whole = (layout.blocks // n) * n
    for b in range(whole):
        plan[reps[b % n]].extend(layout.block_range(b))
    rest = [mb for b in range(whole, layout.blocks) for mb in layout.block_range(b)]
    for i, mb in enumerate(rest):
        plan[reps[i % n]].append(mb)
    for mbs in plan.values():
        mbs.sort()
    return plan


def redistribute(plan: Plan, alive: Sequence[int], needed: Iterable[int]) -> Plan:
    """Keep ``needed`` micro-batches with their owner where it is alive; hand the orphans of dead
    replicas out one at a time, each to the least-loaded replica (paper §6: k' = k + k/(DP-1))."""
    if not alive:
        raise ConfigError("no live replica to redistribute micro-batches to")
    owner = {mb: r for r, mbs in plan.items() for mb in mbs}
    out: Plan = {r: [] for r in sorted(alive)}
    orphans: list[int] = []
    for mb in sorted(set(needed)):
        r = owner.get(mb)
        if r in out:
            out[r].append(mb)
        else:
            orphans.append(mb)
    for mb in orphans:  # each to the replica holding fewest now (a fixed round-robin order gave 4 vs 2)
        out[min(out, key=lambda r: (len(out[r]), r))].append(mb)
    for mbs in out.values():
        mbs.sort()
    return out


def seed_rng(seed: int) -> None:
    """Seed the generators a micro-batch's forward may draw from (dropout). Not ``torch.manual_seed``:
    without CUDA that records a stack trace per call for lazy device seeding (~0.5 ms each)."""
    import torch

    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]  # pragma: no cover - GPU only
        torch.cuda.manual_seed(seed)


def mb_seed(seed: int, iteration: int, mb: int) -> int:
    """RNG seed of one micro-batch: a function of its identity only, never of the rank running it."""
    return zlib.crc32(f"{seed}:{iteration}:{mb}".encode()) & 0x7FFFFFFF
