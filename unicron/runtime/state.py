"""A replica's training state and where a (re)joining rank gets it from (paper §6.3, nearest first).

:class:`ReplicaState` is everything two data-parallel replicas share bit for bit: parameters, optimizer
moments and the iteration counter. :class:`StateSource` is the one interface for bringing a rank's
state in line with the healthy replicas:

* :class:`ReplicaBroadcast`: a healthy data-parallel replica broadcasts its state over the epoch's
  data-parallel group (one flat tensor per dtype);
* :class:`CheckpointSource`: the in-memory checkpoint (``ckpt/``), when no replica holds the state.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ckpt.api import CheckpointError, Restored
from unicron.kernel.errors import ConfigError
from unicron.runtime.comm import CommGroup, broadcast_flat
from unicron.runtime.reshard import UNSPLIT, Slot, TpLayout, layout_of, partition_of


@dataclass(frozen=True)
class OptimConfig:
    """Adam settings (Megatron's own optimizer needs CUDA; torch's Adam is what runs on CPU)."""

    #: learning rate
    lr: float = 1e-3
    #: Adam beta1
    beta1: float = 0.9
    #: Adam beta2
    beta2: float = 0.95
    #: Adam epsilon
    eps: float = 1e-8
    #: decoupled weight decay (AdamW) coefficient
    weight_decay: float = 0.0

    def validate(self) -> None:
        if self.lr <= 0:
            raise ConfigError(f"--lr must be > 0, got {self.lr}")


class SnapshotMismatch(CheckpointError):
    """A snapshot's model tensors are not this model's (names, shapes or dtypes differ): restoring it
    is refused."""


#: what a launch whose model is not the snapshot's can do (the rank's one-line error ends with it)
RELAUNCH_HINT = "relaunch with the model flags the snapshot was written with, or without --resume"


class ReplicaState:
    """Parameters + optimizer state + iteration of one replica.

    The optimizer state is created eagerly (zero moments, step 0: what Adam would create lazily), so
    its layout never depends on whether a step ran, and a joiner can receive it in place.
    """

    def __init__(self, model: torch.nn.Module, cfg: OptimConfig, layout: TpLayout = UNSPLIT) -> None:
        cfg.validate()
        self.model = model
        #: the tensor-parallel shard this state is (recorded in every snapshot)
        self.layout = layout
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
            weight_decay=cfg.weight_decay, foreach=False,
        )
        for p in self.params:
            self.optimizer.state[p] = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }
        self.iteration = 0

    @property
    def device(self) -> torch.device:
        """Where the parameters live: the collectives that move this state run there."""
        return self.params[0].device if self.params else torch.device("cpu")

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the state, in a fixed order."""
        out: list[torch.Tensor] = []
        for p in self.params:
            st = self.optimizer.state[p]
            out += [p.data, st["exp_avg"], st["exp_avg_sq"], st["step"]]
        return out

    def buffers(self) -> list[torch.Tensor]:
        """The model's buffers, in a fixed order: training changes some (a norm's running statistics,
        a MoE router's expert bias), so a replica hands them to a joiner with the parameters."""
        return [b for _, b in self.model.named_buffers()]

    def persistent_buffers(self) -> list[tuple[str, torch.Tensor]]:
        """The buffers a snapshot holds (the model's state dict lists them; a non-persistent one is
        rebuilt by the model itself), by name, in a fixed order."""
        saved = self.model.state_dict(keep_vars=True)
        return [(n, b) for n, b in self.model.named_buffers() if n in saved]

    def replica_tensors(self) -> list[torch.Tensor]:
        """What one replica's state is made of: :meth:`tensors`, then :meth:`buffers`."""
        return self.tensors() + self.buffers()

    def slots(self) -> list[Slot]:
        """:meth:`tensors` with each one's tensor-parallel split (the parameter's)."""
        return [Slot(t, partition_of(p) if t.dim() else None)
                for p, t in zip((p for p in self.params for _ in range(4)), self.tensors(), strict=True)]

    def fits(self, snapshot: dict[str, Any]) -> bool:
        """Whether ``snapshot`` is of this state's tensor-parallel shard (else: :mod:`reshard`)."""
        layout = layout_of(snapshot)
        return layout is None or layout == self.layout

    def _model_tensors(self) -> dict[str, torch.Tensor]:
        # not the non-tensor entries (a Megatron layer's ``_extra_state``): a snapshot holds none
        return {k: v for k, v in self.model.state_dict().items() if isinstance(v, torch.Tensor)}

    def state_dict(self) -> dict[str, Any]:
        """References, not copies: a checkpointer copies what it keeps."""
        return {
            "iteration": self.iteration,
            "layout": self.layout.to_dict(),
            "model": self._model_tensors(),
            "optimizer": self.optimizer.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Raises :class:`SnapshotMismatch`, loading nothing, when the snapshot's tensors are not this
        model's (strict=False alone would load the optimizer and leave parameters at their init)."""
        mine, theirs = self._model_tensors(), state["model"]
        want, got = set(mine), set(theirs)
        if want != got:
            raise SnapshotMismatch(
                f"the snapshot of iteration {state.get('iteration')} is of another model: it lacks "
                f"{sorted(want - got)[:3]} and has {sorted(got - want)[:3]} (first 3 of each); {RELAUNCH_HINT}")
        # torch's load_state_dict raises a size mismatch only after loading the tensors before it, and
        # converts another dtype silently: checked first, so a refusal loads nothing
        differ = [f"{name} {_describe(theirs[name])} in the snapshot, {_describe(t)} here"
                  for name, t in mine.items() if not _alike(theirs[name], t)]
        if differ:
            raise SnapshotMismatch(
                f"the snapshot of iteration {state.get('iteration')} is of another model shape: "
                f"{'; '.join(differ[:3])} ({min(3, len(differ))} of {len(differ)} tensors that differ); "
                f"{RELAUNCH_HINT}")
        self.model.load_state_dict(theirs, strict=False)
        # the optimizer's settings (lr, betas, ...) stay this launch's flags: only a group's root loads a
        # snapshot, the others receive its tensors, and replicas that stepped with two lr's diverged
        settings = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        self.optimizer.load_state_dict(state["optimizer"])
        for group, kept in zip(self.optimizer.param_groups, settings, strict=True):
            group.update(kept)
        self.iteration = int(state["iteration"])


def _alike(saved: Any, mine: torch.Tensor) -> bool:
    return isinstance(saved, torch.Tensor) and saved.shape == mine.shape and saved.dtype == mine.dtype


def _describe(t: Any) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}"


