"""One task's processes on this node, reconciled to its desired assignment by a thread of its own.

The agent keeps one :class:`TaskReconciler` per task assigned to the node. A new generation gets a
new reconciler (the old one is stopped; the new one launches only once the old one's processes are
gone); a new restart or regroup epoch of the same generation is applied by the existing one. For a
``recovery: "restart"`` task a new restart epoch is a new attempt of the whole task: every named rank
is stopped (SIGTERM, grace, SIGKILL), the store-hosting node starts a fresh store sidecar for the
attempt (the others wait for its address at that epoch), the backoff passes, and all are relaunched.
A new membership epoch of the same generation is an in-place resize: running ranks no longer assigned
here (or re-hosted as joiners) are told to ``Leave`` at an iteration boundary and reaped; the ranks of a
lost node are marked failed by the node hosting the store; then the joiners are launched. Survivors are
not touched. When the store's own node was lost, the resize also names a new ``store_node`` (and
``store_epoch``): that node starts a fresh sidecar, and first of all every node tells its running ranks
where it is (``StoreMoved``).

Rank lifecycle (modelled on torch elastic's ``WorkerState``)::

    INIT ──launched──▶ HEALTHY ──exit 0──────────────▶ SUCCEEDED (``stopped_at`` set if it said it stopped early)
     │                  │  ──exit ≠ 0, not requested──▶ FAILED ──restart_epoch──▶ RESTARTING
     │                  │  ──restart_epoch───────────▶ RESTARTING ──relaunched──▶ HEALTHY
     │                  │  ──membership_epoch, not kept▶ STOPPING (Leave) ──exited──▶ (forgotten)
     │                  └─ unassigned / new generation ▶ STOPPING ──exited──▶ STOPPED
     └─ cannot start (no such file, NUL byte, ...) ───▶ FAILED

The task's own state is derived from its ranks': STOPPING/STOPPED once it is being or has been
stopped; FAILED if a launch failed or a rank failed; SUCCEEDED when every rank exited 0; INIT
while it waits for its rendezvous store or launches; RESTARTING while ranks are relaunched;
HEALTHY otherwise.

Locking: ``_lock`` guards this object's fields only and is never held across a blocking call.
Kills, waits, launches, starting the store sidecar and etcd writes run on the reconciler's own
thread with no lock held, so the supervisor's exit callbacks, status writes and rank messages
(which take ``_lock`` briefly) never wait for them.
"""

from __future__ import annotations

import collections
import enum
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

from agent import errorfile
from agent.iterations import IterationMonitor
from agent.prefork import Prefork
from agent.progress import LineParser, PhaseLine, Progress, megatron_eval_interval, megatron_log_interval
from agent.rankgroups import RankGroups
from agent.sidecar import START_TIMEOUT_S, StoreSidecar
from agent.supervisor import ProcStatus, RankExit, RankStillRunning, Supervisor
from unicron.kernel import log as ulog
from unicron.kernel import patterns, protocol
from unicron.kernel.errors import ConfigError, StoreClosed, StoreUnavailable, UnicronError
from unicron.kernel.types import (
    DetectionMethod,
    ErrorKind,
    RankSpec,
    RankStatus,
    Report,
    StoreAddress,
    TaskAssignment,
)

log = ulog.get(__name__)

#: how long a stop gives ranks between SIGTERM and SIGKILL, unless the agent says otherwise
#: (``AgentSettings.stop_grace_s``): a training rank's on-demand snapshot is taken in it
STOP_GRACE_S = 10.0
#: how long a restart waits for a SIGKILLed rank to be reaped before giving up on it
RESTART_WAIT_S = 10.0
#: how long a restart waits for the failure marker to write a killed rank's death (one store write by
#: a warm helper: milliseconds; a helper restarted meanwhile imports torch first)
MARK_WAIT_S = 10.0
#: after a restart, the next attempt's spare store starts once a relaunched rank made a step, or after
#: this long: started at once, its torch import competed for the CPU with the relaunched ranks' own
#: (measured: 0.9 s of a 6 s cold relaunch on 2 cores, bench/jobs.py)
SPARE_DELAY_S = 20.0
#: how long a rank asked to leave (an in-place shrink) has to finish its iteration and exit before
#: it is stopped (SIGTERM, then SIGKILL after the stop grace); a stop asked for meanwhile ends the wait
LEAVE_WAIT_S = 60.0
#: ``TaskAssignment.recovery`` of a task whose every rank is relaunched together
RECOVERY_RESTART = "restart"


def stderr_log_path(log_path: str) -> str:
    """Where a rank's stderr is appended: beside its stdout log ``rank<R>.log``, as ``rank<R>.err`` (the
    stdout log stays the job's own output, as torchrun's ``stdout.log``/``stderr.log`` split it)."""
    return os.path.splitext(log_path)[0] + ".err"


def _store_epoch(a: TaskAssignment) -> int:
    """The restart epoch whose store ``a``'s ranks use: each attempt's own for a ``restart`` task."""
    return a.restart_epoch if a.recovery == RECOVERY_RESTART else 0


class RankState(enum.StrEnum):
    INIT = "init"
    HEALTHY = "healthy"
    RESTARTING = "restarting"
    STOPPING = "stopping"
    STOPPED = "stopped"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


class TaskState(enum.StrEnum):
    INIT = "init"
    HEALTHY = "healthy"
    RESTARTING = "restarting"
    STOPPING = "stopping"
    STOPPED = "stopped"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


