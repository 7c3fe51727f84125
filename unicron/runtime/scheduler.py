"""The micro-batch iteration scheduler (paper §6, Eq. 6-7, Figure 8).

One :class:`Trainer` per rank. An iteration runs this rank's replica's micro-batches (forward,
backward, accumulate), reduces the gradient over the data-parallel group bucket by bucket, and steps
the optimizer. Any communication error breaks this rank's groups at once (so peers fail fast) and
leads to a *regroup*: a new epoch of the surviving members (:mod:`unicron.runtime.membership`),
followed by an agreement in which every member publishes its progress:

* A. **catch-up**: a rank behind by one iteration (its last bucket failed while a peer's completed
  and that peer stepped) receives the missing reduced buckets from a holder and steps;
* B. **reduced buckets stay reduced**: within the current iteration, buckets completed by any
  member of a data-parallel group are final and go to the others by broadcast (scenario #2);
  if every bucket is complete, the iteration is done;
* C. **state transfer**: joiners get parameters, optimizer state and the iteration counter from a
  healthy replica (:mod:`unicron.runtime.state`);
* D. **redistribution**: micro-batches missing from some group's sum are assigned to live replicas
  (kept with their owner if alive, orphans round-robin: scenario #1); a rank accumulates one only if
  its own group lacks it, so nothing is counted twice.

The gradient is always sum(all B micro-batches) / B, whoever computed them.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ckpt.api import Checkpointer
from unicron.kernel import protocol
from unicron.kernel.client import AgentClient, InjectedFault
from unicron.kernel.errors import ConfigError, PermanentError
from unicron.kernel.patterns import match
from unicron.kernel.types import ErrorKind, Severity
from unicron.runtime import membership
from unicron.runtime.checkpoint import TorchSaveCheckpointer, has_checkpoint
from unicron.runtime.comm import CommGroup, Store
from unicron.runtime.data import TokenSource
from unicron.runtime.epoch import EpochRecord
from unicron.runtime.faults import FaultScript
from unicron.runtime.gcpolicy import GcPolicy
from unicron.runtime.grads import (
    TAIL,
    TAIL_JOIN,
    TAIL_LOSS,
    TAIL_STOP,
    Accumulator,
    Contributions,
    DirectSum,
    FlatGrads,
    ReduceProgress,
    RuntimeInvariantError,
    SafeSum,
    bucket_bounds,
    reduce_gather,
    reduce_sum,
)
from unicron.runtime.heartbeat import STOP_KEY, Heartbeat
from unicron.runtime.membership import CommSettings, Excluded, Groups, JobFinished, Membership
from unicron.runtime.model import ModelConfig, broken_group, build_gpt, lm_loss, rebind_groups
from unicron.runtime.plan import BatchLayout, Plan, Topology, initial_plan, mb_seed, redistribute, seed_rng
from unicron.runtime.state import CheckpointSource, OptimConfig, ReplicaBroadcast, ReplicaState, StateSource

log = logging.getLogger(__name__)

RECOVERY_MODES = ("redistribute", "rerun")
FINISHED_KEY = membership.FINISHED_KEY
"""Store key written when training ends, so that ranks waiting to join exit too."""


@dataclass(frozen=True)
class ScheduleConfig:
    """How iterations are scheduled and reduced."""

    #: micro-batches per global batch (B)
    micro_batches: int = 16
    #: canonical reduction blocks V (0: the initial data-parallel size)
    blocks: int = 0
    #: samples per micro-batch
    micro_batch_size: int = 4
    #: iterations to run (0: until stopped)
    iterations: int = 10
    #: deterministic mode: bit-identical results for any data-parallel split
    deterministic: bool = False
    #: elements per gradient bucket (buckets are reduced in order; completed ones are final)
    bucket_elems: int = 1 << 22
    #: after a failure: "redistribute" keeps completed work; "rerun" recomputes the whole iteration
    recovery: str = "redistribute"
    #: seed of data order and per-micro-batch RNG
    seed: int = 1
    #: artificial delay per iteration (seconds), to emulate a bigger model
    iter_sleep: float = 0.0
    #: how long a restarted rank waits to be admitted
    join_timeout_s: float = 600.0
    #: collect garbage only at every Nth iteration boundary, on all ranks alike (0: automatic)
    manual_gc_interval: int = 0


VIEW_CHECK_EVERY = 100
"""Iterations between checks that autograd still accumulates into the flat buffer (also checked on the
first iteration): a replaced ``.grad`` would happen at the first backward, if ever."""
EVENT_LOG_LIMIT = 10_000
"""Newest events and losses a rank keeps for ``--out-dir`` (a long run must not grow without bound)."""


@dataclass
class Event:
    """One line of the rank's event log (``--out-dir``)."""

    kind: str
    ts: float
    data: dict[str, Any] = field(default_factory=dict)


