"""The rank-side client: how a training process talks to its node's agent.

A rank reports progress (iteration start/end, micro-batch completions, phases) and exceptions, and
receives instructions (regroup, stop) and injected faults. Without ``UNICRON_AGENT_SOCKET`` (a run
outside Unicron) every call is a no-op, so the same training script runs managed or not.

Reporting never raises into training: if the agent goes away, the client logs once and goes quiet;
the agent's own supervision notices a rank that stops talking. It does not drop messages either: a
frozen agent (SIGSTOP) leaves a send waiting once the socket's buffer is full (about 45 iterations'
messages), because an agent that resumed without an iteration's end would judge a healthy rank hung;
by then the coordinator has lost the node anyway.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
import os
import queue
import socket
import sys
import threading
import time
import traceback as tb
import weakref
from collections.abc import Callable, Iterator
from types import TracebackType

from unicron.kernel import log as ulog
from unicron.kernel import protocol, wire
from unicron.kernel.errors import ConfigError, InvalidRecord, UnicronError
from unicron.kernel.types import ErrorKind

log = ulog.get(__name__)

#: how long a rank that stopped early waits for its agent to note it (a local socket round trip:
#: milliseconds); past it the rank exits anyway
STOP_NOTED_TIMEOUT_S = 2.0


class InjectedFault(UnicronError):
    """Raised inside a rank by ``unicron inject raise KIND``; carries the Table 1 kind to report."""

    def __init__(self, kind: ErrorKind, message: str = "") -> None:
        super().__init__(message or f"injected fault: {kind.value}")
        self.kind = kind


def _env_int(name: str) -> int:
    """An integer variable of the agent's environment, 0 when unset (a rank launched by hand)."""
    raw = os.environ.get(name, "0")
    try:
        return int(raw)
    except ValueError:  # int()'s own message names neither the variable nor who sets it
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer (the agent or launcher "
                          "sets it)") from None


