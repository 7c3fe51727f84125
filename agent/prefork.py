"""Warm rank starts: a spawner process that imported the training stack once and forks ranks from it.

A rank started as a new interpreter spends seconds importing torch and Megatron-core (5 s of CPU on
the CI machine, more when several ranks start at once); that is most of a sev2 restart's transition
time and part of every reconfiguration. The agent itself must never import torch (it would starve its
heartbeats), so a separate **spawner** process (``python -m agent.prefork``) pre-imports the modules
named by ``--prefork`` and ``fork()``s a rank per request. A rank command qualifies when it is
``<the agent's python> -m MODULE ...`` for a pre-imported module, ``-c CODE``, or ``SCRIPT.py ...`` (a
user's torchrun-style script: torch, which it imports, is loaded already) and its start-up
environment (:func:`startup_env`) equals the spawner's; anything else is started as a new process, as
is every rank while the spawner is still importing or gone.

What the supervisor relies on holds for forked ranks too: a rank runs in its own process group, its
stdout/stderr are the files the agent passes (file descriptors over the Unix socket), and it dies with
the agent: the spawner has ``PR_SET_PDEATHSIG`` towards the agent, each rank towards the spawner. The
spawner reaps its ranks and writes each exit status, the moment ``SIGCHLD`` wakes it, on the
connection that requested the rank; the agent's waiter thread blocks reading it. The spawner has no
threads (so forking it is safe) and never initialises CUDA (so a forked rank can).

The agent runs one per node; :class:`unicron.cluster.launch.LocalJob` (tests, benchmarks) uses the same.

Protocol, one connection per rank: the agent sends a 4-byte big-endian length and a JSON request
``{"argv", "env", "cwd"}`` with its stdout and stderr descriptors attached; the spawner answers
``{"pid": P}`` then, when the rank has exited, ``{"exit": CODE}`` (negative: killed by that signal).
"""

from __future__ import annotations

import argparse
import atexit
import builtins
import contextlib
import importlib
import json
import math
import os
import runpy
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any, NoReturn, Protocol

from unicron.kernel import log as ulog
from unicron.kernel.errors import TemporaryError
from unicron.kernel.parentdeath import die_with_parent

log = ulog.get(__name__)

_HEADER = struct.Struct(">I")
_MAX_REQUEST = 1 << 24
_BLOCKED_WHILE_FORKING = {signal.SIGTERM, signal.SIGINT, signal.SIGCHLD}


class Child(Protocol):
    """What the agent does with a process it started, exec'd (``Popen``) or forked by the spawner
    (:class:`PreforkedProcess`)."""

    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


def stop_process(proc: Child, grace_s: float = 5.0) -> None:
    """SIGTERM a child, SIGKILL it if it has not exited after ``grace_s``, and reap it."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class PreforkUnavailable(TemporaryError):
    """The spawner cannot start this rank (not ready, gone, refused): start it as a new process."""


# ------------------------------------------------------------------------------------ agent's side


_STARTUP_PREFIXES = ("PYTHON", "LD_", "OMP_", "MKL_", "KMP_")
#: torch's, read as ``import torch`` runs (torch/__init__.py ``_logging._init_logs``,
#: torch/distributed/__init__.py ``set_debug_level_from_env``, c10's log level): forked, a rank asking
#: for DETAIL collective checks or INFO c10d logs to debug a hang silently got the spawner's settings
_STARTUP_VARS = frozenset({"TORCH_DISTRIBUTED_DEBUG", "TORCH_LOGS", "TORCH_LOGS_OUT", "TORCH_LOGS_FORMAT",
                           "TORCH_CPP_LOG_LEVEL", "TORCH_SHOW_CPP_STACKTRACES"})


def startup_env(env: Mapping[str, str]) -> dict[str, str]:
    """The variables read once, when the interpreter, the loader, the OpenMP runtime or ``import torch``
    run: a forked rank lives with the spawner's."""
    return {k: v for k, v in env.items() if k.startswith(_STARTUP_PREFIXES) or k in _STARTUP_VARS}