class RestoreMismatch(PermanentError):
    """Ranks restored checkpoints of different iterations."""


class CommFailure(Exception):
    """A collective failed: this rank's groups are broken and a regroup is due."""


def _is_comm_error_1(exc: BaseException) -> bool:
    if isinstance(exc, dist.DistError):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc)
    return "gloo" in text.lower() or "nccl" in text.lower() or match(text) in (
        ErrorKind.CONNECTION_REFUSED_RESET, ErrorKind.OTHER_NETWORK_ERROR, ErrorKind.NCCL_TIMEOUT,
    )


def is_comm_error(exc: BaseException) -> bool:
    """Errors of collectives (gloo raises plain RuntimeError; NCCL raises DistBackendError).

    torch's collective wrappers log a failure by looking the group up in the default world's map,
    where our per-epoch groups are not registered, so the original error can arrive as the context
    of a ValueError: the whole chain is examined.
    """
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if _is_comm_error_1(cur):
            return True
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return False


def severity_of_kind(kind: ErrorKind) -> Severity:
    """Table 1 severity of an exception a rank raises (coordinator.classify owns the table)."""
    from unicron.kernel.severity import severity_of
    from unicron.kernel.types import DetectionMethod

    sev = severity_of(DetectionMethod.EXCEPTION_PROPAGATION, kind)
    return sev if sev is not None else Severity.SEV2


