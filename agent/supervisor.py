"""Process supervision of the node's training ranks (paper §4.1, Table 1 "exited abnormally").

Each rank runs as a child process in its own process group. Per child:

* a **waiter thread** blocked in ``waitpid`` learns of the exit the moment the kernel reaps it (no
  poll loop), SIGKILLs what is left of the rank's process group (after a requested stop, once the
  stop's grace is over: a wrapper script's python child outlives its shell) and calls ``on_exit``
  with a :class:`RankExit` saying whether the agent asked for it;
* a **stderr reader thread** forwards every line (prefixed with the task and rank) to the agent's
  stderr or a sink, appends it to the rank's stderr log (``stderr_path``) and calls ``on_stderr_match`` when :func:`unicron.kernel.patterns.match` recognises a Table 1 status (at most
  once per kind per ``match_interval_s``, so a rank spewing the same error does not flood reports);
* with ``on_line``, every line of stdout and stderr is also handed to it (progress lines of
  uninstrumented jobs, :mod:`agent.progress`): stdout then goes through a pipe and a **stdout reader
  thread** that appends it to the rank's log file, instead of straight to the file.

Ranks die with the agent: each child is started with ``PR_SET_PDEATHSIG = SIGKILL``. An agent killed
by SIGKILL (or OOM) runs no clean-up code; without this its ranks would stay alive as orphans,
holding their GPUs and their NCCL communicators, while the coordinator (which sees the node's lease
expire) restarts the task elsewhere. The kernel sends the signal when the *thread* that forked the
child exits, so all children are forked from one long-lived spawner thread owned by the supervisor,
never from whichever (possibly short-lived) thread called :meth:`Supervisor.launch`. The kernel
does not pass the signal on to the child's own children (a wrapper script's python, data-loader
workers): with ``groups``, each rank's process group is recorded under the agent's run dir while it
lives, and the agent's next start SIGKILLs the groups a dead agent left (:mod:`agent.rankgroups`;
under the shipped systemd unit, systemd kills them before that: ``KillMode=mixed``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO

from agent.prefork import Prefork, PreforkedProcess, PreforkUnavailable
from agent.rankgroups import RankGroups
from unicron.kernel import log as ulog
from unicron.kernel import parentdeath, patterns
from unicron.kernel.errors import ConfigError, PermanentError
from unicron.kernel.procs import STOPPED_STATES, group_alive, proc_state
from unicron.kernel.types import ErrorKind

log = ulog.get(__name__)

RUNNING, STOPPED, EXITED = "running", "stopped", "exited"

#: why a start fails that is this node's passing state (no memory, no process or descriptor slots, a
#: full disk for the log), not the command's: raised as the OSError, which names no fault of the task
NODE_ERRNOS = frozenset({errno.EAGAIN, errno.ENOMEM, errno.EMFILE, errno.ENFILE, errno.ENOSPC})
#: how often a rank's group is looked at while its members have their stop's grace: first soon (most
#: groups empty at once), then less often (a look reads every process's /proc stat while any is left)
GROUP_POLL_S = (0.02, 0.25)
#: how long a rank's exit waits for the rest of its group to die of the SIGKILL that ends it: a relaunch
#: must not meet the old helpers still holding the GPU (a member in uninterruptible sleep may outlast it)
KILLED_GROUP_WAIT_S = 5.0


@dataclass(frozen=True)
class RankExit:
    """How a rank's process ended."""

    rank: int
    """The rank the process ran."""
    pid: int
    """Its process id."""
    returncode: int
    """Exit status; negative: killed by that signal (``subprocess`` convention)."""
    ts: float
    """Wall-clock time the exit was observed (``waitpid`` returned)."""
    requested: bool
    """The agent asked for it (:meth:`Supervisor.kill`, ``terminate_all``): an expected exit."""
    stderr_kind: ErrorKind | None
    """The last Table 1 status matched in the rank's stderr, if any (the likely cause)."""

    @property
    def signal(self) -> int | None:
        """The signal that killed the process, or None for a normal exit."""
        return -self.returncode if self.returncode < 0 else None

    @property
    def abnormal(self) -> bool:
        """A failure to report: not requested, and not a clean exit 0."""
        return not self.requested and self.returncode != 0