class StateSource(ABC):
    """Brings ``receivers`` in line with the healthy replicas of the epoch. Every member calls
    :meth:`transfer` collectively (same arguments on all); returns False when this source cannot
    serve (the caller tries the next one)."""

    name: str = ""

    @abstractmethod
    def transfer(
        self, state: ReplicaState, group: CommGroup, group_ranks: Sequence[int],
        holders: Sequence[int], receivers: Sequence[int], me: int,
    ) -> bool: ...


class ReplicaBroadcast(StateSource):
    """The lowest-ranked healthy replica in the data-parallel group broadcasts its state."""

    name = "replica"

    def transfer(
        self, state: ReplicaState, group: CommGroup, group_ranks: Sequence[int],
        holders: Sequence[int], receivers: Sequence[int], me: int,
    ) -> bool:
        roots = [r for r in group_ranks if r in holders]
        if not receivers:
            return True
        if not roots:
            return False
        root = group_ranks.index(roots[0])
        it = torch.tensor([state.iteration], dtype=torch.int64, device=state.device)
        group.broadcast(it, root).wait()
        broadcast_flat(group, root, state.replica_tensors(), state.device)
        state.iteration = int(it.item())
        return True


class CheckpointSource(StateSource):
    """No replica holds the state (the whole task was stopped or lost): restore the newest snapshot.

    Every data-parallel replica of a shard holds the same state, so the group needs one copy of the
    newest iteration, not one per rank: the members tell each other the newest iteration their
    checkpointer claims (its nearest tier first: this node's memory, a peer's, then remote storage),
    the holder of the newest restores it and broadcasts it to the rest (peer memory); when no copy of
    it is valid, the holder claims its newest valid one instead and the members choose again, so a
    newer valid snapshot another member holds still wins. A rank relaunched where it holds nothing,
    or a task relaunched with more replicas, so never restores an older periodic checkpoint while a
    newer snapshot (a stop's on-demand one) exists anywhere in the group. A newest snapshot of another
    TP size is not loaded (:attr:`outcome` says so): resharding needs every rank of the task.
    """

    name = "checkpoint"

    def __init__(self, checkpointer: Any) -> None:
        self.checkpointer = checkpointer
        #: where this rank's state came from at the last transfer: a tier (local, peer, remote) or
        #: "replica" (broadcast by the group's holder of the newest snapshot)
        self.source = ""
        #: the last transfer's outcome, for the caller's decision to reshard (see :class:`Outcome`)
        self.outcome = Outcome.SERVED
        #: the snapshot this rank restored that is of another tensor-parallel layout (kept for resharding)
        self.foreign: Restored | None = None

    def transfer(
        self, state: ReplicaState, group: CommGroup, group_ranks: Sequence[int],
        holders: Sequence[int], receivers: Sequence[int], me: int,
    ) -> bool:
        from ckpt.api import NoValidCheckpoint
        from unicron.runtime.checkpoint import newest_checkpoint

        self.outcome, self.foreign = Outcome.SERVED, None
        if not receivers:
            return True
        newest = newest_checkpoint(self.checkpointer) if me in receivers else None
        claim = -1 if newest is None else newest
        fallback: Restored | None = None  # this rank's newest valid snapshot, once its claim's failed
        while True:
            mine = torch.tensor([claim], dtype=torch.int64, device=state.device)
            its = [torch.empty_like(mine) for _ in range(group.size())]
            group.allgather([its], [mine]).wait()
            claims = [int(t) for t in its]
            best = max(claims)
            if best < 0:
                self.outcome = Outcome.NOTHING
                return False  # nobody holds a snapshot: the caller says so
            root = claims.index(best)
            restored: Restored | None = None
            if group.rank() == root and fallback is not None and fallback.iteration == best:
                restored = fallback
            elif group.rank() == root:
                try:
                    restored = self.checkpointer.restore(iteration=best)
                except NoValidCheckpoint:  # every copy of it is damaged: claim again with this rank's
                    try:  # newest valid one, which another member's newer valid one may beat
                        fallback = self.checkpointer.restore()
                        claim = min(fallback.iteration, best - 1)  # always lower: the rounds end
                    except NoValidCheckpoint:
                        claim = -1
            served = torch.tensor([group.rank() != root or restored is not None], dtype=torch.int64,
                                  device=state.device)
            group.broadcast(served, root).wait()
            if int(served):
                break
        fits = 1
        if restored is not None:
            if state.fits(restored.state):
                state.load_state_dict(restored.state)
            else:
                self.foreign, fits = restored, 0
            self.source = restored.tier.value
        else:
            self.source = "replica"
        head = torch.tensor([state.iteration, fits], dtype=torch.int64, device=state.device)
        group.broadcast(head, root).wait()
        if not int(head[1]):  # of another tensor-parallel layout: nothing loaded; only a restore
            self.outcome = Outcome.FOREIGN  # of every rank can reshard it (Trainer._restore_snapshots)
            return False
        broadcast_flat(group, root, state.replica_tensors(), state.device)
        state.iteration = int(head[0])
        return True


class Outcome(enum.IntEnum):
    """What a :class:`CheckpointSource` transfer did for the group."""

    #: the group holds the newest snapshot's state
    SERVED = 0
    #: no member holds any snapshot
    NOTHING = 1
    #: the newest snapshot is of another tensor-parallel layout: nothing was loaded (a joiner's
    #: transfer then fails loudly rather than train on state it does not have)
    FOREIGN = 2