class Trainer:
    """Runs managed training on one rank."""

    def __init__(
        self,
        *,
        rank: int,
        topo: Topology,
        store: Store,
        incarnation: int,
        model_cfg: ModelConfig,
        optim_cfg: OptimConfig,
        sched: ScheduleConfig,
        comm: CommSettings,
        data: TokenSource,
        client: AgentClient,
        faults: FaultScript,
        checkpointer: Checkpointer | None = None,
        ckpt_every: int = 0,
        resume: bool = False,
        watcher: Heartbeat | None = None,
    ) -> None:
        if sched.recovery not in RECOVERY_MODES:
            raise ConfigError(f"--recovery {sched.recovery!r}: choose one of {RECOVERY_MODES}")
        self.rank, self.topo, self.store, self.incarnation = rank, topo, store, incarnation
        self.model_cfg, self.optim_cfg, self.sched, self.comm = model_cfg, optim_cfg, sched, comm
        self.data, self.client, self.faults = data, client, faults
        self.layout = BatchLayout(sched.micro_batches, sched.blocks or topo.replicas)
        self.checkpointer, self.ckpt_every, self.resume = checkpointer, ckpt_every, resume
        if isinstance(checkpointer, TorchSaveCheckpointer):
            checkpointer.use_shard(topo.tp_rank(rank))  # the files of this rank's model-parallel shard
        self.watcher = watcher
        self.sources: list[StateSource] = [ReplicaBroadcast()]
        if checkpointer is not None:
            self.sources.append(CheckpointSource(checkpointer))
        self._agent_dead: set[int] = set()
        self.membership = Membership(store, rank, topo, incarnation, comm, knowledge=self._agent_knowledge)
        self.events: deque[Event] = deque(maxlen=EVENT_LOG_LIMIT)
        self.stop_requested = False  # asked (agent Stop or the store's stop key); acted on once agreed
        self.stopping = False  # agreed by every member at the last commit
        # Filled by _setup once the first groups exist.
        self.groups: Groups
        self.model_tp: CommGroup
        self.state: ReplicaState
        self.flat: FlatGrads
        self.acc: Accumulator
        self.prog: ReduceProgress
        self.plan: Plan = {}
        self.todo: list[int] = []
        self.keep_mask: set[int] = set()  # micro-batches some member of my DP group already holds
        self.base_epoch = 0
        self.fresh = True  # no valid replica state yet (joiner)
        self.pending: tuple[str, bool] | None = None  # (reason, assume_same) of a due regroup
        self.mb_position = 0
        self.views_checked_at: int | None = None  # iteration of the last check that .grad views the flat buffer
        self.losses: deque[float] = deque(maxlen=EVENT_LOG_LIMIT)
        self.gc = GcPolicy(sched.manual_gc_interval)
        self._plans: dict[int, tuple[int, Plan]] = {}  # epoch -> (live replicas, failure-free plan)

    # --- setup -----------------------------------------------------------------------------------

    def _setup(self, groups: Groups) -> None:
        self.groups = groups
        model = build_gpt(self.model_cfg, groups.tp)
        self.model_tp = groups.tp
        self.state = ReplicaState(model, self.optim_cfg)
        self.flat = FlatGrads(self.state.params, self.model_cfg.torch_dtype)
        self.set_deterministic(self.sched.deterministic)
        total = self.flat.numel + TAIL
        self.prog = ReduceProgress(bucket_bounds(total, self.sched.bucket_elems), self.flat.buf.dtype,
                                   numel=self.flat.numel, scale=1.0 / self.layout.micro_batches)
        self.views_checked_at = None
        self.gc.after_setup()

    def set_deterministic(self, on: bool) -> None:
        """Choose the accumulation (and so the reduction) mode; only at an iteration boundary."""
        if hasattr(self, "acc") and (self.acc.done or self.prog.done):
            raise RuntimeInvariantError("the reduction mode can change only between iterations")
        if on:
            self.acc = Contributions(self.flat, self.layout)
        elif self.topo.tp > 1:
            self.acc = SafeSum(self.flat)
        else:
            self.acc = DirectSum(self.flat)
        self.acc.reset()

    @property
    def replica(self) -> int:
        return self.topo.replica_of(self.rank)

    @property
    def it(self) -> int:
        return self.state.iteration

    def _event(self, kind: str, **data: Any) -> None:
        self.events.append(Event(kind, time.time(), data))

    # --- main loop -------------------------------------------------------------------------------

    def run(self) -> int:
        """Train until the configured iterations are done or the job is stopped; returns an exit code."""
        try:
            self.begin()
            while not self.finished():
                self.step()
        except JobFinished:
            self._event("finished", note="the job completed while this rank waited to join")
            return 0
        finally:
            self.gc.close()
        self.store.set(FINISHED_KEY, str(self.it))
        wait = getattr(self.checkpointer, "wait", None)
        if callable(wait):
            wait()  # let the last snapshot's background work finish before the process exits
        return 0

    def begin(self) -> None:
        """Enter the job: epoch 0 on a first start (restoring the checkpoint with ``resume``), else
        wait to be admitted and take the state from a replica."""
        if self.incarnation == 1:
            t0 = time.time()
            groups = self.membership.start()
            self._setup(groups)
            self._new_iteration(groups.record)
            self.fresh = self.resume and self.checkpointer is not None and self._any_checkpoint()
            if self.fresh:
                self._agree()  # nobody holds state: every rank restores its checkpoint
            self._regroup_done(groups.record, "start", t0)
        else:
            self._rejoin(first=True)

    def step(self) -> None:
        """One iteration, with whatever regroups it takes."""
        try:
            with self.client.iteration(self.it):
                self.faults.at(self.it, "start")
                if self.sched.iter_sleep:
                    time.sleep(self.sched.iter_sleep)
                self._iteration()
        except InjectedFault as fault:
            self._on_injected(fault)
        except Excluded:
            self._rejoin(first=not hasattr(self, "state"))

    def finished(self) -> bool:
        if self.stopping:
            return True
        return bool(self.sched.iterations) and self.it >= self.sched.iterations

    def _iteration(self) -> None:
        start_it = self.it
        while self.it == start_it:
            try:
                if self.pending is not None:
                    reason, same = self.pending
                    self.pending = None
                    self._regroup(reason, same)
                    continue
                self._compute()
                self._reduce()
                join, stop = self._commit_check()
                self._commit(join, stop)
            except CommFailure:
                self.pending = ("failure", False)

    def _on_injected(self, fault: InjectedFault) -> None:
        sev = severity_of_kind(fault.kind)
        if sev is Severity.SEV3:
            # In-place reattempt: break our groups so peers fail fast, regroup with the same members.
            self.client.report_exception(fault, fatal=False)
            self._event("injected", error_kind=fault.kind.value, severity=int(sev))
            self._break(fault)
            self.pending = ("reattempt", True)
            return
        self.client.report_exception(fault, fatal=True)
        self._event("fatal", error_kind=fault.kind.value, severity=int(sev))
        raise SystemExit(3)

    def _collective(self, what: str, fn: Any) -> Any:
        try:
            return fn()
        except (RuntimeError, ValueError) as exc:
            if not is_comm_error(exc):
                raise
            self._broken(what, exc)
        return None

    def _broken(self, what: str, exc: BaseException) -> None:
        t0 = time.time()
        self._break(exc)
        self._event("comm_error", where=what, error=str(exc)[:200], it=self.it, break_s=time.time() - t0)
        self.client.report_exception(exc, fatal=False)
        raise CommFailure(what) from exc

    def _break(self, exc: BaseException | None) -> None:
        """Release this epoch's groups at once so that peers blocked with us fail fast.

        gloo closes its sockets only when a group is destroyed, so every reference goes: the model's
        (rebound to a placeholder), ours, and those in the failed call's stack frames.
        """
        if self.model_tp is not broken_group():
            rebind_groups(self.state.model, self.model_tp, broken_group())
            self.model_tp = broken_group()
        refs = self.groups.release()
        if exc is not None and exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)
        if any(r() is not None for r in refs):
            gc.collect()  # slow with a big model loaded: only when reference counting was not enough
        if any(r() is not None for r in refs):
            log.warning("rank %d: a released process group is still referenced; peers may wait for "
                        "the collective timeout", self.rank)

    # --- compute ---------------------------------------------------------------------------------

    def _epoch_plan(self, rec: EpochRecord) -> tuple[int, Plan]:
        """(live replicas, failure-free plan) of an epoch: computed once, not every iteration."""
        cached = self._plans.get(rec.epoch)
        if cached is None:
            replicas = self.topo.replicas_in(rec.members)
            cached = self._plans[rec.epoch] = (len(replicas), initial_plan(self.layout, replicas))
            for old in [e for e in self._plans if e < rec.epoch]:
                del self._plans[old]
        return cached

    def _new_iteration(self, rec: EpochRecord) -> None:
        self.acc.reset()
        self.prog.reset()
        self.base_epoch = rec.epoch
        self.plan = self._epoch_plan(rec)[1]
        self.todo = list(self.plan.get(self.replica, []))
        self.keep_mask = set()
        self.mb_position = 0

    def _forward_backward(self, mb: int) -> float:
        if self.model_cfg.dropout > 0:  # the only consumer of randomness in the forward
            seed_rng(mb_seed(self.sched.seed, self.it, mb))
        tokens, labels = self.data.batch(self.it, mb)
        loss = lm_loss(self.state.model, tokens, labels, self.groups.tp)
        loss.backward()  # type: ignore[no-untyped-call]
        return float(loss.detach())

    def _compute(self) -> None:
        while self.todo:
            mb = self.todo[0]
            if self.faults.armed:
                self.faults.at(self.it, f"mb{self.mb_position}")
            keep = mb not in self.keep_mask
            self.acc.begin_mb()
            try:
                loss = self._forward_backward(mb)
            except (RuntimeError, ValueError) as exc:
                if not is_comm_error(exc):
                    raise
                self._broken(f"micro-batch {mb}", exc)
            self.acc.end_mb(mb, loss, keep)
            self.todo.pop(0)
            self.mb_position += 1
            if self.client.enabled:
                self.client.microbatch_done(self.it, mb)
        if self.views_checked_at is None or abs(self.it - self.views_checked_at) >= VIEW_CHECK_EVERY:
            self.flat.check_views()
            self.views_checked_at = self.it

    # --- reduce and commit -----------------------------------------------------------------------

    def _join_flag(self) -> float:
        members = self.groups.record.members
        if len(members) == self.topo.world_size:
            return 0.0
        if self.watcher is not None:
            self.watcher.outside = tuple(r for r in range(self.topo.world_size) if r not in members)
            if not self.watcher.join_seen:
                return 0.0  # the watcher saw no request: skip the store on the iteration's path
        return 1.0 if self.membership.has_joiners(members) else 0.0

    def _stop_flag(self) -> float:
        # the agent's Stop was read at the last boundary (_drain_instructions)
        seen = self.watcher.stop_seen if self.watcher is not None else self.store.check([STOP_KEY])
        return 1.0 if self.stop_requested or seen else 0.0

    def _reduce(self) -> None:
        if self.prog.complete:
            return
        join, stop = self._join_flag(), self._stop_flag()
        hook = (lambda b: self.faults.at(self.it, f"bucket{b}")) if self.faults.armed else None
        n = self.flat.numel
        if isinstance(self.acc, Contributions):
            acc = self.acc
            for i, c in enumerate(acc.items):
                c.vec[n + TAIL_JOIN] = join if i == 0 else 0.0
                c.vec[n + TAIL_STOP] = stop if i == 0 else 0.0
            self._collective("gather", lambda: reduce_gather(self.groups.dp, acc, self.prog, hook))
        else:
            vector = self.acc.vector  # type: ignore[attr-defined]
            vector[n + TAIL_LOSS : n + TAIL] = torch.tensor([self.acc.loss_sum, join, stop], dtype=vector.dtype)
            self._collective("all-reduce", lambda: reduce_sum(self.groups.dp, vector, self.prog, hook))

    def _commit_check(self) -> tuple[bool, bool]:
        """(joiners waiting, stop requested), agreed by all. With TP > 1 this is also the commit
        point: every rank of the replica has all buckets before any of them steps (a partner may
        still need our old parameters to recompute a micro-batch)."""
        join, stop = self._tail_flags()
        if self.topo.tp > 1:
            flags = torch.tensor([float(join), float(stop)], dtype=torch.float64)  # never reduce a part
            self._collective("commit", lambda: self.groups.tp.allreduce([flags]).wait())
            join, stop = bool(flags[0] > 0), bool(flags[1] > 0)
        if self.faults.armed:
            self.faults.at(self.it, "commit")
        return join, stop

    def _checkpoint(self) -> None:
        if self.checkpointer is None or not self.ckpt_every or self.it % self.ckpt_every:
            return
        if getattr(self.checkpointer, "shared_by_replicas", False) and self.rank != min(self.groups.dp_ranks):
            return  # one live replica per shard writes; the others hold the same state
        t0 = time.time()
        with self.client.phase(protocol.PHASE_CHECKPOINT):
            self.checkpointer.save(self.state.state_dict(), self.it)
        self._event("checkpoint", it=self.it, seconds=time.time() - t0)

    def _tail_flags(self) -> tuple[bool, bool]:
        tail = self.prog.tail().tolist()
        return tail[TAIL_JOIN] > 0, tail[TAIL_STOP] > 0

    def _commit(self, join: bool, stop: bool) -> None:
        """Step the optimizer with sum/B (the parts hold it) and move to the next iteration."""
        b = self.layout.micro_batches
        grads = self.prog.final_grads()
        if grads is not None:
            self.flat.bind(grads)  # the optimizer reads the reduced buffer in place
        else:
            self.prog.copy_grads_into(self.flat.buf)  # parts spread over both buffers after a recovery
        self.state.optimizer.step()
        loss = float(self.prog.tail()[TAIL_LOSS]) / b
        self.losses.append(loss)
        self._event("iteration", it=self.it, loss=loss, epoch=self.groups.record.epoch,
                    dp=self._epoch_plan(self.groups.record)[0])
        self.state.iteration += 1
        self._new_iteration(self.groups.record)
        self._checkpoint()
        self.gc.at_boundary(self.it)
        self._drain_instructions()
        if stop:
            self.stopping = True
        elif join:
            self.pending = ("admission", True)

    # --- agent -----------------------------------------------------------------------------------

    def _agent_knowledge(self) -> set[int]:
        """Ranks the agent told us are dead (consulted while regrouping)."""
        self._read_instructions()
        return set(self._agent_dead)

    def _read_instructions(self) -> list[protocol.Regroup]:
        regroups: list[protocol.Regroup] = []
        while (msg := self.client.next_instruction()) is not None:
            if isinstance(msg, protocol.Stop):
                self.stop_requested = True
            elif isinstance(msg, protocol.Regroup):
                self._agent_dead |= set(msg.failed)
                regroups.append(msg)
        return regroups

    def _drain_instructions(self) -> None:
        """At an iteration boundary: an agent's Regroup naming a dead member or a new one is acted on."""
        members = set(self.groups.record.members)
        for msg in self._read_instructions():
            if self.pending is None and set(msg.failed) & members:
                self.pending = ("agent", False)
            elif self.pending is None and set(msg.members) - members:
                self.pending = ("admission", True)

    def _regroup_done(self, rec: EpochRecord, reason: str, t0: float, ok: bool = True) -> None:
        dp = len(self.topo.replicas_in(rec.members))
        detail = f"{reason}: members={list(rec.members)} dp={dp} it={self.it}"
        self.client.send(protocol.RegroupDone(generation=rec.epoch, ok=ok, detail=detail))
        self._event("regroup", epoch=rec.epoch, reason=reason, members=list(rec.members), it=self.it,
                    seconds=time.time() - t0, **{k: round(v, 4) for k, v in self.membership.timing.items()})

    # --- regroup ---------------------------------------------------------------------------------

    def _regroup(self, reason: str, assume_same: bool) -> None:
        t0 = time.time()
        self._break(None)
        groups = self.membership.regroup(self.groups.record, reason, assume_same)
        t1 = time.time()
        self._adopt(groups)
        self._agree()
        self.membership.timing["agree_s"] = time.time() - t1
        self._regroup_done(groups.record, reason, t0)

    def _adopt(self, groups: Groups) -> None:
        if groups.tp is not self.model_tp:
            rebind_groups(self.state.model, self.model_tp, groups.tp)
            self.model_tp = groups.tp
        self.groups = groups

    def _rejoin(self, first: bool) -> None:
        """Join (or rejoin after being excluded): wait for admission, then take state from a replica."""
        t0 = time.time()
        if not first:
            self._break(None)
        self.fresh = True
        while True:
            groups = self.membership.join(self.sched.join_timeout_s)
            if first:
                self._setup(groups)
                first = False
            else:
                self._adopt(groups)
            self.acc.reset()
            self.prog.reset()
            try:
                self._agree()
            except CommFailure:
                continue
            break
        self._regroup_done(self.groups.record, "join", t0)

    # status vector exchanged by every member after a regroup
    _HEAD = 5  # rank, iteration, done buckets, fresh, base epoch; then B done flags

    def _status(self) -> torch.Tensor:
        head = [self.rank, -1 if self.fresh else self.it, self.prog.done, int(self.fresh), self.base_epoch]
        done = [0] * self.layout.micro_batches
        if not self.fresh:
            for mb in self.acc.done:
                done[mb] = 1
        return torch.tensor(head + done, dtype=torch.int64)

    def _agree(self) -> None:
        """Phases A-D of the module docstring, collectively over the new epoch's groups."""
        mine = self._status()
        table_t = [torch.empty_like(mine) for _ in range(self.groups.world.size())]
        self._collective("agree", lambda: self.groups.world.allgather([table_t], [mine]).wait())
        table = {int(t[0]): t.tolist() for t in table_t}
        holders = [r for r, row in table.items() if row[3] == 0]
        if not holders:
            self._restore_everyone()
            return
        top = max(table[r][1] for r in holders)
        nb = len(self.prog.bounds)
        dp_ranks = self.groups.dp_ranks

        # A. ranks one iteration behind take the missing buckets from one that stepped, then step.
        behind = [r for r in dp_ranks if r in holders and table[r][1] == top - 1]
        if behind:
            lo = min(table[r][2] for r in behind)
            if lo < nb:
                src = [r for r in dp_ranks if r in holders and (table[r][1] == top or table[r][2] == nb)]
                if not src or (table[src[0]][1] == top and table[src[0]][2] != 0):
                    raise RuntimeInvariantError(f"rank {self.rank}: no holder of iteration {top - 1}'s sums")
                self._fetch_buckets(dp_ranks.index(src[0]), lo, nb, apply=self.rank in behind)
            ahead_base = max(table[r][4] for r in holders if table[r][1] == top)
            if self.rank in behind:
                self.prog.done = nb
                self._commit(*self._tail_flags())
            for r in behind:
                table[r][1], table[r][2], table[r][4] = top, 0, ahead_base
                table[r][5:] = [0] * self.layout.micro_batches

        # B. within this iteration, completed buckets go to members that lack them.
        best: dict[int, int] = {}
        for t in range(self.topo.tp):
            group = [r for r in holders if self.topo.tp_rank(r) == t]
            best[t] = max(table[r][2] for r in group) if group else nb
        mine_best = best[self.topo.tp_rank(self.rank)]
        lacking = [r for r in dp_ranks if r in holders and table[r][2] < mine_best]
        if lacking and mine_best > 0:
            lo = min(table[r][2] for r in lacking)
            src = [r for r in dp_ranks if r in holders and table[r][2] == mine_best]
            apply = not self.fresh
            self._fetch_buckets(dp_ranks.index(src[0]), lo, mine_best, apply=apply)
            if apply:
                self.prog.done = max(self.prog.done, mine_best)
        committed = all(v == nb for v in best.values())
        if committed and not self.fresh and self.it == top:
            self._commit(*self._tail_flags())

        # C. joiners take parameters, optimizer state and iteration from a healthy replica.
        joiners = [r for r in dp_ranks if table[r][3] == 1]
        if any(table[r][3] == 1 for r in table):
            self._transfer_state([r for r in dp_ranks if r in holders], joiners)
            if self.fresh:
                self.fresh = False
                self.acc.reset()
                self.prog.reset()
        if committed:
            self._new_iteration(self.groups.record)
            return

        # D. whatever some group's sum lacks is (re)computed by a live replica.
        self._replan(table, holders)

    def _restore_everyone(self) -> None:
        """No member holds a replica's state (the whole job restarted): all restore the checkpoint,
        which must be of one iteration on every rank."""
        self._transfer_state([], list(self.groups.dp_ranks))
        found = self._restored_iterations()
        if len(found) > 1 and self.checkpointer is not None:
            # A rank's newest snapshot may not have been published when the job died: all go back
            # to the newest iteration every rank holds.
            if self.it != found[0]:
                self.state.load_state_dict(self.checkpointer.restore(iteration=found[0]).state)
            found = self._restored_iterations()
        if len(found) != 1:
            raise RestoreMismatch(f"ranks restored different iterations {found}; no common checkpoint")
        self.fresh = False
        self._new_iteration(self.groups.record)
        self._event("restored", it=self.it)

    def _any_checkpoint(self) -> bool:
        """``--resume`` with no checkpoint on any rank (a first launch) starts from scratch, as
        Megatron's ``--load`` does; the ranks decide together so that none restores alone."""
        assert self.checkpointer is not None
        mine = torch.tensor([int(has_checkpoint(self.checkpointer))], dtype=torch.int64)
        flags = [torch.empty_like(mine) for _ in range(self.groups.world.size())]
        self._collective("resume", lambda: self.groups.world.allgather([flags], [mine]).wait())
        found = any(int(f) for f in flags)
        if not found:
            self._event("fresh_start", reason="--resume: no checkpoint on any rank")
        return found

    def _restored_iterations(self) -> list[int]:
        mine = torch.tensor([self.it], dtype=torch.int64)
        its = [torch.empty_like(mine) for _ in range(self.groups.world.size())]
        self._collective("restore", lambda: self.groups.world.allgather([its], [mine]).wait())
        return sorted({int(t) for t in its})

    def _fetch_buckets(self, root: int, lo: int, hi: int, apply: bool) -> None:
        """Broadcast reduced buckets [lo, hi) from DP-group index ``root``; with ``apply`` take the
        ones this rank lacks (never overwriting a bucket it already reduced)."""
        s, e = self.prog.bounds[lo][0], self.prog.bounds[hi - 1][1]
        if self.groups.dp.rank() == root:
            buf = self.prog.span(lo, hi)
        else:
            buf = torch.empty(e - s, dtype=self.prog.dtype)
        self._collective("catch-up", lambda: self.groups.dp.broadcast(buf, root).wait())
        if apply:
            for b in range(max(self.prog.done, lo), hi):
                bs, be = self.prog.bounds[b]
                self.prog.put(b, buf[bs - s : be - s])

    def _transfer_state(self, holders: list[int], joiners: list[int]) -> None:
        for source in self.sources:
            done = self._collective(
                "state", lambda src=source: src.transfer(
                    self.state, self.groups.dp, self.groups.dp_ranks, holders, joiners, self.rank
                ),
            )
            if done:
                return
        raise RuntimeInvariantError(f"no state source could serve joiners {joiners}")

    def _replan(self, table: dict[int, list[int]], holders: list[int]) -> None:
        b = self.layout.micro_batches
        members = list(self.groups.record.members)
        complete: dict[int, set[int]] = {t: set() for t in range(self.topo.tp)}
        for r in holders:
            complete[self.topo.tp_rank(r)] |= {mb for mb in range(b) if table[r][5 + mb]}
        if self.sched.recovery == "rerun":
            complete = {t: set() for t in complete}
            self.acc.reset()
            self.prog.reset()
        progress = any(complete.values()) or any(table[r][2] for r in holders)
        needed = [mb for mb in range(b) if any(mb not in c for c in complete.values())]
        alive = self.topo.replicas_in(members)
        if not progress:
            # Nothing computed yet: plan afresh for the new membership.
            self.base_epoch = self.groups.record.epoch
            self.plan = initial_plan(self.layout, alive)
        else:
            bases = {table[r][4] for r in holders}
            if len(bases) != 1:
                raise RuntimeInvariantError(f"members disagree on the iteration's base epoch: {sorted(bases)}")
            self.base_epoch = bases.pop()
            base = self._record(self.base_epoch)
            self.plan = redistribute(initial_plan(self.layout, self.topo.replicas_in(base.members)), alive, needed)
        self.todo = list(self.plan.get(self.replica, []))
        self.keep_mask = complete[self.topo.tp_rank(self.rank)]
        self.prog.table = None
        self.membership.timing.update(kept_buckets=self.prog.done, redo_mbs=len(self.todo))

    def _record(self, epoch: int) -> EpochRecord:
        if epoch == self.groups.record.epoch:
            return self.groups.record
        raw = self.store.get(f"epoch/{epoch}")
        return EpochRecord.decode(raw)

    # --- outputs ---------------------------------------------------------------------------------

    def write_outputs(self, out_dir: str) -> None:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, f"rank{self.rank}.json"), "w") as fh:
            json.dump(
                {"rank": self.rank, "incarnation": self.incarnation, "iterations": self.it,
                 "losses": list(self.losses), "events": [e.__dict__ for e in self.events]},
                fh,
            )
        if not self.fresh and hasattr(self, "state"):
            torch.save(
                {k: v.detach().clone() for k, v in self.state.model.state_dict().items() if isinstance(v, torch.Tensor)},
                os.path.join(out_dir, f"rank{self.rank}.pt"),
            )