class TaskHost(Protocol):
    """What a reconciler needs from its agent."""

    node: str
    advertise_host: str
    #: the agent's default progress regex for uninstrumented jobs ("" = Megatron-LM's lines only)
    progress_regex: str

    def rank_env(self, a: TaskAssignment, spec: RankSpec, store: StoreAddress, error_file: str) -> dict[str, str]:
        """The rank's environment; ``error_file``: its TORCHELASTIC_ERROR_FILE (:mod:`agent.errorfile`)."""

    def rank_log_path(self, task: str, rank: int) -> str: ...

    def publish_store(self, addr: StoreAddress) -> int: ...

    def withdraw_store(self, addr: StoreAddress, revision: int) -> None: ...

    def report(self, method: DetectionMethod, kind: ErrorKind, message: str, *, task: str | None = None,
               rank: int | None = None, gpu: int | None = None, step: int | None = None,
               source_ts: float | None = None, handled: bool = False, generation: int | None = None) -> Report: ...

    def mark_failed(self, store: StoreAddress, rank: int, wait_s: float = 0.0) -> bool:
        """Write ``failed/<rank>`` into the task's store (raised to the rank's newest process), so its
        peers stop waiting for the rank at once. ``wait_s``: block until it was written, that long at
        most (False: not known to be written)."""

    def forget_rank(self, task: str, rank: int, monitor: IterationMonitor | None) -> None:
        """The rank's process is gone: stop judging its iteration timings (``monitor``: the one this
        process was judged by; a newer process of the same rank may already have its own)."""

    def stderr_matched(self, task: str, rank: int, kind: ErrorKind, line: str, ts: float, *, generation: int,
                       pid: int) -> None: ...

    def rank_progress(self, task: str, rank: int, progress: Progress | None, phase: str | None, mono: float,
                      pid: int) -> None:
        """A progress (or checkpoint phase) line in the output of the rank's process ``pid``
        (:mod:`agent.progress`)."""

    def send_to_rank(self, task: str, rank: int, msg: protocol.Message) -> bool: ...

    def rank_launched(self, task: str, rank: int, restart: bool) -> None:
        """A rank process started; ``restart``: relaunched for a sev2 restart (metrics)."""


class Outcome:
    """The result of one step of a reconciler (set once, by its thread)."""

    def __init__(self, task: str) -> None:
        self.task = task
        self.ok = True
        self.detail = ""
        self._done = threading.Event()

    def set(self, ok: bool, detail: str) -> None:
        self.ok, self.detail = ok, detail
        self._done.set()

    def wait(self, timeout_s: float | None = None) -> bool:
        return self._done.wait(timeout_s)

    @property
    def done(self) -> bool:
        return self._done.is_set()


@dataclass(frozen=True)
class _Command:
    assignment: TaskAssignment | None  # None: stop
    reason: str
    outcome: Outcome
    kill: bool = False  # a stop by SIGKILL, no grace (the node is isolated)


def _gone_with_the_store(a: TaskAssignment) -> list[int]:
    """The ranks a moved store must learn are dead: every rank outside the new membership, not only
    those this resize lost. The old store's node marked the ranks of earlier resizes there, unless it
    was itself cut off by then (a partition of it and another node, found as two resizes): then
    survivors still holding those ranks' epoch waited for them on the new store, where nothing
    marked them (``tests/integration/test_inplace_partition.py``). This resize's lost ranks stay in
    even when re-hosted as joiners: what is marked is the incarnation the survivors hold, the lost
    process's. Survivors mark only ranks of the newest epoch they hold, so ranks long gone change
    nothing; a leaving rank marked is one leaving."""
    members = set(a.members) if len(a.members) else set(range(a.world_size))
    return sorted((set(range(a.world_size)) - members) | set(a.lost))


