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

The gradient is always sum(all B micro-batches) / B, whoever computed them. The steps of a recovery
(release groups -> regroup -> agree -> transfer -> resume) and the decisions A-D taken from the
members' status table are in :mod:`unicron.runtime.recovery`.

Lifecycle of a rank (:class:`RankMode`)::

    STARTING --first launch--> TRAINING <--recovered-- RECOVERING <--failure, sev3 error,
       |                        |   ^                                 joiners, agent's Regroup-- TRAINING
       |                        |   +--state received-- JOINING <--excluded from an epoch-- TRAINING
       +--restarted (or --resume with checkpoints)--> JOINING --the job finished meanwhile--> JOB_DONE
    TRAINING --stop agreed at a commit--> STOPPING --> FINISHED
    TRAINING --agent's Leave, agreed at a commit, excluded from the next epoch--> LEFT (exit 0)
    TRAINING --last iteration committed--> FINISHED

A rank holds a valid replica's state in TRAINING, RECOVERING, STOPPING and FINISHED; in JOINING it
has (at most) a model whose parameters are about to be overwritten: by a replica's, or by the
checkpoint's when no member of the epoch holds state (a ``--resume`` launch, or an epoch the joiners
formed after no complete replica survived: :mod:`unicron.runtime.membership`). Time in RECOVERING and JOINING is
reported to the agent as the ``regroup`` phase, which its hang detection does not judge.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist

from ckpt.api import Checkpointer, NoRoomForSnapshot, SaveOutcome, StorageUnavailable
from unicron.kernel import log as ulog
from unicron.kernel import protocol
from unicron.kernel.client import AgentClient, InjectedFault
from unicron.kernel.errors import ConfigError, PermanentError, TemporaryError
from unicron.kernel.patterns import match
from unicron.kernel.types import ErrorKind, Severity
from unicron.runtime import membership, reaper, stdout
from unicron.runtime.checkpoint import PersistWatch, Presence, TorchSaveCheckpointer, checkpoint_presence
from unicron.runtime.comm import CommGroup, RendezvousStore, broken_group
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
from unicron.runtime.hostloss import HostLoss
from unicron.runtime.job import BatchT, Job, grad_dtype
from unicron.runtime.membership import (
    CommSettings,
    Excluded,
    Groups,
    JobFinished,
    Membership,
    NoCompleteReplica,
)
from unicron.runtime.model import rebind_groups
from unicron.runtime.plan import BatchLayout, Plan, Topology, initial_plan, mb_seed, seed_rng
from unicron.runtime.preempt import Preemption, save_persistent
from unicron.runtime.recovery import (
    RankStatus,
    RegroupDue,
    RegroupReason,
    StatusTable,
    after_catch_up,
    best_buckets,
    joiners,
    plan_catch_up,
    plan_resume,
    plan_share,
    state_holders,
    table_of,
    top_iteration,
)
from unicron.runtime.reshard import TpLayout, restore_resharded
from unicron.runtime.state import (
    CheckpointSource,
    OptimConfig,
    Outcome,
    ReplicaBroadcast,
    ReplicaState,
    StateSource,
)
from unicron.runtime.store import STORE_ERRORS
from unicron.runtime.store import connect as connect_store

T = TypeVar("T")

RECOVERY_MODES = ("redistribute", "rerun")
FINISHED_KEY = membership.FINISHED_KEY
"""Store key written when training ends, so that ranks waiting to join exit too."""


class RankMode(Enum):
    """Where a rank is in its lifecycle (module docstring)."""

    STARTING = "starting"  # process up; no groups, no model
    JOINING = "joining"  # waiting for admission, or agreeing to receive (or restore) the state
    TRAINING = "training"  # a member holding state, running iterations
    RECOVERING = "recovering"  # a member holding state, in a recovery
    STOPPING = "stopping"  # every member agreed at the last commit to stop
    FINISHED = "finished"  # trained to the end (or stopped)
    JOB_DONE = "job_done"  # the job finished before this rank held any state: nothing to do
    LEFT = "left"  # asked to leave (an in-place shrink): the others agreed an epoch without it


HOLDS_STATE = frozenset({RankMode.TRAINING, RankMode.RECOVERING, RankMode.STOPPING, RankMode.FINISHED})


@dataclass
class Held:
    """What a rank holds once it has a model: built with its first groups, kept across regroups."""

    state: ReplicaState
    flat: FlatGrads
    prog: ReduceProgress
    acc: Accumulator


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
    #: print ``iteration N done TS pid P dp D`` on stdout at each commit (the rank's own clock; benchmarks)
    log_iterations: bool = False


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


class StoreLost(PermanentError):
    """The task's store is gone and the agent named no new one in time."""


class _StoreMoved(Exception):
    """The agent said the store moved while this rank regrouped on the old one: move, then regroup."""


class CheckpointsOutOfReach(PermanentError):
    """``--resume`` cannot tell a first launch from checkpoints it cannot reach: this launch ends (a
    relaunch may find the storage answering)."""


class CommFailure(TemporaryError):
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


def starts_the_job(incarnation: int, store_epoch: int) -> bool:
    """Whether a rank's process starts the job (epoch 0) rather than joins it. Only a first process on
    the launch's store starts: a store that moved (``store_epoch`` > 0) belongs to a running job, and
    its counters of a rank the survivors no longer held are not re-seeded, so a returning rank can
    count itself in as incarnation 1 there (resize soak: it started the job alone, proposed epochs
    nobody else entered and waited 90 s at their barrier)."""
    return incarnation == 1 and store_epoch == 0