class AgentClient:
    def __init__(
        self,
        rank: int,
        local_rank: int,
        task: str = "",
        generation: int = 0,
        socket_path: str | None = None,
    ) -> None:
        self.rank = rank
        self.local_rank = local_rank
        self.task = task
        self.generation = generation
        self.socket_path = socket_path if socket_path is not None else os.environ.get(protocol.ENV_SOCKET)
        self.instructions: queue.Queue[protocol.Message] = queue.Queue()
        #: called on the reader thread with a ``StoreMoved`` or ``PeersLost`` before it is queued: the
        #: training thread may be blocked on a lost host and read the queue only once that call returns
        self.on_host_lost: Callable[[protocol.StoreMoved | protocol.PeersLost], None] | None = None
        self._conn: wire.LineSocket | None = None
        self._reader: threading.Thread | None = None
        #: injected slowdowns not yet applied, in order: (delay_s, iterations left), counted down (one
        #: entry per iteration was a list of up to ``iterations`` items: a MemoryError for a large
        #: count, which ended this reader thread)
        self._pending_slow: collections.deque[tuple[float, int]] = collections.deque()
        self._pending_raise: protocol.InjectRaise | None = None
        self._inject_lock = threading.Lock()
        self._step: int | None = None
        self._phase = protocol.PHASE_TRAIN
        self._stop_noted = threading.Event()
        self._gc_reported = False  # a full collection's start was sent, its end not yet
        self._gc_end: protocol.Phase | None = None  # its end, held back: the socket was busy then

    @classmethod
    def from_env(cls) -> AgentClient:
        """Build from the torchrun-style environment the agent sets (RANK, LOCAL_RANK, UNICRON_TASK, ...);
        a ConfigError names a variable that is not an integer."""
        return cls(
            rank=_env_int("RANK"),
            local_rank=_env_int("LOCAL_RANK"),
            task=os.environ.get("UNICRON_TASK", ""),
            generation=_env_int("UNICRON_GENERATION"),
        )

    @property
    def enabled(self) -> bool:
        return self._conn is not None

    def connect(self) -> AgentClient:
        if not self.socket_path:
            return self
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.socket_path)
        except OSError as exc:
            sock.close()
            log.warning("agent socket unreachable; running unmanaged", socket=self.socket_path, error=str(exc))
            return self
        self._conn = wire.LineSocket(sock)
        self.send(
            protocol.Hello(
                rank=self.rank, local_rank=self.local_rank, pid=os.getpid(), task=self.task,
                generation=self.generation,
            )
        )
        self._reader = threading.Thread(target=self._read_loop, name="unicron-client", daemon=True)
        self._reader.start()
        gc.callbacks.append(self._on_gc)
        os.register_at_fork(after_in_child=functools.partial(_forget_in_child, weakref.ref(self)))
        return self

    def _forget_in_child(self) -> None:
        """In a process this one forked (a DataLoader worker): not the rank, so it says nothing on the
        rank's connection. Its collections sent phases there, which the agent took for the rank's own:
        a `train` phase in the middle of a checkpoint restarted the hang clock and reported a hang.
        The socket is only dropped, never shut down: the connection is the parent's too."""
        self._conn = None
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._on_gc)

    def close(self) -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._on_gc)
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def send(self, msg: protocol.Message) -> None:
        conn = self._conn
        if conn is None:
            return
        try:
            if self._gc_end is not None:  # a collection ended while the socket was busy: end it first
                ended, self._gc_end = self._gc_end, None
                conn.send(ended.to_wire())
            conn.send(msg.to_wire())
        except OSError as exc:
            log.warning("lost the agent socket; reporting stops", error=str(exc))
            self._conn = None

    # --- instructions ----------------------------------------------------------------------------

    def _read_loop(self) -> None:
        conn = self._conn
        while conn is not None:
            try:
                line = conn.recv_line()
            except (OSError, InvalidRecord):
                return
            if line is None:
                return
            try:
                msg = protocol.parse(wire.decode(line))
            except InvalidRecord as exc:
                log.warning("ignoring bad instruction from agent", error=str(exc))
                continue
            if isinstance(msg, protocol.InjectSlow):
                # time.sleep() raises on a negative delay and overflows on a huge one: either ended
                # the rank (a restart) where the operator asked for a slowdown
                delay_s = min(max(msg.delay_s, 0.0), protocol.MAX_SLOW_DELAY_S)
                if delay_s != msg.delay_s:
                    log.warning("injected delay out of range; clamped", delay_s=msg.delay_s, applied_s=delay_s,
                                most_s=protocol.MAX_SLOW_DELAY_S)
                with self._inject_lock:
                    self._pending_slow.append((delay_s, max(1, msg.iterations)))
            elif isinstance(msg, protocol.InjectRaise):
                with self._inject_lock:
                    self._pending_raise = msg
            elif isinstance(msg, protocol.StopNoted):
                self._stop_noted.set()
            else:
                if isinstance(msg, protocol.StoreMoved | protocol.PeersLost) and self.on_host_lost is not None:
                    try:
                        self.on_host_lost(msg)
                    except Exception:  # the reader must live on: the message itself still reaches the queue
                        log.exception("host-lost hook failed", message=msg.TYPE)
                self.instructions.put(msg)

    def next_instruction(self, timeout: float | None = 0.0) -> protocol.Message | None:
        """The next instruction from the agent, waiting up to ``timeout`` seconds (None: forever)."""
        try:
            if timeout == 0.0:
                return self.instructions.get_nowait()
            return self.instructions.get(timeout=timeout)
        except queue.Empty:
            return None

    def check_injected(self) -> None:
        """Apply injected faults; called at iteration boundaries by :meth:`iteration`."""
        with self._inject_lock:
            delay_s: float | None = None
            if self._pending_slow:
                delay_s, left = self._pending_slow.popleft()
                if left > 1:
                    self._pending_slow.appendleft((delay_s, left - 1))
            fault, self._pending_raise = self._pending_raise, None
        if delay_s is not None:
            time.sleep(delay_s)
        if fault is not None:
            try:
                kind = ErrorKind(fault.kind)
            except ValueError:
                kind = ErrorKind.OTHER_SOFTWARE_ERROR
            raise InjectedFault(kind, fault.message)

    # --- progress --------------------------------------------------------------------------------

    @contextlib.contextmanager
    def iteration(self, step: int) -> Iterator[None]:
        """Bracket one training iteration: reports start and end (with duration) to the agent."""
        self._step = step
        start = protocol.IterStart(step=step)
        self.send(start)
        self.check_injected()
        yield
        end = time.monotonic()
        self.send(protocol.IterEnd(step=step, duration_s=end - start.mono, mono=end))

    def microbatch_done(self, step: int, index: int) -> None:
        self.send(protocol.MicrobatchDone(step=step, index=index))

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """A non-training phase (checkpoint, eval, data wait): iterations inside it are not judged for
        hangs. On leaving it the phase it was entered from is reported again (phases may nest)."""
        outer, self._phase = self._phase, name
        self.send(protocol.Phase(name=name))
        try:
            yield
        finally:
            self._phase = outer
            self.send(protocol.Phase(name=outer))

    def _on_gc(self, event: str, info: dict[str, int]) -> None:
        """``gc.callbacks`` hook: a full collection while training (or in a collective) is reported as
        the ``gc`` phase, so the agent stops the iteration's hang clock for its pause (seconds on a
        large heap) instead of taking a long pause for a hang. It runs inside the collector, in whichever thread allocated,
        possibly one in the middle of :meth:`send`: it never waits for the socket. A start that finds
        the socket busy is not reported; an end that does is sent before the next message."""
        conn = self._conn
        if conn is None or info.get("generation") != 2:
            return
        try:
            # the collective phase is training time to the agent's hang clock too: a collection while
            # a rank waits in a collective was reported as a hang
            if event == "start" and self._phase in (protocol.PHASE_TRAIN, protocol.PHASE_COLLECTIVE):
                self._gc_reported = conn.try_send(protocol.Phase(name=protocol.PHASE_GC).to_wire())
                if self._gc_reported:  # it ends any earlier wait: an end still held back would now close this one
                    self._gc_end = None
            elif event == "stop" and self._gc_reported:
                self._gc_reported = False
                ended = protocol.Phase(name=self._phase)
                if not conn.try_send(ended.to_wire()):
                    self._gc_end = ended
        except OSError:
            self._conn = None  # the agent is gone: reporting stops, as in send()

    def stopped(self, step: int, snapshot: int | None, timeout_s: float = STOP_NOTED_TIMEOUT_S) -> bool:
        """Say that this rank ends early (stopped at ``step`` on a SIGTERM, ``snapshot``: the on-demand
        snapshot's iteration) and wait until the agent noted it: its status must never show this exit
        0 without it, or the control plane would take the job for finished. False: no agent answered."""
        if self._conn is None:
            return False
        self._stop_noted.clear()
        self.send(protocol.Stopped(step=step, snapshot=snapshot))
        noted = self._stop_noted.wait(timeout_s)
        if not noted:
            log.warning("the agent did not note this rank's stop; exiting anyway", step=step)
        return noted

    def report_exception(self, exc: BaseException, fatal: bool = True) -> None:
        kind = exc.kind.value if isinstance(exc, InjectedFault) else ""
        text = "".join(tb.format_exception(type(exc), exc, exc.__traceback__))
        self.send(
            protocol.ExceptionReport(
                message=_one_line(exc)[:8000], kind=kind, traceback=text[-8000:],
                step=self._step, fatal=fatal,
            )
        )

    def install_excepthook(self) -> None:
        """Report any uncaught exception to the agent before the interpreter prints it and exits."""
        previous = sys.excepthook

        def hook(t: type[BaseException], e: BaseException, trace: TracebackType | None) -> None:
            if not isinstance(e, KeyboardInterrupt):
                self.report_exception(e)
            previous(t, e, trace)

        sys.excepthook = hook


def _one_line(exc: BaseException) -> str:
    """``Type: message``, also for an exception whose ``str`` raises (it raised into the caller)."""
    try:
        text = str(exc)
    except Exception:
        text = "<exception str() failed>"
    return f"{type(exc).__name__}: {text}"


def _forget_in_child(client: weakref.ref[AgentClient]) -> None:
    """``os.register_at_fork`` hook: a client still alive forgets its connection in the child."""
    alive = client()
    if alive is not None:
        alive._forget_in_child()