class TaskReconciler:
    def __init__(self, assignment: TaskAssignment, host: TaskHost, prefork: Prefork | None,
                 previous: TaskReconciler | None = None, stop_grace_s: float = STOP_GRACE_S,
                 groups: RankGroups | None = None) -> None:
        self.task = assignment.task
        self.stop_grace_s = stop_grace_s
        self.host = host
        self._previous = previous
        self._prefork = prefork  # also forks the store sidecars this node hosts
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._commands: collections.deque[_Command] = collections.deque()
        self._stop_requested = False
        self.stopped = threading.Event()
        #: the newest assignment submitted, and the one last applied
        self.latest = assignment
        self.applied = assignment
        self._ranks = {s.rank: RankState.INIT for s in assignment.ranks}
        self._launch_error = ""
        self._cannot_start = ""  # why the task's command could not be executed here: the task's fault
        self._store: StoreAddress | None = None
        self._sidecar: StoreSidecar | None = None
        #: a store started ahead (a sidecar takes seconds to start: it imports torch): a ``restart``
        #: task's next attempt's on its store's node, so a whole-task restart does not wait for one; an
        #: in-place task's on its ``spare_store_node``, so a store moving there does not
        self._spare: StoreSidecar | None = None
        #: the spare while it still starts, with the outcome of its start ("" once it listens): a
        #: restart that comes first awaits it rather than start another from nothing
        self._pending: tuple[StoreSidecar, Future[str]] | None = None
        #: when the next spare is to start (monotonic; 0: now), None when none is due
        self._spare_due: float | None = None
        self._published_revision = 0
        self.steps: dict[int, int] = {}
        #: ranks whose current process completed an iteration since its launch (``RankStatus.advanced``)
        self.advanced: set[int] = set()
        #: rank -> the iteration it said it stopped at before its end (``protocol.Stopped``)
        self.stopped_at: dict[int, int] = {}
        #: rank -> the phase its current process last reported (``protocol.PHASES``; ``RankStatus.phase``)
        self.phases: dict[int, str] = {}
        #: rank -> when its checkpoint or evaluation is a hang, wall clock (``RankStatus.phase_deadline``)
        self.phase_deadlines: dict[int, float] = {}
        #: rank -> the restart epoch and the membership epoch its current process was launched at
        self.launched_epoch: dict[int, int] = {}
        self.launched_membership: dict[int, int] = {}
        #: rank -> its current process's pid (absent while it is being launched): a line of its
        #: predecessor read late is not this process's progress
        self.launched_pid: dict[int, int] = {}
        #: rank -> the TORCHELASTIC_ERROR_FILE of its newest launch (read when that process fails)
        self.error_files: dict[int, str] = {}
        #: rank -> its error file in the task's previous generation here (kept at this one's first launch)
        self._inherited_error_files: dict[int, str] = {}
        self.monitors: dict[int, IterationMonitor] = {}
        self.parser = self._line_parser(assignment)
        # the non-training phase a line of the job's output began (a Megatron save or evaluation); it
        # holds for the task's ranks on this node until a line ends it (or a later progress line)
        self._log_phase: PhaseLine | None = None
        self._log_phase_lock = threading.Lock()  # each rank's stdout and stderr have a reader thread
        self.supervisor = Supervisor(on_exit=self._on_exit, on_stderr_match=self._on_stderr_match, prefork=prefork,
                                     on_line=self._on_line, task=self.task, groups=groups)
        self.started = self._submit(_Command(assignment, "assigned", Outcome(self.task)))
        self._thread = threading.Thread(target=self._run, name=f"reconcile-{self.task}", daemon=True)
        self._thread.start()

    def _line_parser(self, a: TaskAssignment) -> LineParser:
        """Megatron-LM's lines, plus the task's own regexes (its env; the progress one also the agent's)."""

        def own(name: str, fallback: str = "") -> patterns.JobRegex | None:
            pattern = a.env.get(name) or fallback
            try:
                return patterns.compile_job_regex(name, pattern) if pattern else None
            except ConfigError as exc:  # refused at submission; an assignment written otherwise
                log.error("a job-format regex is ignored", task=a.task, error=str(exc))
                return None

        return LineParser(own(patterns.ENV_PROGRESS_REGEX, self.host.progress_regex), megatron_eval_interval(a.argv),
                          own(patterns.ENV_SAVE_START_REGEX), own(patterns.ENV_SAVE_END_REGEX),
                          log_interval=megatron_log_interval(a.argv))

    # --- requests (any thread; never block) -------------------------------------------------------

    def apply(self, a: TaskAssignment) -> Outcome:
        """Apply a newer restart/regroup epoch of the same generation."""
        with self._lock:
            self.latest = a
        return self._submit(_Command(a, "updated", Outcome(self.task)))

    def stop(self, reason: str, kill: bool = False) -> Outcome:
        """Stop every rank: SIGTERM and a grace for their work-conserving stop, or (``kill``) SIGKILL."""
        with self._lock:
            self._stop_requested = True
        return self._submit(_Command(None, reason, Outcome(self.task), kill))

    def offer_store(self, addr: StoreAddress | None) -> None:
        """A published store address (``stores/<task>``); taken if it is this generation's."""
        if addr is None or addr.task != self.task or addr.generation != self.latest.generation:
            return
        with self._wake:
            # a whole-task restart's fresh store (higher restart epoch) replaces the previous attempt's,
            # and a store moved off a lost node (higher store epoch) the one that went with it
            if self._store is None or (addr.restart_epoch, addr.store_epoch) > (
                    self._store.restart_epoch, self._store.store_epoch):
                self._store = addr
                self._wake.notify_all()

    def _submit(self, cmd: _Command) -> Outcome:
        with self._wake:
            self._commands.append(cmd)
            self._wake.notify_all()
        return cmd.outcome

    # --- observation ------------------------------------------------------------------------------

    def has_rank(self, rank: int, *pids: int) -> bool:
        """The rank is this task's here (and, with ``pids``, one of them is its current process's: not
        while it is being launched, when a line its predecessor left may still be read)."""
        with self._lock:
            return rank in self._ranks and (not pids or self.launched_pid.get(rank) in pids)

    def launch_epoch(self, rank: int) -> int | None:
        """The restart epoch the rank's newest process was launched under; None before its first launch."""
        with self._lock:
            return self.launched_epoch.get(rank)

    def rank_state(self, rank: int) -> RankState | None:
        with self._lock:
            return self._ranks.get(rank)

    def state(self) -> TaskState:
        with self._lock:
            states = set(self._ranks.values())
            if self._stop_requested:
                return TaskState.STOPPED if self.stopped.is_set() else TaskState.STOPPING
            if self._launch_error or RankState.FAILED in states:
                return TaskState.FAILED
            if states == {RankState.SUCCEEDED}:
                return TaskState.SUCCEEDED
            if RankState.INIT in states:
                return TaskState.INIT
            if RankState.RESTARTING in states:
                return TaskState.RESTARTING
            return TaskState.HEALTHY

    def store_address(self) -> StoreAddress | None:
        with self._lock:
            return self._store

    def hosts_store(self) -> bool:
        with self._lock:
            return self._sidecar is not None and self._published_revision > 0

    def republish(self) -> bool:
        """Publish the hosted store's address again (it went with a lost lease); False when etcd did not
        take it (the caller retries)."""
        with self._lock:
            addr = self._store if self._sidecar is not None else None
        if addr is None:
            return True
        try:
            revision = self.host.publish_store(addr)
        except StoreUnavailable as exc:
            log.warning("could not republish the store address", task=self.task, error=str(exc))
            return False
        with self._lock:
            self._published_revision = revision
        return True

    def cannot_start(self) -> str:
        """Why the task's command could not be executed on this node ("" if it could)."""
        with self._lock:
            return self._cannot_start

    def processes(self) -> dict[int, ProcStatus]:
        return self.supervisor.status()

    def rank_statuses(self) -> list[RankStatus]:
        """Every rank's process, exited ones included (with their return code) until the task's
        assignment changes."""
        procs = self.supervisor.status()
        with self._lock:
            gen = self.applied.generation
            return [RankStatus(task=self.task, generation=gen, rank=st.rank, pid=st.pid, state=st.state,
                               returncode=st.returncode, requested=st.requested, step=self.steps.get(r),
                               restart_epoch=self.launched_epoch.get(r, 0),
                               membership_epoch=self.launched_membership.get(r, 0), advanced=r in self.advanced,
                               stopped_at=self.stopped_at.get(r), phase=self.phases.get(r),
                               phase_deadline=self.phase_deadlines.get(r))
                    for r, st in procs.items()]

    def monitor(self, rank: int, make: Callable[[], IterationMonitor]) -> tuple[IterationMonitor | None, bool]:
        """The rank's iteration monitor (created if new: second item True); None unless it runs."""
        with self._lock:
            if self._ranks.get(rank) is not RankState.HEALTHY:
                return None, False
            mon = self.monitors.get(rank)
            if mon is not None:
                return mon, False
            mon = self.monitors[rank] = make()
            return mon, True

    def record_stopped(self, rank: int, step: int) -> None:
        """The rank said it stopped early at ``step`` (its last message before it exits)."""
        with self._lock:
            self.stopped_at[rank] = step

    def record_step(self, rank: int, step: int, completed: bool = False, pid: int | None = None) -> None:
        """The rank's process is at ``step``; ``completed``: it finished an iteration (not only began one).
        ``pid``: the process that said so; nothing if that is not the rank's current one (a relaunched
        rank credited with its dead predecessor's step was taken by the coordinator for recovered)."""
        with self._lock:
            if pid is not None and self.launched_pid.get(rank) != pid:
                return
            self.steps[rank] = step
            if completed:
                self.advanced.add(rank)
            if self._spare_due is not None:  # the relaunched attempt runs: its spare may start now
                self._spare_due = 0.0
                self._wake.notify_all()

    def record_phase(self, rank: int, phase: str, deadline: float | None = None) -> None:
        """The rank's process entered ``phase``; ``deadline``: when it is hung there (wall clock), if bounded."""
        with self._lock:
            self.phases[rank] = phase
            if deadline is None:
                self.phase_deadlines.pop(rank, None)
            else:
                self.phase_deadlines[rank] = deadline

    def _forget_progress(self, rank: int) -> None:
        """What the rank's process reported (step, phase, early stop): gone with the process. Under the lock."""
        self.steps.pop(rank, None)
        self.advanced.discard(rank)
        self.stopped_at.pop(rank, None)
        self.phases.pop(rank, None)
        self.phase_deadlines.pop(rank, None)

    def step_of(self, rank: int) -> int | None:
        with self._lock:
            return self.steps.get(rank)

    # --- the reconciler's thread ------------------------------------------------------------------

    def _spare_wait(self) -> float | None:
        """Seconds until the next spare store is due (0.0: now); None when none is. Under the lock."""
        return None if self._spare_due is None else max(0.0, self._spare_due - time.monotonic())

    def _run(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: bool(self._commands) or self._spare_wait() == 0.0, self._spare_wait())
                if not self._commands:
                    self._spare_due = None
                    cmd = None
                else:
                    cmd = self._commands.popleft()
            if cmd is None:
                self._start_spare(self.task)  # on this thread: the sidecar's PDEATHSIG follows it
                continue
            if cmd.assignment is None:
                self._stop(cmd)
                return
            try:
                if cmd.reason == "assigned":
                    cmd.outcome.set(*self._do_start(cmd.assignment))
                else:
                    cmd.outcome.set(*self._do_update(cmd.assignment))
            except Exception as exc:  # the thread must live on: a dead one left the task unmanaged
                # (an OSError starting the store or making a log directory killed it: no result written,
                # a later stop never carried out, the ranks leaked, the next generation waiting for ever)
                if isinstance(exc, UnicronError):
                    log.error("reconcile step failed", task=self.task, error=str(exc))
                else:
                    log.exception("reconcile step failed", task=self.task, error=str(exc))
                with self._lock:
                    if cmd.reason == "assigned":
                        self._launch_error = str(exc)
                    else:  # the result names the update that failed: at the old epochs the coordinator
                        # took it for an older one's, and a restart whose ranks were already stopped hung
                        self.applied = cmd.assignment
                cmd.outcome.set(False, f"{type(exc).__name__}: {exc}")

    def _stop(self, cmd: _Command) -> None:
        """The last command: whatever goes wrong stopping, the task counts as stopped once it is over
        (the next generation's reconciler waits for that before it launches)."""
        try:
            self._do_stop(cmd.reason, cmd.kill)
            cmd.outcome.set(True, f"stopped: {cmd.reason}")
        except Exception as exc:  # reported, and the stop is still over
            log.exception("stopping the task failed", task=self.task, error=str(exc))
            cmd.outcome.set(False, f"stop failed: {type(exc).__name__}: {exc}")
        finally:
            self.stopped.set()
            self._drain(f"task {self.task} stopped")

    def _drain(self, detail: str) -> None:
        with self._wake:
            rest = list(self._commands)
            self._commands.clear()
        for cmd in rest:
            cmd.outcome.set(True, detail)

    def _stop_pending(self) -> bool:
        return any(c.assignment is None for c in self._commands)

    def _stop_asked(self) -> bool:
        """``_stop_pending``, for a caller without the lock."""
        with self._lock:
            return self._stop_pending()

    def _wait_exit(self, rank: int, timeout_s: float) -> RankExit | None:
        """``supervisor.wait``, cut short by a stop asked for meanwhile: the stop ends every rank itself,
        and an isolated node's SIGKILL must not wait out a leaver's minute first."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0 and not self._stop_asked():
            if (ex := self.supervisor.wait(rank, timeout_s=min(left, 0.1))) is not None:
                return ex
        return self.supervisor.wait(rank, timeout_s=0)

    def _do_start(self, a: TaskAssignment) -> tuple[bool, str]:
        if self._previous is not None:
            self._previous.stopped.wait()  # its ranks hold the GPUs this generation needs
            with self._previous._lock:
                inherited = dict(self._previous.error_files)
            with self._lock:
                self._inherited_error_files = inherited
            self._previous = None
        store = self._host_store(a) if a.store_node == self.host.node else self._await_store(a)
        if store is None:
            return True, "stopped or superseded before its store was available"
        errors = self._launch_all(a, a.ranks, store)
        if self._stop_asked():
            return True, "stopped while its ranks were launched"
        if errors:
            with self._lock:
                self._launch_error = errors[0]
            return False, "; ".join(errors)
        if self._holds_spare_for_a_move(a):
            with self._lock:  # once the ranks run (their first step), not beside their start
                self._spare_due = time.monotonic() + SPARE_DELAY_S
        log.info("task started", task=a.task, generation=a.generation, ranks=[s.rank for s in a.ranks],
                 store=f"{store.host}:{store.port}")
        return True, "started"

    def _host_store(self, a: TaskAssignment, sidecar: StoreSidecar | None = None) -> StoreAddress | None:
        if a.recovery == RECOVERY_RESTART and sidecar is None:
            self._start_spare(a.task)  # before a first store's start, so both import torch at once
        elif a.recovery == RECOVERY_RESTART:  # a restart took the spare: the next one once the ranks run
            with self._lock:
                self._spare_due = time.monotonic() + SPARE_DELAY_S
        if sidecar is None:
            sidecar = StoreSidecar.start(self.host.advertise_host, a.task, prefork=self._prefork)
        addr = StoreAddress(task=a.task, generation=a.generation, node=self.host.node, host=sidecar.host,
                            port=sidecar.port, restart_epoch=_store_epoch(a), store_epoch=a.store_epoch)
        with self._lock:
            self._sidecar, self._store = sidecar, addr
        threading.Thread(target=self._watch_store, args=(sidecar, addr), name=f"store-watch-{a.task}",
                         daemon=True).start()
        backoff = 0.05
        while True:
            with self._wake:
                if self._stop_pending():
                    return None
            try:
                revision = self.host.publish_store(addr)
                break
            except StoreUnavailable as exc:
                log.warning("store address waits for etcd", task=a.task, error=str(exc))
                with self._wake:
                    self._wake.wait_for(self._stop_pending, backoff)
                backoff = min(backoff * 2, 1.0)
        with self._lock:
            self._published_revision = revision
        return addr

    def _watch_store(self, sidecar: StoreSidecar, addr: StoreAddress) -> None:
        """Report the hosted sidecar's death while it is still the task's store (not stopped by us, not
        replaced): the ranks' store calls fail and they wait for ``StoreMoved``, which the coordinator's
        fresh store brings (``store_lost``). Unreported, their waits and stderr read as hangs and
        network faults, and restarts onto the dead store ended in a healthy node isolated."""
        code = sidecar.proc.wait()
        with self._lock:
            if self._sidecar is not sidecar or sidecar.stopping or self._stop_requested:
                return
        log.error("store sidecar died", task=self.task, pid=sidecar.proc.pid, exit_code=code,
                  store=f"{addr.host}:{addr.port}", store_epoch=addr.store_epoch)
        self.host.report(DetectionMethod.PROCESS_SUPERVISION, ErrorKind.STORE_LOST,
                         f"the store sidecar of task {self.task} at {addr.host}:{addr.port} (pid "
                         f"{sidecar.proc.pid}) exited with {code}", task=self.task, generation=addr.generation)

    def _await_store(self, a: TaskAssignment, moved: bool = False) -> StoreAddress | None:
        """The store ``a`` names, once published; None if a stop comes first, or a newer attempt of a
        ``restart`` task (its store, which may come instead of ``a``'s, is not ``a``'s ranks' to use),
        or (``moved``) a newer move of the store: the node named may have been lost too before its store
        came up (a partition of the store's node and another, found as two resizes), and only the newer
        one has a store."""
        with self._wake:
            if self._store is None or moved:
                log.info("waiting for the task's store", task=a.task, generation=a.generation, store_node=a.store_node)
            epoch = _store_epoch(a)
            self._wake.wait_for(lambda: (self._store is not None and self._store.restart_epoch >= epoch
                                         and self._store.store_epoch >= a.store_epoch) or self._stop_pending()
                                or (moved and self._moved_again(a)) or self._restarted_again(a))
            ready = self._store is not None and self._store.store_epoch >= a.store_epoch
            return self._store if ready and not self._stop_pending() and not self._restarted_again(a) else None

    def _restarted_again(self, a: TaskAssignment) -> bool:
        """A queued assignment is a newer attempt of ``a``'s ``restart`` task (under the lock)."""
        return a.recovery == RECOVERY_RESTART and any(
            c.assignment is not None and c.assignment.generation == a.generation
            and c.assignment.restart_epoch > a.restart_epoch for c in self._commands)

    def _moved_again(self, a: TaskAssignment) -> bool:
        """A queued assignment moves the store past ``a``'s (under the lock)."""
        return any(c.assignment is not None and c.assignment.generation == a.generation
                   and c.assignment.store_epoch > a.store_epoch for c in self._commands)

    def _launch_all(self, a: TaskAssignment, specs: list[RankSpec], store: StoreAddress,
                    restart: bool = False) -> list[str]:
        """Launch ``specs`` in turn; why those that failed did. A stop asked for meanwhile ends it: a
        rank launched then is only killed again, and the next generation waits for its GPUs."""
        errors = []
        for spec in specs:
            if self._stop_asked():
                break
            if err := self._launch(a, spec, store, restart):
                errors.append(err)
        return errors

    def _launch(self, a: TaskAssignment, spec: RankSpec, store: StoreAddress, restart: bool = False) -> str:
        """Start one rank; "" on success, else why it could not start (the rank is then FAILED, unless
        its previous process still runs)."""
        with self._lock:
            self.launched_epoch[spec.rank] = a.restart_epoch
            self.launched_membership[spec.rank] = a.membership_epoch
            self.launched_pid.pop(spec.rank, None)
            self.monitors.pop(spec.rank, None)
            # A new process has made no step yet: its predecessor's last step, published with the
            # new launch epoch, confirmed the restart before it ran (issue #19 item 1).
            self._forget_progress(spec.rank)
        previous: str | None = None
        try:
            log_path = self.host.rank_log_path(a.task, spec.rank)
            error_file = errorfile.path_for(os.path.dirname(log_path), a, spec.rank)
            errorfile.prepare(error_file)
            with self._lock:  # before the launch: a process that dies at once is read by its own file
                previous = self.error_files.get(spec.rank)
                self.error_files[spec.rank] = error_file
                earlier = previous or self._inherited_error_files.pop(spec.rank, None)
            self.supervisor.launch(spec.rank, a.argv, self.host.rank_env(a, spec, store, error_file),
                                   stdout_path=log_path, stderr_path=stderr_log_path(log_path))
        except RankStillRunning as exc:  # its predecessor would not die: this node's trouble, and it still runs
            log.error("rank could not start", task=a.task, rank=spec.rank, error=str(exc))
            with self._lock:  # the file the predecessor's failure is read from
                if previous is not None:
                    self.error_files[spec.rank] = previous
            return str(exc)
        except UnicronError as exc:  # the command cannot run: the task's failure
            log.error("rank could not start", task=a.task, rank=spec.rank, error=str(exc))
            with self._lock:
                self._ranks[spec.rank] = RankState.FAILED
                self._cannot_start = str(exc)
            return str(exc)
        except OSError as exc:  # this node's (its log directory on a full disk, say): not the task's
            log.error("rank could not start on this node", task=a.task, rank=spec.rank, error=str(exc))
            with self._lock:
                self._ranks[spec.rank] = RankState.FAILED
            return f"rank {spec.rank}: {type(exc).__name__}: {exc}"
        # this launch's directory and the previous one's (its exit may be read just now); older ones go
        errorfile.prune(os.path.dirname(log_path), spec.rank, [error_file, *([earlier] if earlier else [])])
        with self._lock:
            # Under the lock, so that _on_exit runs wholly before or after: a process that already
            # exited was left in INIT/RESTARTING by it (reported, not counted) and must not turn healthy
            # (it did, and got an iteration monitor that judged the dead process hung).
            st = self.supervisor.status()[spec.rank]  # the process launched above
            self.launched_pid[spec.rank] = st.pid
            exited = st.returncode is not None
            if exited:
                self._ranks[spec.rank] = (RankState.SUCCEEDED if st.returncode == 0 else
                                          RankState.STOPPED if st.requested else RankState.FAILED)
            elif self._ranks.get(spec.rank) in (RankState.INIT, RankState.RESTARTING, RankState.FAILED):
                self._ranks[spec.rank] = RankState.HEALTHY
        if not exited:
            self.host.rank_launched(a.task, spec.rank, restart)  # healthy: the host starts watching it
        return ""

    def _do_update(self, a: TaskAssignment) -> tuple[bool, str]:
        with self._lock:
            applied, store = self.applied, self._store
        specs = {s.rank: s for s in a.ranks}
        errors: list[str] = []
        if a.store_epoch > applied.store_epoch:
            # whatever this node hosts is the old store: a move to another node, or a fresh store here
            # (the old one's sidecar died)
            self._give_up_store()
            store = self._move_store(a)
            with self._wake:
                superseded = store is None and not self._stop_pending()
            if superseded:
                # A newer move comes next and applies this one's membership too; its survivors must
                # still hear now of the ranks lost (their collective waits on them), not at its turn.
                running = {r for r, st in self.supervisor.status().items() if st.returncode is None}
                self._tell_lost(a, applied, sorted(r for r in running if r in specs))
                return True, "superseded by a newer move of the store"
        resize = a.membership_epoch > applied.membership_epoch and bool(specs)
        relaunch = (a.restart_epoch > applied.restart_epoch and a.recovery != RECOVERY_RESTART
                    and any(r in specs for r in a.restart_ranks))  # a restart task's attempt brings its own store
        if store is None and (resize or relaunch) and not self._stop_asked():
            # the task's start found no store here (it failed to start): nothing can be launched, and
            # "applied" would claim ranks that do not run
            errors.append("no store to launch the ranks onto (the task's start had none)")
        if a.membership_epoch > applied.membership_epoch and store is not None:
            errors += self._resize(a, applied, specs, store)
        if a.restart_epoch > applied.restart_epoch and a.recovery == RECOVERY_RESTART:
            errors += self._restart_all(a, specs)
        elif a.restart_epoch > applied.restart_epoch and store is not None:
            restart = [r for r in a.restart_ranks if r in specs]
            with self._lock:
                for r in restart:
                    self._ranks[r] = RankState.RESTARTING
            for r in restart:
                if self._stop_asked():
                    break  # the stop kills them all: a relaunch first only delays it
                if r in self.supervisor.status():
                    self.supervisor.kill(r, signal.SIGKILL)
                    if self.supervisor.wait(r, timeout_s=RESTART_WAIT_S) is None:
                        errors.append(f"rank {r} did not exit within {RESTART_WAIT_S:.0f} s of SIGKILL")
                        continue
                    self._mark_killed(a, store, r)
                    if self._stop_asked():
                        break
                if err := self._launch(a, specs[r], store, restart=True):
                    errors.append(err)
                else:
                    log.info("rank restarted", task=a.task, rank=r, restart_epoch=a.restart_epoch)
        if a.regroup_epoch > applied.regroup_epoch:
            msg = protocol.Regroup(epoch=a.regroup_epoch, members=list(a.regroup_members), failed=a.regroup_failed)
            for spec in a.ranks:
                self.host.send_to_rank(a.task, spec.rank, msg)
        self._follow_spare_role(a)
        with self._lock:
            self.applied = a
        return (False, "; ".join(errors)) if errors else (True, "applied")

    def _holds_spare_for_a_move(self, a: TaskAssignment) -> bool:
        return a.recovery != RECOVERY_RESTART and a.spare_store_node == self.host.node and bool(a.ranks)

    def _follow_spare_role(self, a: TaskAssignment) -> None:
        """An in-place resize may name another node for the spare store (the store moved here, or the
        ranks shifted): start one now if this node became it, stop this node's if it no longer is."""
        if a.recovery == RECOVERY_RESTART:
            return  # its spare follows the store (see _host_store)
        keep = self._holds_spare_for_a_move(a)
        with self._lock:
            if keep and self._spare is None and self._pending is None:
                self._spare_due = 0.0
                self._wake.notify_all()
                return
            if keep:
                return
            spare, pending, self._spare, self._pending, self._spare_due = self._spare, self._pending, None, None, None
        if spare is not None:
            spare.stop()
        if pending is not None:
            pending[0].stop()

    def _move_store(self, a: TaskAssignment) -> StoreAddress | None:
        """The store left its node (lost, isolated or drained) and this resize names another, or its
        sidecar died and the resize names a fresh one: that node's agent starts a sidecar (or takes
        its spare) and publishes it; every agent hands the
        address to its running ranks (``StoreMoved``), before any of them is asked to leave or any
        joiner starts (both need the new store)."""
        spare = self._take_spare() if a.store_node == self.host.node else None
        store = self._host_store(a, spare) if a.store_node == self.host.node else self._await_store(a, moved=True)
        if store is None:
            return None  # stopped meanwhile
        msg = protocol.StoreMoved(store_epoch=store.store_epoch, host=store.host, port=store.port,
                                  lost=_gone_with_the_store(a))
        running = sorted(r for r, st in self.supervisor.status().items() if st.returncode is None)
        for r in running:
            self.host.send_to_rank(a.task, r, msg)
        log.info("store moved", task=a.task, store_epoch=store.store_epoch, node=store.node,
                 store=f"{store.host}:{store.port}", told=running, spare=spare is not None)
        return store

    def _mark_killed(self, a: TaskAssignment, store: StoreAddress, rank: int) -> None:
        """A rank about to be relaunched: its peers must know this incarnation is dead before its
        successor counts itself in, so mark it and wait. A rank killed here (a hang: it never exited on
        its own, so no exit marked it) was not marked at all: the new process beat the rank's heartbeat,
        and the survivors waited for the dead one at their barrier until the regroup timeout
        (bench/resize_soak.py, SIGSTOP). One that crashed was marked at its exit without waiting; the
        helper answers in order, so this wait also sees that mark written, which, landing after the
        successor counted itself in, would have raised ``failed`` to the successor's incarnation."""
        if not self.host.mark_failed(store, rank, wait_s=MARK_WAIT_S):
            log.warning("rank relaunched before its death was marked", task=a.task, rank=rank, waited_s=MARK_WAIT_S)

    def _give_up_store(self) -> None:
        """The store moved off this node while it still serves (drained: its ranks leave, they are not
        lost), or its sidecar died and a fresh one replaces it. Stop it before anything else, as the
        loss of the node would: a rank that has not yet heard of the move fails on it and waits for
        ``StoreMoved`` instead of agreeing an epoch on a store its peers have left."""
        with self._lock:
            sidecar, store, revision = self._sidecar, self._store, self._published_revision
            self._sidecar, self._published_revision = None, 0
        if sidecar is not None:
            self._retire_store(sidecar, store, revision)
            log.info("store handed over", task=self.task)

    def _retire_store(self, sidecar: StoreSidecar, store: StoreAddress | None, revision: int) -> None:
        """Stop the hosted sidecar and withdraw its address (only our record: a newer one may be up)."""
        sidecar.stop()
        if store is not None and revision:
            try:
                self.host.withdraw_store(store, revision)
            except (StoreUnavailable, StoreClosed) as exc:  # under our lease: it goes with the agent anyway
                log.warning("could not withdraw the store address", task=self.task, error=str(exc))

    def _resize(self, a: TaskAssignment, applied: TaskAssignment, specs: dict[int, RankSpec],
                store: StoreAddress) -> list[str]:
        """An in-place resize on this node: leavers leave at an iteration boundary, the lost node's ranks
        are marked failed (by the store's node), joiners start; survivors go on untouched."""
        running = {r for r, st in self.supervisor.status().items() if st.returncode is None}
        leaving = sorted(r for r in running if r not in specs or r in a.joiners)
        self._tell_lost(a, applied, sorted(running - set(leaving)))
        errors = self._leave(a, leaving)
        if self._stop_asked():
            return errors  # no marks, no joiners: the stop comes next
        # a leaver that would not die (its error says so) still holds its rank: no joiner over it
        alive = {r for r, st in self.supervisor.status().items() if st.returncode is None}
        with self._lock:
            hosts_store = self._sidecar is not None
        if hosts_store:
            # A rank re-hosted in the same resize is not marked: its new process could start (and
            # count itself in started/<rank>) before the mark lands and be taken for dead.
            for r in sorted(set(a.lost) - set(a.joiners) - set(applied.lost)):
                self.host.mark_failed(store, r)
        joiners = [r for r in sorted(specs) if (r not in running or r in leaving) and r not in alive]
        with self._lock:
            for r in joiners:
                self._ranks[r] = RankState.RESTARTING
        errors += self._launch_all(a, [specs[r] for r in joiners], store, restart=True)
        log.info("resized in place", task=a.task, membership_epoch=a.membership_epoch, left=leaving,
                 joined=joiners, lost=list(a.lost), members=list(a.members))
        return errors

    def _tell_lost(self, a: TaskAssignment, applied: TaskAssignment, survivors: list[int]) -> None:
        """Name the ranks this resize gave up to the survivors here, first: a lost node that answers
        nothing (a partition) holds every collective with its ranks until the collective's timeout,
        unless the survivors cut their connections to it (``PeersLost``, :mod:`unicron.runtime.hostloss`)."""
        lost = sorted(set(a.lost) - set(applied.lost))
        if not lost:
            return
        msg = protocol.PeersLost(membership_epoch=a.membership_epoch, lost=lost)
        for r in survivors:
            self.host.send_to_rank(a.task, r, msg)

    def _leave(self, a: TaskAssignment, ranks: list[int]) -> list[str]:
        """Tell ``ranks`` to leave at their next iteration boundary; stop those that do not in time."""
        msg = protocol.Leave(membership_epoch=a.membership_epoch, reason="in-place resize")
        with self._lock:
            for r in ranks:
                self._ranks[r] = RankState.STOPPING
        for r in ranks:
            self.supervisor.expect_exit(r)
            if not self.host.send_to_rank(a.task, r, msg):  # not instrumented (or gone): stop it
                self.supervisor.kill(r, signal.SIGTERM, grace_s=self.stop_grace_s)
        errors = []
        for r in ranks:
            ex = self._wait_exit(r, LEAVE_WAIT_S)
            if ex is None and not self._stop_asked():
                log.warning("rank did not leave in time; stopping it", task=a.task, rank=r)
                self.supervisor.kill(r, signal.SIGTERM, grace_s=self.stop_grace_s)
                ex = self._wait_exit(r, self.stop_grace_s + RESTART_WAIT_S)
            if ex is None and self._stop_asked():
                break  # the stop ends it
            if ex is None:
                errors.append(f"rank {r} did not leave")
                continue
            self.supervisor.forget(r)
            with self._lock:
                self._ranks.pop(r, None)
                self._forget_progress(r)
                self.launched_epoch.pop(r, None)
                self.launched_membership.pop(r, None)
                self.launched_pid.pop(r, None)
                self.error_files.pop(r, None)
                mon = self.monitors.pop(r, None)
            self.host.forget_rank(a.task, r, mon)
        return errors

    def _restart_all(self, a: TaskAssignment, specs: dict[int, RankSpec]) -> list[str]:
        """A ``recovery: "restart"`` task's new attempt: stop every named rank (SIGTERM, grace, SIGKILL),
        give the attempt a fresh store, wait out the backoff, then relaunch them all."""
        ranks = [r for r in a.restart_ranks if r in specs]
        with self._lock:
            for r in ranks:
                self._ranks[r] = RankState.RESTARTING
        running = self.supervisor.status()
        for r in ranks:
            if r in running:
                self.supervisor.kill(r, signal.SIGTERM, grace_s=self.stop_grace_s)
        errors = [f"rank {r} did not exit within {self.stop_grace_s + RESTART_WAIT_S:.0f} s of SIGTERM"
                  for r in ranks if r in running
                  and self.supervisor.wait(r, timeout_s=self.stop_grace_s + RESTART_WAIT_S) is None]
        if errors:
            return errors
        store = self._fresh_store(a)
        if store is None:
            return []  # stopped, or superseded by a newer attempt, meanwhile
        with self._wake:
            self._wake.wait_for(lambda: self._stop_pending() or self._restarted_again(a), a.restart_delay_s)
            if self._stop_pending() or self._restarted_again(a):
                return []
        errors = self._launch_all(a, [specs[r] for r in ranks], store, restart=True)
        log.info("task restarted", task=a.task, ranks=ranks, restart_epoch=a.restart_epoch,
                 delay_s=a.restart_delay_s, store=f"{store.host}:{store.port}")
        return errors

    def _take_spare(self) -> StoreSidecar | None:
        """The spare store, awaited if it still starts (the rest of its start is shorter than a whole
        one); None when there is none or it did not start."""
        with self._lock:
            spare, pending = self._spare, self._pending
            self._spare = self._pending = None
        if spare is None and pending is not None:
            sidecar, started = pending
            try:
                spare = sidecar if started.result(START_TIMEOUT_S + 5.0) == "" else None
            except TimeoutError:  # its start hangs: stop it, and start one from nothing
                sidecar.stop()
                spare = None
        if spare is not None and spare.proc.poll() is not None:
            return None  # it died idle: a store that does not listen would hang the ranks
        return spare

    def _fresh_store(self, a: TaskAssignment) -> StoreAddress | None:
        """The store of attempt ``a.restart_epoch``: the hosting node replaces its sidecar, the others
        wait for its address (the old attempt's keys would hang the new ranks' rendezvous)."""
        with self._lock:
            old, self._sidecar = self._sidecar, None
        if old is not None:
            # Off the restart's path: the old attempt's store serves no rank any more, and its exit (up
            # to the stop's grace) would delay the relaunch.
            threading.Thread(target=old.stop, name=f"old-store-{a.task}", daemon=True).start()
        # whose store it is, as at the start: not whether one runs here (a restart whose store failed
        # to start left none, and the next one waited for its own address for ever)
        if a.store_node != self.host.node:
            return self._await_store(a)
        return self._host_store(a, self._take_spare())

    def _start_spare(self, task: str) -> None:
        """Start the next attempt's store now; called on this reconciler's (long-lived) thread, which
        the sidecar's PDEATHSIG follows. Its start is awaited on a thread of its own."""
        with self._lock:
            if self._pending is not None or self._spare is not None:
                return  # one is there already
        try:
            started = StoreSidecar.spawn(self.host.advertise_host, self._prefork)
        except OSError as exc:  # the restart will start its own
            log.warning("spare store sidecar did not start", task=task, error=str(exc))
            return
        outcome: Future[str] = Future()
        with self._lock:
            self._pending = (started, outcome)

        def await_ready() -> None:
            error = started.ready(task)  # "" once listening; else it was stopped
            outcome.set_result(error)
            spare: StoreSidecar | None = None if error else started
            with self._lock:
                if self._pending is None or self._pending[0] is not started:
                    return  # a restart took it (and awaits the outcome itself), or a stop did
                self._pending = None
                if spare is not None and not self._stop_requested and self._spare is None:
                    self._spare, spare = spare, None
            if spare is not None:  # stopped meanwhile, or one is ready already
                spare.stop()

        threading.Thread(target=await_ready, name=f"spare-store-{task}", daemon=True).start()

    def _do_stop(self, reason: str, kill: bool = False) -> None:
        with self._lock:
            for r, st in self._ranks.items():
                if st in (RankState.INIT, RankState.HEALTHY, RankState.RESTARTING):
                    self._ranks[r] = RankState.STOPPING
            sidecar, store, revision = self._sidecar, self._store, self._published_revision
            spare, self._sidecar, self._spare = self._spare, None, None
            pending, self._pending = self._pending, None
            self._spare_due = None
        # The ranks first: a store sidecar's stop waits up to its 1 s grace, and an isolated node's
        # ranks outlived their relaunch elsewhere by that second (chaos run: two live processes per rank)
        self.supervisor.close(grace_s=self.stop_grace_s, sig=signal.SIGKILL if kill else signal.SIGTERM)
        if spare is not None:
            spare.stop()
        if pending is not None:
            pending[0].stop()
        if sidecar is not None:
            self._retire_store(sidecar, store, revision)
        with self._lock:
            for r, st in self._ranks.items():
                if st is RankState.STOPPING:
                    self._ranks[r] = RankState.STOPPED
        self.stopped.set()
        log.info("task stopped", task=self.task, reason=reason)

    # --- supervisor callbacks (per-rank threads; short, no blocking) ------------------------------

    def _on_exit(self, ex: RankExit) -> None:
        with self._lock:
            state = self._ranks.get(ex.rank)
            stopping = state is RankState.STOPPING
            if state is RankState.HEALTHY:
                self._ranks[ex.rank] = RankState.SUCCEEDED if ex.returncode == 0 else (
                    RankState.FAILED if ex.abnormal else RankState.STOPPED)
            mon = self.monitors.pop(ex.rank, None)
            a, store, step = self.applied, self._store, self.steps.get(ex.rank)
            error_file = self.error_files.get(ex.rank)
        self.host.forget_rank(a.task, ex.rank, mon)
        if stopping or not ex.abnormal:  # exit 0, an exit we asked for, or a rank told to leave
            log.info("rank exited", task=a.task, rank=ex.rank, returncode=ex.returncode, requested=ex.requested)
            return
        if store is not None:
            self.host.mark_failed(store, ex.rank)
        what = f"signal {ex.signal}" if ex.signal else f"exit code {ex.returncode}"
        # what a @record-decorated main wrote: the exception, which "exit code 1" alone never named
        error = errorfile.summary(error_file) if error_file else None
        # Table 1's patterns classify it as they do stderr lines (the kind stays exited_abnormally: the
        # coordinator's restart decisions key on it); the stderr's match, seen first, is kept
        kind = ex.stderr_kind or (patterns.match(error) if error else None)
        source = "stderr" if ex.stderr_kind else "error file"
        cause = f"; {source} showed {kind.value}" if kind else ""
        gpu = next((s.gpu for s in a.ranks if s.rank == ex.rank), None)
        self.host.report(DetectionMethod.PROCESS_SUPERVISION, ErrorKind.EXITED_ABNORMALLY,
                         f"rank {ex.rank} exited abnormally ({what}){': ' + error if error else ''}{cause}",
                         task=a.task, rank=ex.rank, gpu=gpu, step=step, source_ts=ex.ts, generation=a.generation)

    def _on_stderr_match(self, rank: int, pid: int, kind: ErrorKind, line: str, ts: float) -> None:
        # this reconciler's generation: the host's current one may be the next, launched meanwhile
        self.host.stderr_matched(self.task, rank, kind, line, ts, generation=self.latest.generation, pid=pid)

    def _on_line(self, rank: int, pid: int, line: str, mono: float) -> None:
        progress = self.parser.progress(line)
        if progress is None:
            began = self.parser.phase(line)
            if began is not None:
                with self._log_phase_lock:
                    self._log_phase = None if began.phase == protocol.PHASE_TRAIN else began
                self.host.rank_progress(self.task, rank, None, began.phase, mono, pid)
            return
        if self._log_phase_ended_by(progress):
            # training goes on: an evaluation without validation data printed nothing, an async save
            # is finalizing, or a save's end line had another format
            self.host.rank_progress(self.task, rank, None, protocol.PHASE_TRAIN, mono, pid)
        self.host.rank_progress(self.task, rank, progress, None, mono, pid)
        if self.parser.evaluates_after(progress):  # Megatron-LM evaluates before its next line, silent until done
            with self._log_phase_lock:
                self._log_phase = PhaseLine(protocol.PHASE_EVAL, progress.iteration)
            self.host.rank_progress(self.task, rank, None, protocol.PHASE_EVAL, mono, pid)

    def _log_phase_ended_by(self, progress: Progress) -> bool:
        """Whether this progress line ends the phase a line began: one of a later iteration does (the
        line of the save's own iteration, printed before it by the last rank, may be read after it)."""
        with self._log_phase_lock:
            began = self._log_phase
            if began is None or (began.iteration is not None and progress.iteration <= began.iteration):
                return False
            self._log_phase = None
            return True