def severity_of_kind(kind: ErrorKind) -> Severity:
    """Table 1 severity of an exception a rank raises (the table is ``unicron.kernel.severity``)."""
    from unicron.kernel.severity import severity_of
    from unicron.kernel.types import DetectionMethod

    sev = severity_of(DetectionMethod.EXCEPTION_PROPAGATION, kind)
    return sev if sev is not None else Severity.SEV2


class Trainer(Generic[BatchT]):
    """Runs managed training of ``job`` on one rank (lifecycle: :class:`RankMode`)."""

    def __init__(
        self,
        *,
        rank: int,
        topo: Topology,
        store: RendezvousStore,
        incarnation: int,
        job: Job[BatchT],
        optim_cfg: OptimConfig,
        sched: ScheduleConfig,
        comm: CommSettings,
        client: AgentClient,
        faults: FaultScript,
        checkpointer: Checkpointer | None = None,
        ckpt_every: int = 0,
        resume: bool = False,
        watcher: Heartbeat | None = None,
        preemption: Preemption | None = None,
        store_host: str = "",
        store_epoch: int = 0,
        address: str = "",
    ) -> None:
        if sched.recovery not in RECOVERY_MODES:
            raise ConfigError(f"--recovery {sched.recovery!r}: choose one of {RECOVERY_MODES}")
        self.rank, self.topo, self.store, self.incarnation = rank, topo, store, incarnation
        self.job, self.optim_cfg, self.sched, self.comm = job, optim_cfg, sched, comm
        self.client, self.faults = client, faults
        #: where this rank's node is reached (``host/<rank>/<incarnation>``; re-published on a moved store)
        self.address = address
        #: where the model, its gradients and every collective's tensors live (``CommSettings.device``)
        self.device = torch.device(comm.device)
        if self.device.type == "cuda":  # pragma: no cover - GPU only
            torch.cuda.set_device(self.device)
        self.layout = BatchLayout(sched.micro_batches, sched.blocks or topo.replicas)
        self.checkpointer, self.ckpt_every, self.resume = checkpointer, ckpt_every, resume
        if isinstance(checkpointer, TorchSaveCheckpointer):
            checkpointer.use_shard(topo.tp_rank(rank))  # the files of this rank's model-parallel shard
        self.watcher = watcher
        self.preempt = preemption if preemption is not None else Preemption()  # SIGTERM: stop, snapshot
        self.log = ulog.get(__name__, rank=rank, incarnation=incarnation)
        self.sources: list[StateSource] = [ReplicaBroadcast()]
        if checkpointer is not None:
            self.sources.append(CheckpointSource(checkpointer))
        self.membership = Membership(store, rank, topo, incarnation, comm, poll=self._poll_agent)
        self._regrouped_at = -1e9  # monotonic time the last recovery regroup completed
        self.events: deque[Event] = deque(maxlen=EVENT_LOG_LIMIT)
        #: the saves whose persist outcome is still to be read (at the next save, and after a stop's wait)
        self.persists = PersistWatch()
        self.mode = RankMode.STARTING
        self.stop_requested = False  # asked (agent Stop or the store's stop key); acted on once agreed
        self.leaving = False  # the agent's Leave: raise the membership flag until an epoch leaves us out
        self.due: RegroupDue | None = None  # a regroup to run before the next attempt at the iteration
        self._groups: Groups | None = None  # set once admitted to an epoch
        #: lost hosts' connections are cut on the agent client's reader thread (the training thread may
        #: be blocked on them)
        self.host_loss = HostLoss(rank, store_host, store_epoch, address, lambda: self.membership.hosts)
        client.on_host_lost = self.host_loss.on_message
        self._held: Held | None = None  # built once, with the first groups
        self.model_tp: CommGroup = broken_group()  # the tensor-parallel group the model is bound to
        self.plan: Plan = {}
        self.todo: list[int] = []
        self.keep_mask: frozenset[int] = frozenset()  # micro-batches some member of my DP group already holds
        self.base_epoch = 0
        self.job_iterations = 0  # iterations of the job when it finished before this rank held state
        self.mb_position = 0
        self.views_checked_at: int | None = None  # iteration of the last check that .grad views the flat buffer
        self.losses: deque[float] = deque(maxlen=EVENT_LOG_LIMIT)
        self.gc = GcPolicy(sched.manual_gc_interval)
        self._plans: dict[int, tuple[int, Plan]] = {}  # epoch -> (live replicas, failure-free plan)
        self.store_epoch = store_epoch  # the store this rank uses: 0 = its launch's (or the one it was launched on)
        self.moved: protocol.StoreMoved | None = None  # the agent's word that the store moved, not yet acted on
        self._epochs: dict[int, EpochRecord] = {}  # records of the epochs this rank was in (a moved store lacks them)

    # --- what the rank holds -----------------------------------------------------------------------

    def _need(self) -> Held:
        if self._held is None:
            raise RuntimeInvariantError(f"rank {self.rank} has no model yet (mode {self.mode.value})")
        return self._held

    @property
    def groups(self) -> Groups:
        if self._groups is None:
            raise RuntimeInvariantError(f"rank {self.rank} is in no epoch yet (mode {self.mode.value})")
        return self._groups

    @property
    def state(self) -> ReplicaState:
        return self._need().state

    @property
    def flat(self) -> FlatGrads:
        return self._need().flat

    @property
    def prog(self) -> ReduceProgress:
        return self._need().prog

    @property
    def acc(self) -> Accumulator:
        return self._need().acc

    @property
    def holds_state(self) -> bool:
        """Whether this rank's parameters are a valid replica (not a joiner's or a restorer's)."""
        return self.mode in HOLDS_STATE

    @property
    def replica(self) -> int:
        return self.topo.replica_of(self.rank)

    @property
    def it(self) -> int:
        return self.state.iteration

    def _event(self, kind: str, **data: Any) -> None:
        self.events.append(Event(kind, time.time(), data))

    # --- setup -----------------------------------------------------------------------------------

    def _remember(self, rec: EpochRecord) -> None:
        """Keep the records of this rank's recent epochs (a moved store is re-seeded with them)."""
        self._epochs[rec.epoch] = rec
        for old in sorted(self._epochs)[:-4]:
            del self._epochs[old]

    def _setup(self, groups: Groups) -> None:
        self._remember(groups.record)
        self._groups = groups
        model = self.job.build_model(groups.tp).to(self.device)
        self.model_tp = groups.tp
        state = ReplicaState(model, self.optim_cfg, TpLayout(self.topo.tp, self.topo.tp_rank(self.rank)))
        flat = FlatGrads(state.params, grad_dtype(state.params))
        prog = ReduceProgress(bucket_bounds(flat.numel + TAIL, self.sched.bucket_elems), flat.buf.dtype,
                              numel=flat.numel, scale=1.0 / self.layout.micro_batches, device=flat.buf.device)
        self._held = Held(state, flat, prog, self._accumulator(flat, self.sched.deterministic))
        self.views_checked_at = None
        self.gc.after_setup()

    def _accumulator(self, flat: FlatGrads, deterministic: bool) -> Accumulator:
        acc: Accumulator
        if deterministic:
            acc = Contributions(flat, self.layout)
        elif self.topo.tp > 1:
            acc = SafeSum(flat)
        else:
            acc = DirectSum(flat)
        acc.reset()
        return acc

    def set_deterministic(self, on: bool) -> None:
        """Choose the accumulation (and so the reduction) mode; only at an iteration boundary."""
        held = self._need()
        if held.acc.done or held.prog.done:
            raise RuntimeInvariantError("the reduction mode can change only between iterations")
        held.acc = self._accumulator(held.flat, on)

    # --- main loop -------------------------------------------------------------------------------

    def run(self) -> int:
        """Train until the configured iterations are done or the job is stopped; returns an exit code."""
        self.preempt.install(idle=lambda: self._held is None or not self.holds_state)
        try:
            self.begin()
            while not self.finished():
                self.step()
        except JobFinished as done:
            self._finished_before_joining(done)
            return 0
        finally:
            self.gc.close()
        if self.mode is RankMode.LEFT:
            return 0  # the job goes on without this rank: not its end
        stopped = self.mode is RankMode.STOPPING
        try:
            self.store.set(FINISHED_KEY, str(self.it))
        except Exception as exc:  # a stopping task's store may go first; the exit stays 0
            if not stopped:
                raise
            self.log.warning("could not mark the job finished in the store", error=str(exc))
        self.mode = RankMode.FINISHED
        wait = getattr(self.checkpointer, "wait", None)
        if callable(wait):
            wait()  # let the last snapshot's background work finish before the process exits
        self._report_persist_failures()
        if stopped:
            if self.preempt.requested:
                self.preempt.report(self.rank, self.it)
            self.client.stopped(self.it, self.preempt.saved[0] if self.preempt.saved else None)
        return 0

    def _finished_before_joining(self, done: JobFinished) -> None:
        self.mode = RankMode.JOB_DONE
        self.job_iterations = done.iteration
        self._event("finished", note="the job completed while this rank waited to join", it=done.iteration)
        self.log.warning("job already finished; this rank exits without training", iterations=done.iteration)

    def begin(self) -> None:
        """Enter the job: epoch 0 on a first start (restoring the checkpoint with ``resume``), else
        wait to be admitted and take the state from a replica."""
        if not starts_the_job(self.incarnation, self.store_epoch):
            self._rejoin()
            return
        t0 = time.time()
        groups = self.membership.start()
        self._setup(groups)
        self._new_iteration(groups.record)
        self.mode = RankMode.TRAINING
        if self.resume and self.checkpointer is not None and not self._restore_at_start():
            return  # excluded meanwhile: joined as a restarted rank does, and said so
        self._regroup_done(self.groups.record, RegroupReason.START, t0)

    def _restore_at_start(self) -> bool:
        """``--resume``: the ranks decide together whether any holds a checkpoint, and restore it. Until
        they have, nobody holds state (JOINING), so a rank dying meanwhile makes the others regroup
        without it and decide again; its restart joins once they train. Before, the failed collective
        escaped as a traceback, every restarted process was a joiner, and nobody was left to admit one.
        False when this rank was excluded by such a regroup and joined instead.

        Every attempt enters through the agreement's status exchange, the first collective of any
        member's recovery: a peer whose last collective of the restore succeeded (where ours failed) is
        training already and meets us in its regroup's agreement, which gives us its state. Deciding
        on the checkpoint first (one int against its status row) aborted gloo on the size mismatch."""
        while True:
            self.mode = RankMode.JOINING
            if self.faults.armed:
                self.faults.at(self.it, "resume")
            try:
                self._agree(at_start=True)  # no state holder: decide on the checkpoint, restore it
                self._recovered()
                return True
            except CommFailure:
                self._event("restore_retried", it=self.it)
            try:
                groups = self.membership.regroup(self.groups.record, RegroupReason.FAILURE.value)
            except Excluded:
                self._rejoin()
                return False
            self._adopt(groups)

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
            if self.leaving:
                self._left()
            else:
                self._rejoin()

    def _left(self) -> None:
        """Excluded as asked: the others run the agreed epoch without this rank."""
        self.mode = RankMode.LEFT
        self._event("left", it=self.it)
        self.log.info("left the job as asked", step=self.it)

    def finished(self) -> bool:
        if self.mode in (RankMode.STOPPING, RankMode.LEFT):
            return True
        return bool(self.sched.iterations) and self.it >= self.sched.iterations

    def _iteration(self) -> None:
        start_it = self.it
        while self.it == start_it:
            try:
                if self.due is not None:
                    due, self.due = self.due, None
                    self._regroup(due)
                    continue
                self._compute()
                # Said to the agent: when the task hangs, the rank outside the collective is the one
                # its peers wait for (coordinator/causes.py: hang_culprit).
                with self.client.phase(protocol.PHASE_COLLECTIVE):
                    self._reduce()
                    join, stop = self._commit_check()
                self._commit(join, stop)
            except CommFailure:
                self.due = RegroupDue(RegroupReason.FAILURE, assume_same=False)
            except STORE_ERRORS as exc:  # the store went with its node (collectives fail as CommFailure)
                self._move_store(exc)
                self.due = RegroupDue(RegroupReason.FAILURE, assume_same=False)
            except _StoreMoved:  # told while regrouping on the old store: the lost ranks' marks come with the move
                self._move_store(None)
                self.due = RegroupDue(RegroupReason.FAILURE, assume_same=True)

    def _move_store(self, exc: BaseException | None) -> None:
        """Go on with the task's store on another node: wait for the agent's ``StoreMoved`` (its node
        was lost, or its sidecar died; an in-place resize named a new one, whose agent started it), connect, re-seed
        it with what this rank holds, and point the membership and the heartbeat at it. The wait is a
        recovery (the regroup phase), not a hang of the iteration."""
        t_wait = time.time()
        deadline = time.monotonic() + self.comm.regroup_timeout_s
        with self.client.phase(protocol.PHASE_REGROUP):
            while self.moved is None:
                if not self.client.enabled or time.monotonic() > deadline:
                    raise StoreLost(f"rank {self.rank}: the task's store failed ({exc}) and the agent named "
                                    f"no new one within {self.comm.regroup_timeout_s:.0f}s") from exc
                self._read_instructions()
                time.sleep(self.comm.poll_s * 4)
        msg, self.moved = self.moved, None
        t0 = time.time()
        store = connect_store(msg.host, msg.port)
        records = list(self._epochs.values()) or ([self._groups.record] if self._groups is not None else [])
        membership.reseed(store, self.rank, self.incarnation, records, msg.lost, self.leaving, self.address)
        self.store, self.store_epoch, self.faults.store = store, msg.store_epoch, store
        self.membership.use(store)
        if self.watcher is not None:
            self.watcher.move(msg.host, msg.port)
        self._event("store_moved", store_epoch=msg.store_epoch, lost=list(msg.lost), waited_s=t0 - t_wait,
                    seconds=time.time() - t0, error=str(exc).splitlines()[0] if exc is not None else "")
        self.log.info("store moved", store_epoch=msg.store_epoch, host=msg.host, port=msg.port, lost=list(msg.lost))

    def _on_injected(self, fault: InjectedFault) -> None:
        sev = severity_of_kind(fault.kind)
        if sev is Severity.SEV3:
            # In-place reattempt: break our groups so peers fail fast, regroup with the same members.
            self.client.report_exception(fault, fatal=False)
            self._event("injected", error_kind=fault.kind.value, severity=int(sev))
            self._break(fault)
            self.due = RegroupDue(RegroupReason.REATTEMPT, assume_same=True)
            return
        self.client.report_exception(fault, fatal=True)
        self._event("fatal", error_kind=fault.kind.value, severity=int(sev))
        raise SystemExit(3)

    def _collective(self, what: str, fn: Callable[[], T]) -> T | None:
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
        """Recovery step 1, release groups: drop this epoch's groups at once so that peers blocked
        with us fail fast.

        gloo closes its sockets only when a group is destroyed, so every reference goes: the model's
        (rebound to a placeholder), ours, and those in the failed call's stack frames; the destructor
        then runs on a thread of its own (:mod:`unicron.runtime.reaper`) while this one goes on.
        """
        if self.model_tp is not broken_group():
            rebind_groups(self.state.model, self.model_tp, broken_group())
            self.model_tp = broken_group()
        released = self.groups.release()
        if exc is not None and exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)
        reaper.destroy(released, self.log)

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
        self.keep_mask = frozenset()
        self.mb_position = 0

    def _forward_backward(self, mb: int) -> float:
        # Randomness in the forward (dropout) is the micro-batch's own, whichever rank computes it.
        seed_rng(mb_seed(self.sched.seed, self.it, mb))
        # The wait for data is reported as a phase: a slow read from a shared filesystem is not a
        # hang of the iteration (the agent bounds the wait on its own, agent/iterations.py).
        with self.client.phase(protocol.PHASE_DATA):
            batch = self.job.data.batch(self.it, mb)
        loss = self.job.forward(self.state.model, batch)
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
                if self.todo:  # an injected fault lands inside the iteration, as a scripted mbN one does
                    self.client.check_injected()
        if self.views_checked_at is None or abs(self.it - self.views_checked_at) >= VIEW_CHECK_EVERY:
            self.flat.check_views()
            self.views_checked_at = self.it

    # --- reduce and commit -----------------------------------------------------------------------

    def _join_flag(self) -> float:
        """1 when the membership should change at this commit: joiners wait, or this rank leaves."""
        if self.leaving:
            return 1.0
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
        return 1.0 if self.stop_requested or self.preempt.requested or seen else 0.0

    def _reduce(self) -> None:
        if self.prog.complete:
            return
        join, stop = self._join_flag(), self._stop_flag()
        hook = (lambda b: self.faults.at(self.it, f"bucket{b}")) if self.faults.armed else None
        n = self.flat.numel
        if isinstance(self.acc, Contributions):
            acc = self.acc  # the flags ride in the contribution table: a rank may hold no contribution
            flags = (int(join), int(stop))
            self._collective("gather", lambda: reduce_gather(self.groups.dp, acc, self.prog, hook, flags))
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
            flags = torch.tensor([float(join), float(stop)], dtype=torch.float64, device=self.device)  # not a part
            self._collective("commit", lambda: self.groups.tp.allreduce([flags]).wait())
            join, stop = bool(flags[0] > 0), bool(flags[1] > 0)
        if self.faults.armed:
            self.faults.at(self.it, "commit")
        return join, stop

    def _ckpt_writer(self) -> bool:
        # one live replica per shard writes shared files; the others hold the same state
        shared = getattr(self.checkpointer, "shared_by_replicas", False)
        return not shared or self.rank == min(self.groups.dp_ranks)

    def _checkpoint(self, stopping: bool) -> bool:
        """The periodic checkpoint, if due at this boundary; whether this rank saved. At a stop's
        boundary it is the stop's snapshot too, so it is persisted now (``persist_every`` skipped it,
        and the stop's own save was skipped for it: the newest state stayed in node memory)."""
        if self.checkpointer is None or not self.ckpt_every or self.it % self.ckpt_every:
            return False
        if not self._ckpt_writer():
            return False
        self._report_persist_failures()  # the earlier saves' persists, finished in the background since
        t0 = time.time()
        try:
            with self.client.phase(protocol.PHASE_CHECKPOINT):
                if stopping and self.preempt.snapshot:
                    ticket = save_persistent(self.checkpointer, self.state.state_dict(), self.it)
                else:
                    ticket = self.checkpointer.save(self.state.state_dict(), self.it)
            self.persists.track(ticket)
        except (StorageUnavailable, NoRoomForSnapshot) as exc:
            # as memory mode's failed persist: the previous checkpoint stays and training goes on (a
            # full disk, or a full /dev/shm, killed the rank here at every relaunch: a crash loop)
            self.log.warning("checkpoint not saved", step=self.it, error=str(exc))
            self._event("checkpoint_failed", it=self.it, error=str(exc))
            return False
        self._event("checkpoint", it=self.it, seconds=time.time() - t0)
        return True

    def _stop_snapshot(self, saved: bool) -> None:
        """A stop agreed at this boundary: the on-demand snapshot (``preempt.py``), on every stop."""
        if self.checkpointer is None or not self.preempt.snapshot:
            return
        t0 = time.time()
        try:
            with self.client.phase(protocol.PHASE_CHECKPOINT):
                self.persists.track(self.preempt.save(self.checkpointer, self.state.state_dict, self.it,
                                                      writer=self._ckpt_writer(), already_saved=saved))
        except (StorageUnavailable, NoRoomForSnapshot) as exc:  # the stop goes on: its relaunch resumes the previous checkpoint
            self.log.warning("stop snapshot not saved", step=self.it, error=str(exc))
            return
        self._event("stop_snapshot", it=self.it, seconds=time.time() - t0)
        # waited for: the stop line says whether the snapshot outlives the node (it said "saved" with
        # nothing in storage)
        for outcome in self._report_persist_failures():
            if self.preempt.saved is not None and outcome.iteration == self.preempt.saved[0]:
                self.preempt.not_persisted = outcome.errors[-1] if outcome.errors else "persist failed"

    def _report_persist_failures(self) -> list[SaveOutcome]:
        """A ``persist_failed`` event (and a warning) per save whose persist failed since the last look;
        returns their outcomes."""
        failed = self.persists.not_persisted()
        for outcome in failed:
            self.log.warning("snapshot not persisted", step=outcome.iteration, errors=list(outcome.errors),
                             newest_persisted=self.persists.newest_persisted)
            self._event("persist_failed", it=outcome.iteration, errors=list(outcome.errors),
                        newest_persisted=self.persists.newest_persisted)
        return failed

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
            self.flat.bind(self.flat.buf)
        if self.checkpointer is not None:
            # a snapshot's copies still running (a GPU side stream, a CPU overlap thread) end before the
            # step changes the tensors: without it they were judged only by version counters afterwards
            self.checkpointer.fence()
        self.state.optimizer.step()
        loss = float(self.prog.tail()[TAIL_LOSS]) / b
        self.losses.append(loss)
        self._event("iteration", it=self.it, loss=loss, epoch=self.groups.record.epoch,
                    dp=self._epoch_plan(self.groups.record)[0])
        if self.sched.log_iterations:
            stdout.status(f"iteration {self.it} done {time.time():.6f} pid {os.getpid()} "
                          f"dp {self._epoch_plan(self.groups.record)[0]}")
        self.state.iteration += 1
        self._new_iteration(self.groups.record)
        saved = self._checkpoint(stopping=stop)
        self.gc.at_boundary(self.it)
        self._drain_instructions()
        if stop:
            self._stop_snapshot(saved)
            self.mode = RankMode.STOPPING
        elif join:
            self.due = RegroupDue(RegroupReason.ADMISSION, assume_same=True)


    # --- agent -----------------------------------------------------------------------------------

    def _poll_agent(self) -> None:
        """While regrouping: a Leave or Stop arriving now is noted (a Regroup is moot: we are regrouping).
        A member told that the store moved stops agreeing anything on the old one (should it still
        answer, the others are gone from it: their heartbeats there stop, and it would agree alone)."""
        self._read_instructions()
        if self.moved is not None and self.mode in (RankMode.TRAINING, RankMode.RECOVERING):
            raise _StoreMoved()

    def _read_instructions(self) -> list[protocol.Regroup]:
        regroups: list[protocol.Regroup] = []
        while (msg := self.client.next_instruction()) is not None:
            if isinstance(msg, protocol.Stop):
                self.stop_requested = True
            elif isinstance(msg, protocol.Regroup):
                regroups.append(msg)
            elif isinstance(msg, protocol.StoreMoved) and msg.store_epoch > max(
                    self.store_epoch, self.moved.store_epoch if self.moved is not None else 0):
                self.moved = msg
            elif isinstance(msg, protocol.Leave) and not self.leaving:
                self.leaving = True
                try:
                    self.membership.leave()
                except STORE_ERRORS:  # the store moved: the re-seed of the new one writes it (self.leaving)
                    self.log.info("leave waits for the moved store", step=self.it if self._held is not None else -1)
                self._event("leave_requested", it=self.it if self._held is not None else -1, reason=msg.reason)
        return regroups

    def _drain_instructions(self) -> None:
        """At an iteration boundary: an agent's Regroup (a sev3 reattempt) or one naming a new member is
        acted on. A reattempt the ranks already ran themselves (the reporter broke its groups and
        everyone regrouped) is not run again: the Regroup reaches us a round trip through the
        coordinator later, so one within a heartbeat window of our last regroup is that one. Its
        ``failed`` ranks are the reporters, alive, so the regroup assumes the same members (deaths
        are still read from the failed counters and heartbeats)."""
        members = set(self.groups.record.members)
        regrouped = time.monotonic() - self._regrouped_at < self.comm.heartbeat_window_s
        for msg in self._read_instructions():
            if self.due is None and set(msg.failed) & members and not regrouped:
                self.due = RegroupDue(RegroupReason.AGENT, assume_same=True)
            elif self.due is None and set(msg.members) - members:
                self.due = RegroupDue(RegroupReason.ADMISSION, assume_same=True)
        if self.moved is not None:  # no store call failed yet (none on the iteration's path): move now
            self._move_store(None)
            self.due = RegroupDue(RegroupReason.FAILURE, assume_same=True)  # the re-seed marked the lost

    def _regroup_done(self, rec: EpochRecord, reason: RegroupReason, t0: float, ok: bool = True) -> None:
        if reason in (RegroupReason.FAILURE, RegroupReason.REATTEMPT, RegroupReason.AGENT):
            self._regrouped_at = time.monotonic()  # a recovery: what an agent's Regroup would ask for
        dp = len(self.topo.replicas_in(rec.members))
        detail = f"{reason.value}: members={list(rec.members)} dp={dp} it={self.it}"
        self.client.send(protocol.RegroupDone(epoch=rec.epoch, ok=ok, detail=detail, dp=dp))
        self._event("regroup", epoch=rec.epoch, reason=reason.value, members=list(rec.members), it=self.it,
                    seconds=time.time() - t0, **{k: round(v, 4) for k, v in self.membership.timing.items()})
        self.log.info("regrouped", epoch=rec.epoch, reason=reason.value, members=list(rec.members), step=self.it,
                      seconds=round(time.time() - t0, 3))

    # --- recovery: release groups -> regroup -> agree -> transfer -> resume ----------------------

    def _regroup(self, due: RegroupDue) -> None:
        """A member's recovery. The agent sees the regroup phase: the pause is not judged as a hang."""
        t0 = time.time()
        self.mode = RankMode.RECOVERING
        with self.client.phase(protocol.PHASE_REGROUP):
            self._break(None)
            groups = self.membership.regroup(self.groups.record, due.reason.value, due.assume_same,
                                             admit=due.reason is RegroupReason.ADMISSION)
            t1 = time.time()
            self._adopt(groups)
            self._agree()
            self.membership.timing["agree_s"] = time.time() - t1
        self._recovered()
        self._regroup_done(groups.record, due.reason, t0)

    def _recovered(self) -> None:
        """Back to training after a recovery (unless the agreement committed a stop)."""
        if self.mode is RankMode.RECOVERING:
            self.mode = RankMode.TRAINING

    def _adopt(self, groups: Groups) -> None:
        self._remember(groups.record)
        if groups.tp is not self.model_tp:
            rebind_groups(self.state.model, self.model_tp, groups.tp)
            self.model_tp = groups.tp
        self._groups = groups

    def _rejoin(self) -> None:
        """Join (or rejoin after being excluded): wait for admission, then take state from a replica."""
        t0 = time.time()
        if self._groups is not None:
            self._break(None)
        self.mode = RankMode.JOINING
        with self.client.phase(protocol.PHASE_REGROUP):
            groups: Groups | None = None
            while True:
                if groups is None:
                    try:
                        groups = self.membership.join(self.sched.join_timeout_s,
                                                      restorable=self.checkpointer is not None)
                    except STORE_ERRORS as exc:  # the store moved while we waited: ask again there
                        self._move_store(exc)
                        continue
                    if groups is None:  # asked to leave while waiting: nobody admits us
                        self._left()
                        return
                if self._held is None:
                    self._setup(groups)
                else:
                    self._adopt(groups)
                self.acc.reset()
                self.prog.reset()
                try:
                    self._agree()
                except CommFailure:
                    groups = self._regroup_joined()
                    continue
                break
        self._recovered()
        self._regroup_done(self.groups.record, RegroupReason.JOIN, t0)

    def _regroup_joined(self) -> Groups | None:
        """The agreement of the epoch this rank was admitted to failed: regroup from it as its other
        members do. Waiting to be admitted again instead left a restart epoch (membership, "No complete
        replica survives") stuck: all its members were joiners, so none would propose the next. None:
        left out of the next epoch (or the store moved): wait to be admitted."""
        try:
            return self.membership.regroup(self.groups.record, RegroupReason.FAILURE.value)
        except Excluded:
            return None
        except STORE_ERRORS as exc:
            self._move_store(exc)
            return None

    def _status(self) -> RankStatus:
        holds = self.holds_state
        return RankStatus(
            rank=self.rank, iteration=self.it if holds else -1, buckets=self.prog.done, holds_state=holds,
            base_epoch=self.base_epoch, done=frozenset(self.acc.done) if holds else frozenset(),
        )

    def _exchange_status(self) -> StatusTable:
        mine = self._status().encode(self.layout.micro_batches).to(self.device)
        rows = [torch.empty_like(mine) for _ in range(self.groups.world.size())]
        self._collective("agree", lambda: self.groups.world.allgather([rows], [mine]).wait())
        return table_of(rows)

    def _agree(self, at_start: bool = False) -> None:
        """Recovery steps agree -> transfer -> resume, collectively over the new epoch's groups.
        ``at_start`` (``--resume``): with no state holder, the ranks first decide whether any checkpoint
        exists (none: a first launch starts afresh)."""
        table = self._exchange_status()
        if not state_holders(table):
            if at_start and not self._any_checkpoint():
                self._new_iteration(self.groups.record)  # a first launch: the initial state is everyone's
                self.mode = RankMode.RECOVERING
                return
            self._restore_everyone()
            return
        nb = len(self.prog.bounds)
        top = top_iteration(table)
        table = self._catch_up(table, nb)
        best = best_buckets(table, self.topo, nb)
        self._share_buckets(table, best[self.topo.tp_rank(self.rank)])
        committed = all(v == nb for v in best.values())
        if committed and self.holds_state and self.it == top:
            self._commit(*self._tail_flags())
        self._transfer(table)
        if committed:
            self._new_iteration(self.groups.record)
            return
        self._resume(table)

    def _catch_up(self, table: StatusTable, nb: int) -> StatusTable:
        """Ranks one iteration behind take the missing buckets from one that stepped, then step."""
        catch = plan_catch_up(table, self.groups.dp_ranks, nb, self.rank)
        if catch is None:
            return table
        behind = self.rank in catch.behind
        if catch.source is not None:
            self._fetch_buckets(self.groups.dp_ranks.index(catch.source), catch.lo, nb, apply=behind)
        if behind:
            self.prog.done = nb
            self._commit(*self._tail_flags())
        return after_catch_up(table, catch)

    def _share_buckets(self, table: StatusTable, mine_best: int) -> None:
        """Within this iteration, completed buckets go to members that lack them."""
        share = plan_share(table, self.groups.dp_ranks, mine_best)
        if share is None:
            return
        apply = self.holds_state
        self._fetch_buckets(self.groups.dp_ranks.index(share.source), share.lo, share.hi, apply=apply)
        if apply:
            self.prog.done = max(self.prog.done, share.hi)

    def _transfer(self, table: StatusTable) -> None:
        """Joiners take parameters, optimizer state and iteration from a healthy replica."""
        if all(s.holds_state for s in table.values()):
            return
        dp_ranks = self.groups.dp_ranks
        self._transfer_state([r for r in dp_ranks if table[r].holds_state], joiners(table, dp_ranks))
        if not self.holds_state:
            self.mode = RankMode.RECOVERING
            self.acc.reset()
            self.prog.reset()

    def _resume(self, table: StatusTable) -> None:
        """Whatever some group's sum lacks is (re)computed by a live replica."""
        rerun = self.sched.recovery == "rerun"
        if rerun:
            self.acc.reset()
            self.prog.reset()
        res = plan_resume(
            table, layout=self.layout, topo=self.topo, me=self.rank, epoch=self.groups.record.epoch,
            members=list(self.groups.record.members), rerun=rerun,
            members_of=lambda epoch: self._record(epoch).members,
        )
        self.base_epoch, self.plan, self.keep_mask = res.base_epoch, res.plan, res.keep_mask
        self.todo = list(self.plan.get(self.replica, []))
        self.prog.table = None
        self.membership.timing.update(kept_buckets=self.prog.done, redo_mbs=len(self.todo))

    def _restore_everyone(self) -> None:
        """No member holds a replica's state (the whole job restarted): all restore the checkpoint,
        which must be of one iteration on every rank; a snapshot of another tensor-parallel size
        (``unicron update`` of the TP) is resharded by all ranks together."""
        resharded = self._restore_snapshots()
        found = self._restored_iterations()
        if len(found) > 1 and self.checkpointer is not None:
            # A rank's newest snapshot may not have been published when the job died: all go back
            # to the newest iteration every rank holds.
            if self.it != found[0]:
                self.state.load_state_dict(self.checkpointer.restore(iteration=found[0]).state)
            found = self._restored_iterations()
        if len(found) != 1:
            raise RestoreMismatch(f"ranks restored different iterations {found}; no common checkpoint")
        self.mode = RankMode.RECOVERING
        self._new_iteration(self.groups.record)
        source = next((s.source for s in self.sources if isinstance(s, CheckpointSource)), "")
        self._event("restored", it=self.it, source=source, resharded_from=resharded)
        self.log.info("restored", step=self.it, source=source, resharded_from=resharded)
        # the layout too: a relaunch with a new micro-batch size or TP size restores the same state
        how = f", resharded from TP {resharded} to {self.topo.tp}" if resharded else ""
        stdout.status(f"rank {self.rank}: restored iteration {self.it} from {source or 'checkpoint'}{how} "
                      f"({self.layout.micro_batches} micro-batches of {self.sched.micro_batch_size})")

    def _restore_snapshots(self) -> int:
        """Each data-parallel group restores its newest snapshot (its holder broadcasts it); when any
        group's is of another TP size, or holds none while others do, every rank reshards. Returns
        the old TP size when resharded, else 0."""
        source = next((s for s in self.sources if isinstance(s, CheckpointSource)), None)
        if source is None:
            raise RuntimeInvariantError(f"no state source could serve joiners {list(self.groups.dp_ranks)}")
        dp_ranks = list(self.groups.dp_ranks)
        self._collective("state", lambda: source.transfer(
            self.state, self.groups.dp, dp_ranks, [], dp_ranks, self.rank))
        outcomes = self._world_ints("restore", int(source.outcome))
        if all(o == Outcome.NOTHING for o in outcomes):  # every rank sees it: all stop alike
            raise NoCompleteReplica(f"epoch {self.groups.record.epoch}: no member holds a replica's state "
                                    "and no rank holds a checkpoint to restore; relaunch the job")
        if all(o == Outcome.SERVED for o in outcomes):
            return 0
        assert self.checkpointer is not None
        checkpointer, mine = self.checkpointer, source.foreign
        got = self._collective("reshard", lambda: restore_resharded(
            self.state, checkpointer, self.groups.world, self.topo.tp, self.topo.tp_rank(self.rank), mine))
        assert got is not None  # a failed collective raises CommFailure
        source.source, old_tp = got
        return old_tp

    def _world_ints(self, what: str, value: int) -> list[int]:
        """``value`` of every rank of the world, in rank order."""
        mine = torch.tensor([value], dtype=torch.int64, device=self.device)
        out = [torch.empty_like(mine) for _ in range(self.groups.world.size())]
        self._collective(what, lambda: self.groups.world.allgather([out], [mine]).wait())
        return [int(t) for t in out]

    def _any_checkpoint(self) -> bool:
        """``--resume`` with no checkpoint on any rank (a first launch) starts from scratch, as
        Megatron's ``--load`` does; the ranks decide together so that none restores alone."""
        assert self.checkpointer is not None
        seen = self._world_ints("resume", int(checkpoint_presence(self.checkpointer)))
        if Presence.FOUND in seen:
            return True
        if Presence.UNKNOWN in seen:  # every rank decides alike: none starts afresh alone
            raise CheckpointsOutOfReach(
                "--resume: no rank found a checkpoint and the remote tier of "
                f"rank(s) {[r for r, p in enumerate(seen) if p == Presence.UNKNOWN]} could not be listed: "
                "a first launch cannot be told from checkpoints out of reach (a fresh start would later "
                "discard them); relaunch once the storage answers, or pass --ckpt-storage none")
        self._event("fresh_start", reason="--resume: no checkpoint on any rank")
        return False

    def _restored_iterations(self) -> list[int]:
        return sorted(set(self._world_ints("restore", self.it)))

    def _fetch_buckets(self, root: int, lo: int, hi: int, apply: bool) -> None:
        """Broadcast reduced buckets [lo, hi) from DP-group index ``root``; with ``apply`` take the
        ones this rank lacks (never overwriting a bucket it already reduced)."""
        s, e = self.prog.bounds[lo][0], self.prog.bounds[hi - 1][1]
        if self.groups.dp.rank() == root:
            buf = self.prog.span(lo, hi)
        else:
            buf = torch.empty(e - s, dtype=self.prog.dtype, device=self.prog.device)
        self._collective("catch-up", lambda: self.groups.dp.broadcast(buf, root).wait())
        if apply:
            for b in range(max(self.prog.done, lo), hi):
                bs, be = self.prog.bounds[b]
                self.prog.put(b, buf[bs - s : be - s])

    def _transfer_state(self, holders: list[int], joiners: list[int]) -> None:
        for source in self.sources:
            done = self._collective(
                "state", lambda src=source: src.transfer(  # type: ignore[misc]
                    self.state, self.groups.dp, self.groups.dp_ranks, holders, joiners, self.rank
                ),
            )
            if done:
                return
        raise RuntimeInvariantError(f"no state source could serve joiners {joiners}")

    def _record(self, epoch: int) -> EpochRecord:
        if epoch == self.groups.record.epoch:
            return self.groups.record
        if epoch in self._epochs:
            return self._epochs[epoch]
        raw = self.store.get(f"epoch/{epoch}")
        return EpochRecord.decode(raw)

    # --- outputs ---------------------------------------------------------------------------------

    def write_outputs(self, out_dir: str) -> None:
        os.makedirs(out_dir, exist_ok=True)
        iterations = self.it if self._held is not None and self.mode is not RankMode.JOB_DONE else self.job_iterations
        with open(os.path.join(out_dir, f"rank{self.rank}.json"), "w") as fh:
            json.dump(
                {"rank": self.rank, "incarnation": self.incarnation, "iterations": iterations, "device": str(self.device),
                 "mode": self.mode.value, "losses": list(self.losses), "events": [e.__dict__ for e in self.events]},
                fh,
            )
        if self._held is not None and self.holds_state:
            torch.save(
                {k: v.detach().clone() for k, v in self.state.model.state_dict().items() if isinstance(v, torch.Tensor)},
                os.path.join(out_dir, f"rank{self.rank}.pt"),
            )