@dataclass(frozen=True)
class ProcStatus:
    """One rank's process as :meth:`Supervisor.status` reports it."""

    rank: int
    """The rank."""
    pid: int
    """Its process id."""
    state: str
    """"running", "stopped" (SIGSTOP, whoever sent it: the kernel's view) or "exited"."""
    returncode: int | None
    """Exit status once exited."""
    requested: bool
    """Whether a kill was requested by the agent."""


ExitCallback = Callable[[RankExit], None]
#: on_stderr_match(rank, pid, kind, line, ts) (``pid``: the process that wrote it, as for on_line)
MatchCallback = Callable[[int, int, ErrorKind, str, float], None]
#: stderr_sink(rank, line): where forwarded stderr lines go
StderrSink = Callable[[int, str], None]
#: on_line(rank, pid, line, mono): every output line of a rank, stdout and stderr, with its arrival's
#: time.monotonic() (``pid``: the process that wrote it, whose reader may hand its last lines on after
#: the rank's next process was launched)
LineCallback = Callable[[int, int, str, float], None]


class RankStillRunning(PermanentError):
    """A launch of a rank whose previous process has not exited (the node's trouble, not the command's)."""


def _stderr_writer(task: str = "") -> StderrSink:
    lock = threading.Lock()
    # the task's name: a node runs ranks of several tasks, and "[rank 0]" alone named no one's traceback
    prefix = f"{task} rank" if task else "rank"

    def write(rank: int, line: str) -> None:
        with lock:
            sys.stderr.write(f"[{prefix} {rank}] {line}\n")
            sys.stderr.flush()

    return write


def _check_exec_args(rank: int, argv: Sequence[str], env: Mapping[str, str] | None) -> None:
    """Refuse what exec would refuse (with a ValueError, not an OSError) with a reason naming the field."""
    for i, arg in enumerate(argv):
        if "\0" in arg:
            raise ConfigError(f"rank {rank}: argv[{i}] contains a NUL byte")
    for key, value in (env or {}).items():
        if "\0" in key or "\0" in value or "=" in key or not key:
            raise ConfigError(f"rank {rank}: environment variable {key[:64]!r} has a NUL byte or a bad name")


class RankProcess:
    """One supervised rank process (created by :meth:`Supervisor.launch`): exec'd, or forked by the
    node's warm spawner (:mod:`agent.prefork`)."""

    def __init__(self, rank: int, popen: subprocess.Popen[bytes] | PreforkedProcess) -> None:
        self.rank = rank
        self.popen = popen
        self.pid = popen.pid
        self.state = RUNNING
        self.requested = False
        #: time.monotonic() by which a requested stop's group must be gone (None: no grace running):
        #: the waiter gives the members left after the leader's exit until then (see Supervisor._wait)
        self.grace_deadline: float | None = None
        self.exit: RankExit | None = None
        self.exited = threading.Event()
        self.last_kind: ErrorKind | None = None
        self.last_report: dict[ErrorKind, float] = {}
        self.reader: threading.Thread | None = None
        self.stdout: IO[bytes] | None = None  # read end of the stdout pipe (with ``on_line``)
        self.stdout_file: IO[bytes] | None = None  # the log the stdout reader appends to
        self.stderr_file: IO[bytes] | None = None  # the log the stderr reader appends to (``stderr_path``)
        self.waiter: threading.Thread | None = None

    def status(self) -> ProcStatus:
        rc = self.exit.returncode if self.exit else None
        return ProcStatus(self.rank, self.pid, self._observed_state(), rc, self.requested)

    def _observed_state(self) -> str:
        """The kernel's word over ours: anyone may stop a rank (a SIGSTOP from outside, a debugger), not
        only :meth:`Supervisor.stop`, and the coordinator looks for the stopped rank behind a hang."""
        if self.state == EXITED:
            return EXITED
        kernel = proc_state(self.pid)
        # not stopped yet: our own stop() may not have taken effect (a SIGSTOP lands asynchronously)
        return STOPPED if kernel in STOPPED_STATES else self.state