def with_torchrun_threads(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with torchrun's default of one OpenMP thread: what the agent gives its ranks and the
    spawner runs with (which also keeps the spawner single-threaded)."""
    return {**env, "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1")}


class PreforkedProcess:
    """The part of ``Popen`` the agent's supervisor and LocalJob use, for a rank forked by the spawner."""

    def __init__(self, pid: int, conn: socket.socket, reader: IO[bytes], stderr: IO[bytes] | None) -> None:
        self.pid = pid
        self.stderr = stderr
        self.returncode: int | None = None
        self._conn, self._reader = conn, reader
        self._waiter: threading.Thread | None = None
        self._lock = threading.Lock()  # one waiter thread
        self._read_lock = threading.Lock()  # one reader of the report, however many threads wait

    def poll(self) -> int | None:
        """The exit code, or None while running (a thread waits for the report: no polling cost)."""
        with self._lock:
            if self._waiter is None:
                self._waiter = threading.Thread(target=self._read_exit, name=f"prefork-wait-{self.pid}",
                                                daemon=True)
                self._waiter.start()
        return self.returncode

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, sig: signal.Signals) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def wait(self, timeout: float | None = None) -> int:
        """Block until the spawner reports the exit (``subprocess.TimeoutExpired`` after ``timeout``)."""
        if timeout is None:
            return self._read_exit()
        self.poll()
        assert self._waiter is not None
        self._waiter.join(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
        return self.returncode

    def _read_exit(self) -> int:
        """Block until the spawner reports the exit. Its connection closing without a report means
        the spawner died, and its ranks with it (PDEATHSIG): reported as SIGKILL."""
        with self._read_lock:
            if self.returncode is None:
                line = self._reader.readline()
                try:
                    code = int(json.loads(line)["exit"])
                except (ValueError, KeyError, TypeError):
                    code = -signal.SIGKILL
                with contextlib.suppress(OSError):
                    self._reader.close()
                    self._conn.close()
                self.returncode = code
            return self.returncode


class Prefork:
    """The agent's handle on its spawner process."""

    def __init__(self, modules: Sequence[str], socket_path: str, python: str = sys.executable,
                 preexec: Callable[[], None] | None = None, env: Mapping[str, str] | None = None,
                 restart_backoff_s: float = 60.0, warm_wait_s: float = 0.0) -> None:
        self.modules = tuple(m for m in modules if m)
        self.socket_path = socket_path
        self.python = python
        self._preexec = preexec
        self._proc: subprocess.Popen[bytes] | None = None
        self._env = with_torchrun_threads(os.environ if env is None else env)
        self._backoff = restart_backoff_s
        self._warm_wait = warm_wait_s
        self._warm_until = -math.inf  # see await_warm
        self._started_at = -math.inf
        # PDEATHSIG fires when the *thread* that forked the spawner exits: start it from one thread
        # that lives as long as this handle, whichever thread asks.
        self._starter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefork-starter")
        self._closed = False

    def start(self) -> Prefork:
        self._starter.submit(self._launch).result()
        self._warm_until = self._started_at + self._warm_wait
        return self

    def _launch(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
        self._started_at = time.monotonic()
        self._proc = subprocess.Popen(
            [self.python, "-m", "agent.prefork", "--socket", self.socket_path, "--preload", ",".join(self.modules)],
            stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=self._preexec, env=self._env,
        )

    def _restart_if_dead(self) -> None:
        """A spawner that died is started again (in the background, at most once per backoff); ranks
        are exec'd meanwhile."""
        dead = self._proc is not None and self._proc.poll() is not None
        if dead:
            self._warm_until = -math.inf  # see await_warm
        if dead and not self._closed and time.monotonic() - self._started_at >= self._backoff:
            log.warning("the rank spawner is gone; starting it again")
            self._started_at = time.monotonic()
            self._starter.submit(self._launch)

    def _alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def ready(self) -> bool:
        return self._alive() and os.path.exists(self.socket_path)

    def importing(self) -> bool:
        """Started and alive, its imports not done yet."""
        return self._alive() and not os.path.exists(self.socket_path)

    def await_warm(self) -> None:
        """A rank asked for while the spawner does its first imports waits for them, up to
        ``warm_wait_s`` after :meth:`start`: the spawner is ahead of a new process's own import, and both
        on one node's cores slow each other (6 ranks started cold beside 3 importing spawners took 17 s
        to their first step on 2 cores). A spawner that dies or overruns the bound leaves the rank to
        start cold, and so does one restarted after dying: it may be one that cannot serve at all (on
        a GPU node, docs/agent-detection.md), and then each wait would only delay a rank."""
        while self.importing() and time.monotonic() < self._warm_until:
            time.sleep(0.05)

    def wait_ready(self, timeout_s: float = 120.0) -> Prefork:
        """Block until the spawner serves (its imports done); :class:`PreforkUnavailable` if it died."""
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            if self._proc is None or self._proc.poll() is not None or time.monotonic() > deadline:
                raise PreforkUnavailable("the rank spawner did not come up")
            time.sleep(0.02)
        return self

    def eligible(self, argv: Sequence[str], env: Mapping[str, str] | None, cwd: str | None = None) -> bool:
        """Whether forking from the spawner runs exactly what exec'ing ``argv`` would."""
        rank_env = startup_env(os.environ if env is None else env)
        if len(argv) < 2 or rank_env != startup_env(self._env):
            return False
        # the spawner's interpreter, also when named relative to the rank's directory (".venv/bin/python")
        if os.path.abspath(os.path.join(cwd or os.getcwd(), argv[0])) != os.path.abspath(self.python):
            return False
        if _is_script(argv[1]):
            # a missing script is exec'd, so that the rank fails as python says it does
            return os.path.isfile(os.path.join(cwd or os.getcwd(), argv[1]))
        return len(argv) >= 3 and (argv[1] == "-c" or (argv[1] == "-m" and argv[2] in self.modules))

    @property
    def env(self) -> dict[str, str]:
        """The environment the spawner runs with: a process forked with it runs as exec'd."""
        return dict(self._env)

    def spawn(self, argv: Sequence[str], env: Mapping[str, str] | None, cwd: str | None,
              stdout: int | None, stderr: int | None = None, stdin: int | None = None) -> PreforkedProcess:
        """Fork ``argv`` from the spawner; stdout goes to ``stdout`` (a descriptor; None: ours), stderr
        to ``stderr``, or when None to a pipe read through the result's ``stderr``; stdin comes from
        ``stdin`` (None: /dev/null). Raises :class:`PreforkUnavailable` when it cannot."""
        if not self.ready():
            self._restart_if_dead()
            raise PreforkUnavailable("the rank spawner is not running (yet)")
        request = json.dumps({"argv": list(argv), "env": dict(os.environ if env is None else env),
                              "cwd": cwd}).encode()
        read_end, write_end = os.pipe() if stderr is None else (-1, os.dup(stderr))
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        reader = conn.makefile("rb")
        try:
            conn.settimeout(10.0)
            conn.connect(self.socket_path)
            out = sys.stdout.fileno() if stdout is None else stdout
            fds = [out, write_end] if stdin is None else [out, write_end, stdin]
            socket.send_fds(conn, [_HEADER.pack(len(request)) + request], fds)
            answer = json.loads(reader.readline() or b"{}")
            pid = int(answer["pid"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            # hanging up makes the spawner kill a rank it may have forked already (no twin)
            reader.close()
            conn.close()
            if read_end >= 0:
                os.close(read_end)
            raise PreforkUnavailable(f"the rank spawner did not start the rank: {exc}") from exc
        finally:
            os.close(write_end)
        conn.settimeout(None)
        return PreforkedProcess(pid, conn, reader, os.fdopen(read_end, "rb") if read_end >= 0 else None)

    def close(self) -> None:
        self._closed = True
        self._starter.shutdown(wait=True)
        if self._proc is not None:
            stop_process(self._proc)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)


def start_helper(prefork: Prefork | None, module: str, args: Sequence[str], stdout: int, stdin: int | None = None,
                 preexec: Callable[[], None] | None = None, fork_only: bool = False) -> Child:
    """Start one of the agent's own helpers, ``python -m MODULE ARGS`` (the store sidecar, the failure
    marker): forked by the spawner when it serves and preloaded ``module`` (milliseconds: torch is
    imported already), else a new process in a session of its own, which spends seconds importing it.
    Either way it dies with the agent (PDEATHSIG: through ``preexec``, or through the spawner), and its
    stderr is the agent's. Raises OSError when no process can be started; with ``fork_only``,
    :class:`PreforkUnavailable` when the spawner cannot fork it (for a caller on a short-lived thread:
    ``preexec``'s PDEATHSIG would kill a new process when that thread exits)."""
    if prefork is not None:
        argv = [prefork.python, "-m", module, *args]
        if prefork.eligible(argv, prefork.env):
            try:
                return prefork.spawn(argv, prefork.env, None, stdout, stderr=2, stdin=stdin)
            except (PreforkUnavailable, OSError) as exc:
                if fork_only:
                    raise PreforkUnavailable(str(exc)) from exc
                log.info("helper starts as a new process", module=module, reason=str(exc))
        elif fork_only:
            raise PreforkUnavailable(f"the spawner cannot fork {module} as python -m would run it")
    elif fork_only:
        raise PreforkUnavailable("no spawner")
    return subprocess.Popen(
        [sys.executable, "-m", module, *args], stdin=subprocess.DEVNULL if stdin is None else stdin,
        stdout=stdout, start_new_session=True, preexec_fn=preexec,
    )


# ---------------------------------------------------------------------------------- spawner's side


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 65536, 3)
    try:
        return _read_request(conn, data, len(fds)), fds
    except (OSError, ValueError):
        for fd in fds:  # a refused request must not leave the spawner holding its descriptors
            os.close(fd)
        raise


def _read_request(conn: socket.socket, data: bytes, n_fds: int) -> dict[str, Any]:
    while len(data) < _HEADER.size:
        chunk = conn.recv(65536)
        if not chunk:
            raise ValueError("truncated request")
        data += chunk
    (size,) = _HEADER.unpack_from(data)
    if size > _MAX_REQUEST:
        raise ValueError(f"request of {size} bytes")
    body = data[_HEADER.size :]
    while len(body) < size:
        chunk = conn.recv(65536)
        if not chunk:
            raise ValueError("truncated request")
        body += chunk
    if n_fds not in (2, 3):
        raise ValueError(f"expected stdout, stderr and maybe stdin descriptors, got {n_fds}")
    request: dict[str, Any] = json.loads(body)
    return request


#: CPython converts an exit code to a C long; past that range it exits as with -1
_C_LONG_LIMIT = 1 << (8 * struct.calcsize("l") - 1)


def _exit_code(value: object) -> int:
    """The status ``python`` exits with after ``SystemExit(value)``: an int's low byte (the kernel keeps no
    more), 255 for an int beyond a C long; anything else is printed and exits 1."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF if -_C_LONG_LIMIT <= value < _C_LONG_LIMIT else 0xFF
    print(value, file=sys.stderr)
    return 1


def _is_script(arg: str) -> bool:
    """``python SCRIPT.py``: a path, not an interpreter option."""
    return arg.endswith(".py") and not arg.startswith("-")


def _set_path0(entry: str) -> None:
    """Put ``entry`` first on sys.path, as python does for the rank's command, in place of the spawner's
    own (``-m``: the directory it started in). Under safe_path (PYTHONSAFEPATH, a startup variable the
    rank shares with the spawner) python puts nothing there, nor did it for the spawner."""
    if not sys.flags.safe_path:
        sys.path[0] = entry


def _run_script(path: str, args: list[str]) -> None:
    """What ``python PATH ARGS`` does: argv as given, ``__file__`` absolute, the script's real directory
    (links resolved) first on sys.path, and a fresh ``__main__`` module that the code runs in."""
    full = os.path.abspath(path)
    sys.argv = [path, *args]
    _set_path0(os.path.dirname(os.path.realpath(full)))
    with open(full, "rb") as f:
        code = compile(f.read(), full, "exec")
    main = types.ModuleType("__main__")
    main.__file__ = full
    main.__builtins__ = builtins  # type: ignore[attr-defined]
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


def _run_rank(request: dict[str, Any]) -> int:
    """In the forked child: become what ``python ARGV...`` would have been, and run it. Returns its exit
    status, or minus the signal it is to end by."""
    argv: list[str] = request["argv"]
    sys.orig_argv = list(argv)
    os.environ.clear()
    os.environ.update(request["env"])
    numpy = sys.modules.get("numpy")
    if numpy is not None:  # fresh entropy, as a new process's would be (random reseeds itself at fork)
        numpy.random.seed()
    if request.get("cwd"):
        os.chdir(request["cwd"])
    try:
        if argv[1] == "-c":
            sys.argv = ["-c", *argv[3:]]
            _set_path0("")  # the working directory, whichever it is when an import looks
            namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
            exec(compile(argv[2], "<string>", "exec"), namespace)
        elif _is_script(argv[1]):
            _run_script(argv[1], argv[2:])
        else:
            sys.argv = [argv[2], *argv[3:]]
            _set_path0(os.getcwd())
            # As under ``python -m``, the module runs as __main__ only (what it imports stays loaded).
            sys.modules.pop(argv[2], None)
            runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException as exc:
        # as the interpreter does: sys.excepthook, which the rank may have replaced (unicron.kernel.client
        # reports the exception to the agent through it)
        try:
            sys.excepthook(type(exc), exc, exc.__traceback__)
        except BaseException:
            traceback.print_exception(exc)
        # python ends an unhandled ^C by SIGINT (so that its parent sees the ^C), once it has shut down
        code = -signal.SIGINT if isinstance(exc, KeyboardInterrupt) else 1
    # What the interpreter does at exit, in its order: threading's exit hooks (they stop executor
    # workers) and joining non-daemon threads, then atexit.
    shutdown = getattr(threading, "_shutdown", None)
    if callable(shutdown):
        shutdown()
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    return code


def _child(request: dict[str, Any], fds: list[int], spawner: int, keep_closed: list[int],
           mask: set[int | signal.Signals]) -> NoReturn:
    """The forked process: becomes the rank and exits. It never returns nor raises: back in the spawner's
    loop, its copy of serve()'s finally would SIGKILL every rank the spawner forked and unlink its socket."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own process group, as the supervisor signals ranks by group
        # Signals sent before this point stayed blocked: they now meet the default handlers a new
        # process would have, not the spawner's.
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # SIGPIPE stays ignored, as Python sets it
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for fd in keep_closed:
            with contextlib.suppress(OSError):
                os.close(fd)
        die_with_parent(spawner)
        stdin = fds[2] if len(fds) == 3 else os.open(os.devnull, os.O_RDONLY)
        os.dup2(stdin, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in {stdin, *fds}:
            if fd > 2:
                os.close(fd)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's stdout
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        code = _run_rank(request)
    finally:
        try:
            with contextlib.suppress(BaseException):
                sys.stdout.flush()
                sys.stderr.flush()
                if code < 0:  # by the signal's default action, as python does
                    signal.signal(-code, signal.SIG_DFL)
                    os.kill(os.getpid(), -code)
        finally:  # even when a signal's KeyboardInterrupt lands outside the suppress
            os._exit(code if code >= 0 else 128 - code)  # (the signal blocked: python's status then)


def serve(socket_path: str, modules: Sequence[str]) -> int:
    parent = os.getppid()
    die_with_parent(parent)
    for name in modules:
        importlib.import_module(name)  # the whole point: import once, fork many
    threads = len(os.listdir("/proc/self/task"))
    if threads > 1:  # a forked child would inherit locks held by threads that do not exist in it
        print(f"prefork: preloading {','.join(modules)} started {threads - 1} thread(s); forking is unsafe, "
              "ranks start as new processes (is OMP_NUM_THREADS unset?)", file=sys.stderr)
        return 2
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, lambda *_: None)  # handled in the loop: leave through finally
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = f"{socket_path}.{os.getpid()}"
    listener.bind(tmp)
    listener.listen(64)
    os.rename(tmp, socket_path)  # the socket appears only once everything is imported
    ranks: dict[int, socket.socket] = {}
    hung_up: set[int] = set()
    stopping = False
    try:
        while not stopping:
            watched = {c.fileno(): pid for pid, c in ranks.items() if pid not in hung_up}
            ready, _, _ = select.select([listener.fileno(), wake_r, *watched], [], [], 1.0)
            if wake_r in ready:
                with contextlib.suppress(BlockingIOError):
                    stopping = signal.SIGTERM in os.read(wake_r, 4096)
            for fd in ready:
                if fd in watched:
                    _on_hang_up(watched[fd], ranks[watched[fd]], hung_up)
            _reap(ranks, hung_up)
            if os.getppid() != parent:
                break
            if listener.fileno() in ready:
                _accept(listener, ranks, [listener.fileno(), wake_r, wake_w])
    finally:
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(socket_path)
    return 0


def _accept(listener: socket.socket, ranks: dict[int, socket.socket], own_fds: list[int]) -> None:
    # an error here costs one request (the agent execs that rank), never the ranks already forked:
    # leaving serve's loop would SIGKILL them all
    try:
        conn, _ = listener.accept()
    except OSError as exc:  # EMFILE, ECONNABORTED
        log.warning("cannot accept a spawn request", error=str(exc))
        return
    conn.settimeout(5.0)
    try:
        request, fds = _receive(conn)
    except (OSError, ValueError) as exc:
        log.warning("bad spawn request", error=str(exc))
        conn.close()
        return
    keep_closed = [*own_fds, conn.fileno(), *(c.fileno() for c in ranks.values())]
    spawner = os.getpid()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, _BLOCKED_WHILE_FORKING)
    try:
        pid = os.fork()
    except OSError as exc:  # EAGAIN (the pids cgroup, RLIMIT_NPROC), ENOMEM: the closed connection
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # tells the agent to exec this rank instead
        log.warning("cannot fork a rank", error=str(exc))
        for fd in fds:
            os.close(fd)
        conn.close()
        return
    if pid == 0:
        _child(request, fds, spawner, keep_closed, mask)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    with contextlib.suppress(OSError):
        os.setpgid(pid, pid)  # also here: the group must exist before the agent learns the pid
    for fd in fds:
        os.close(fd)
    ranks[pid] = conn
    with contextlib.suppress(OSError):  # if the agent is gone already, the hang-up kills the rank
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")


def _on_hang_up(pid: int, conn: socket.socket, hung_up: set[int]) -> None:
    """The agent closed a rank's connection (it gave up waiting for the pid, or dropped the rank):
    nobody supervises that rank any more, so it must not live on. The agent never sends anything
    after the request, so a readable connection means end of file."""
    with contextlib.suppress(OSError):
        if conn.recv(1):
            return
    hung_up.add(pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def _reap(ranks: dict[int, socket.socket], hung_up: set[int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        hung_up.discard(pid)
        conn = ranks.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"exit": code}).encode() + b"\n")
            conn.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agent.prefork", description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True, help="Unix socket path to serve on")
    parser.add_argument("--preload", default="", help="comma-separated modules to import before serving")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the agent's ^C reaches us too; it stops us itself
    try:
        return serve(args.socket, [m for m in args.preload.split(",") if m])
    except ImportError as exc:
        print(f"prefork: cannot preload: {exc}; ranks start as new processes", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