class Supervisor:
    """Launches and watches the ranks of this node (one process per rank, keyed by rank number).

    Callbacks run on the per-child threads; keep them short (hand off to the agent's queue).
    """

    def __init__(
        self,
        on_exit: ExitCallback,
        on_stderr_match: MatchCallback | None = None,
        stderr_sink: StderrSink | None = None,
        match_interval_s: float = 10.0,
        stderr_grace_s: float = 0.01,
        pdeathsig: bool = True,
        prefork: Prefork | None = None,
        on_line: LineCallback | None = None,
        task: str = "",
        groups: RankGroups | None = None,
    ) -> None:
        """``task``: the name the default stderr sink puts before each forwarded line's rank, and every
        log line of this supervisor carries (a node runs ranks of several tasks: "rank 0 exited" named none)."""
        self._log = log.bind(task=task) if task else log
        self._on_exit = on_exit
        self._on_line = on_line
        self._on_match = on_stderr_match
        self._sink = stderr_sink or _stderr_writer(task)
        self._match_interval = match_interval_s
        # A dying rank prints its error right before exiting: give its reader this long to reach EOF
        # so the stderr match is reported (and RankExit.stderr_kind set) before the exit itself.
        self._stderr_grace = stderr_grace_s
        self._preexec = parentdeath.preexec(signal.SIGKILL) if pdeathsig else None
        self._prefork = prefork
        self._groups = groups  # where each rank's process group is recorded while it lives (module docstring)
        self._procs: dict[int, RankProcess] = {}
        self._lock = threading.Lock()
        # The one long-lived thread that forks every child (see the module docstring on PDEATHSIG).
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rank-spawner")

    # --- launching -------------------------------------------------------------------------------

    def launch(
        self,
        rank: int,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdout_path: str | None = None,
        stderr_path: str | None = None,
    ) -> RankProcess:
        """Start ``argv`` as ``rank``. ``env`` is the child's whole environment (None: the agent's);
        ``stdout_path``: append stdout there (None: inherit the agent's stdout). stderr is piped, and
        with ``stderr_path`` also appended there.
        Raises PermanentError when the command cannot be executed, RankStillRunning when the rank's
        previous process lives on, OSError when this node cannot start a process now (NODE_ERRNOS) or
        open ``stdout_path``."""
        if not argv:
            raise ConfigError(f"rank {rank}: empty command line")
        _check_exec_args(rank, argv, env)
        with self._lock:
            old = self._procs.get(rank)
            if old is not None and old.state != EXITED:
                raise RankStillRunning(f"rank {rank} is already running as pid {old.pid}; kill it first")
        prefork = self._prefork if self._prefork is not None and self._prefork.eligible(argv, env, cwd) else None
        if prefork is not None:
            prefork.await_warm()
        proc = self._spawner.submit(self._spawn, rank, list(argv), env, cwd, stdout_path, prefork,
                                    stderr_path).result()
        if self._groups is not None:
            self._groups.add(proc.pid)  # before the waiter starts, which removes the record
        with self._lock:
            self._procs[rank] = proc
        proc.reader = threading.Thread(
            target=self._read_stderr, args=(proc,), name=f"rank-{rank}-stderr", daemon=True
        )
        proc.waiter = threading.Thread(
            target=self._wait, args=(proc,), name=f"rank-{rank}-waiter", daemon=True
        )
        proc.reader.start()
        if proc.stdout is not None:
            threading.Thread(target=self._read_stdout, args=(proc,), name=f"rank-{rank}-stdout",
                             daemon=True).start()
        proc.waiter.start()
        how = "forked by the spawner" if isinstance(proc.popen, PreforkedProcess) else "new process"
        self._log.info("rank started", rank=rank, pid=proc.pid, how=how, argv=" ".join(argv))
        return proc

    def _spawn(
        self,
        rank: int,
        argv: list[str],
        env: Mapping[str, str] | None,
        cwd: str | None,
        stdout_path: str | None,
        prefork: Prefork | None,
        stderr_path: str | None = None,
    ) -> RankProcess:
        """``prefork``: the spawner, when it can run ``argv`` (else None: a new process)."""
        # Opened here, also for a reader thread: a log that cannot be opened fails the launch (the log is
        # the agent's file, so as an OSError, the node's trouble), not the rank at its first print.
        log_file = open(stdout_path, "ab", buffering=0) if stdout_path else None  # noqa: SIM115
        try:
            err_file = open(stderr_path, "ab", buffering=0) if stderr_path else None  # noqa: SIM115
        except OSError:
            if log_file is not None:
                log_file.close()
            raise
        pipe_read: IO[bytes] | None = None
        try:
            with contextlib.ExitStack() as stack:
                if self._on_line is not None and log_file is not None:
                    # stdout through a pipe: its reader parses each line, then appends it to the log
                    r, w = os.pipe()
                    pipe_read = os.fdopen(r, "rb")
                    out_fd: int | None = stack.enter_context(os.fdopen(w, "wb")).fileno()
                else:
                    out_fd = stack.enter_context(log_file).fileno() if log_file is not None else None
                popen: subprocess.Popen[bytes] | PreforkedProcess | None = None
                if prefork is not None:
                    try:
                        popen = prefork.spawn(argv, env, cwd, out_fd)
                    except PreforkUnavailable as exc:
                        self._log.info("rank starts as a new process", rank=rank, reason=str(exc))
                if popen is None:
                    popen = subprocess.Popen(
                        argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out_fd, stderr=subprocess.PIPE,
                        process_group=0, preexec_fn=self._preexec, close_fds=True,
                    )
        except (OSError, subprocess.SubprocessError) as exc:  # no such file, not executable, exec failed
            if pipe_read is not None:
                pipe_read.close()
            if log_file is not None:
                log_file.close()
            if err_file is not None:
                err_file.close()
            if isinstance(exc, OSError) and exc.errno in NODE_ERRNOS:
                raise
            raise PermanentError(f"rank {rank}: cannot start {argv[0]!r}: {exc}") from exc
        proc = RankProcess(rank, popen)
        proc.stdout, proc.stdout_file = pipe_read, log_file if pipe_read is not None else None
        proc.stderr_file = err_file
        return proc

    # --- per-child threads -----------------------------------------------------------------------

    def _read_stderr(self, proc: RankProcess) -> None:
        stream = proc.popen.stderr
        assert stream is not None
        out, unlogged = proc.stderr_file, False
        for raw in iter(lambda: stream.readline(65536), b""):
            ts, mono = time.time(), time.monotonic()
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            try:
                self._sink(proc.rank, line)
            except Exception:
                self._log.exception("stderr sink failed", rank=proc.rank)
            if out is not None and not unlogged:
                try:
                    out.write(raw)
                except OSError as exc:  # a full disk: said once, and the reading (matches, exits) goes on
                    unlogged = True
                    self._log.warning("rank stderr not logged", rank=proc.rank, error=str(exc))
            kind = patterns.match(line)
            if kind is not None:
                self._matched(proc, kind, line, ts)
            self._line(proc, line, mono)
        stream.close()
        if out is not None:
            out.close()

    def _read_stdout(self, proc: RankProcess) -> None:
        stream, out = proc.stdout, proc.stdout_file
        assert stream is not None and out is not None
        with stream, out:
            for raw in iter(lambda: stream.readline(65536), b""):
                mono = time.monotonic()
                try:
                    out.write(raw)
                except OSError as exc:  # a full disk must not stop the parsing (nor the rank)
                    self._log.warning("rank stdout not logged", rank=proc.rank, error=str(exc))
                self._line(proc, raw.decode("utf-8", errors="replace").rstrip("\r\n"), mono)

    def _line(self, proc: RankProcess, line: str, mono: float) -> None:
        if self._on_line is None:
            return
        try:
            self._on_line(proc.rank, proc.pid, line, mono)
        except Exception:
            self._log.exception("on_line callback failed", rank=proc.rank)

    def _matched(self, proc: RankProcess, kind: ErrorKind, line: str, ts: float) -> None:
        proc.last_kind = kind
        now = time.monotonic()
        last = proc.last_report.get(kind)
        if last is not None and now - last < self._match_interval:
            return
        proc.last_report[kind] = now
        if self._on_match is not None:
            try:
                self._on_match(proc.rank, proc.pid, kind, line, ts)
            except Exception:
                self._log.exception("on_stderr_match callback failed", rank=proc.rank)

    def _wait(self, proc: RankProcess) -> None:
        returncode = proc.popen.wait()  # blocks in waitpid: the exit is seen when it happens
        ts = time.time()
        if proc.requested:
            self._await_group(proc)
        # Helpers the rank left behind in its group (data loader workers, ...) must not keep the GPU.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        killed_by = time.monotonic() + KILLED_GROUP_WAIT_S
        if not _await_empty(proc.pid, lambda: killed_by):
            self._log.warning("the rank's process group outlived its SIGKILL", rank=proc.rank, pid=proc.pid,
                        waited_s=KILLED_GROUP_WAIT_S)
        if self._groups is not None:
            self._groups.remove(proc.pid)
        if proc.reader is not None:
            proc.reader.join(self._stderr_grace)
        with self._lock:
            proc.state = EXITED
            proc.exit = RankExit(proc.rank, proc.pid, returncode, ts, proc.requested, proc.last_kind)
        proc.exited.set()
        (self._log.warning if proc.exit.abnormal else self._log.info)(
            "rank process exited", rank=proc.rank, pid=proc.pid, returncode=returncode, requested=proc.requested)
        try:
            self._on_exit(proc.exit)
        except Exception:
            self._log.exception("on_exit callback failed", rank=proc.rank)

    def _await_group(self, proc: RankProcess) -> None:
        """After the leader of a rank asked to stop exited, give the rest of its group the stop's grace,
        as torchrun does: a wrapper script's shell exits on SIGTERM at once while its python child
        still saves a checkpoint in its handler (killed at once, that save was torn). Returns when the
        group is empty or at the deadline, which a later SIGKILL request moves to now. Polls with no
        lock held: a blocking wait must not hold up the supervisor's other callers."""
        _await_empty(proc.pid, lambda: proc.grace_deadline)

    # --- control ---------------------------------------------------------------------------------

    def _get(self, rank: int) -> RankProcess:
        with self._lock:
            proc = self._procs.get(rank)
        if proc is None:
            raise ConfigError(f"rank {rank} is not supervised on this node")
        return proc

    def _signal(self, proc: RankProcess, sig: int) -> bool:
        """Signal the rank's whole process group; False if it already exited."""
        with self._lock:
            if proc.state == EXITED:
                return False
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return False
            return True

    def kill(self, rank: int, sig: int = signal.SIGKILL, grace_s: float = 10.0) -> None:
        """Ask ``rank`` to exit (an expected exit, not a failure). With SIGTERM (or any signal other
        than SIGKILL), SIGKILL follows after ``grace_s`` if the rank is still alive, or any process of
        its group (a wrapper script's python outlives its shell), whose exit is reported only then; a
        stopped rank is continued so that it gets the signal."""
        proc = self._get(rank)
        with self._lock:
            if proc.state == EXITED:
                return
            proc.requested = True
            now = time.monotonic()
            until = now if sig == signal.SIGKILL else now + grace_s
            # a SIGKILL ends a grace under way; a second SIGTERM does not lengthen it
            proc.grace_deadline = until if proc.grace_deadline is None else min(proc.grace_deadline, until)
        if self._signal(proc, sig) and sig != signal.SIGKILL:
            # A stopped process holds the signal pending until it is continued, and a rank may be
            # stopped by anyone (a SIGSTOP from outside, not only stop()): continue it as systemd
            # does after its SIGTERM, or every hung-and-stopped rank waits out the whole grace (the
            # chaos suite's SIGSTOPped ranks took 10 s longer to restart, 20-31 s in all).
            self._signal(proc, signal.SIGCONT)
            threading.Thread(target=self._escalate, args=(proc, grace_s), name=f"rank-{rank}-grace",
                             daemon=True).start()

    def _escalate(self, proc: RankProcess, grace_s: float) -> None:
        if not proc.exited.wait(grace_s):
            self._log.warning("rank did not exit in time; sending SIGKILL", rank=proc.rank, grace_s=grace_s)
            self._signal(proc, signal.SIGKILL)

    def stop(self, rank: int) -> None:
        """Freeze ``rank`` (SIGSTOP to its process group)."""
        proc = self._get(rank)
        if self._signal(proc, signal.SIGSTOP):
            with self._lock:
                proc.state = STOPPED if proc.state != EXITED else EXITED

    def cont(self, rank: int) -> None:
        """Resume a rank frozen by :meth:`stop`."""
        proc = self._get(rank)
        if self._signal(proc, signal.SIGCONT):
            with self._lock:
                proc.state = RUNNING if proc.state != EXITED else EXITED

    def wait(self, rank: int, timeout_s: float | None = None) -> RankExit | None:
        """Block until ``rank`` exited and its ``on_exit`` ran; None on timeout."""
        proc = self._get(rank)
        if not proc.exited.wait(timeout_s):
            return None
        if proc.waiter is not None:
            proc.waiter.join(timeout_s)
        return proc.exit

    def terminate_all(self, grace_s: float = 10.0, sig: int = signal.SIGTERM) -> list[RankExit]:
        """Send ``sig`` to every live rank, SIGKILL those still alive after ``grace_s``; returns their
        exits. ``sig`` SIGKILL: no grace at all (a faulty node's ranks must not stop politely)."""
        with self._lock:
            live = [p for p in self._procs.values() if p.state != EXITED]
        for proc in live:
            self.kill(proc.rank, sig, grace_s)
        exits = []
        for proc in live:
            proc.exited.wait(grace_s + 5.0)
            if proc.waiter is not None:
                proc.waiter.join(1.0)
            if proc.exit is not None:
                exits.append(proc.exit)
        return exits

    def expect_exit(self, rank: int) -> None:
        """``rank`` was asked to exit (an in-place shrink's Leave): its exit is not a failure."""
        proc = self._get(rank)
        with self._lock:
            proc.requested = True

    def forget(self, rank: int) -> None:
        """Drop an exited rank's record (it left the task; it is no process of this node any more)."""
        with self._lock:
            proc = self._procs.get(rank)
            if proc is not None and proc.state == EXITED:
                del self._procs[rank]

    def status(self) -> dict[int, ProcStatus]:
        """Every supervised rank's process, by rank."""
        with self._lock:
            return {rank: proc.status() for rank, proc in sorted(self._procs.items())}

    def close(self, grace_s: float = 10.0, sig: int = signal.SIGTERM) -> None:
        """Terminate all ranks (:meth:`terminate_all`) and release the spawner thread."""
        self.terminate_all(grace_s, sig)
        self._spawner.shutdown(wait=True)


def _await_empty(pgid: int, deadline: Callable[[], float | None]) -> bool:
    """Whether group ``pgid`` emptied before ``deadline()`` (monotonic; read at each look, so that a
    SIGKILL request can move it), polling with no lock held."""
    poll = GROUP_POLL_S[0]
    while group_alive(pgid):
        until = deadline()
        if until is None or time.monotonic() >= until:
            return False
        time.sleep(min(poll, max(0.0, until - time.monotonic())))
        poll = min(poll * 2, GROUP_POLL_S[1])
    return True
