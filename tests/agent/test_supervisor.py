"""Process supervision with real child processes (python -c snippets), each test run twice: ranks
exec'd as new processes, and ranks forked by the warm spawner (agent.prefork): the supervisor's
contract is the same for both."""

from __future__ import annotations

import io
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.prefork import Prefork, PreforkedProcess
from agent.supervisor import EXITED, RUNNING, STOPPED, RankExit, RankStillRunning, Supervisor
from unicron.kernel import log as ulog
from unicron.kernel.errors import PermanentError
from unicron.kernel.procs import group_alive, proc_state
from unicron.kernel.types import ErrorKind

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable


def py(code: str) -> list[str]:
    return [PY, "-c", code]


class Events:
    def __init__(self) -> None:
        self.order: list[str] = []  # "exit" / "match", in callback order
        self.exit_list: list[tuple[RankExit, float]] = []  # (exit, time.time() in the callback)
        self.matches: list[tuple[int, ErrorKind, str, float]] = []
        self.lines: list[tuple[int, str]] = []
        self.cond = threading.Condition()

    def on_exit(self, exit: RankExit) -> None:
        seen = time.time()
        with self.cond:
            self.order.append("exit")
            self.exit_list.append((exit, seen))
            self.cond.notify_all()

    def on_match(self, rank: int, pid: int, kind: ErrorKind, line: str, ts: float) -> None:
        with self.cond:
            self.order.append("match")
            self.matches.append((rank, kind, line, ts))
            self.cond.notify_all()

    def sink(self, rank: int, line: str) -> None:
        with self.cond:
            self.lines.append((rank, line))

    def exits(self, n: int, timeout_s: float = 10.0) -> list[tuple[RankExit, float]]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.exit_list) >= n, timeout_s), self.order
            return list(self.exit_list)


@pytest.fixture
def ev() -> Events:
    return Events()


def started(prefork: Prefork, timeout_s: float = 30.0) -> Prefork:
    prefork.start()
    deadline = time.monotonic() + timeout_s
    while not prefork.ready():
        assert time.monotonic() < deadline, "the spawner did not come up"
        time.sleep(0.02)
    return prefork


@pytest.fixture(scope="module")
def spawner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prefork]:
    prefork = started(Prefork(["agent.prefork"], str(tmp_path_factory.mktemp("pf") / "s")))
    try:
        yield prefork
    finally:
        prefork.close()


@pytest.fixture(autouse=True)
def one_openmp_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    # what the agent gives its ranks (torchrun's default) and the spawner runs with: ranks qualify
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture(params=["exec", "prefork"])
def sup(request: pytest.FixtureRequest, ev: Events) -> Iterator[Supervisor]:
    prefork = request.getfixturevalue("spawner") if request.param == "prefork" else None
    s = Supervisor(ev.on_exit, ev.on_match, stderr_sink=ev.sink, prefork=prefork)
    try:
        yield s
        kinds = {type(p.popen) for p in s._procs.values()}
        assert kinds <= ({PreforkedProcess} if prefork else {subprocess.Popen}), kinds
    finally:
        s.close(grace_s=1.0)


def test_exit_is_detected_within_milliseconds_of_the_childs_exit(
    sup: Supervisor, ev: Events, tmp_path: Path,
) -> None:
    lags = []
    for i in range(3):
        stamp = tmp_path / f"ts{i}"
        code = f"import os, time; t = time.time(); open({str(stamp)!r}, 'w').write(repr(t)); os._exit(3)"
        sup.launch(i, py(code))
        exit, seen = ev.exits(i + 1)[i]
        lags.append(seen - float(stamp.read_text()))
        assert (exit.rank, exit.returncode, exit.requested, exit.abnormal) == (i, 3, False, True)
        assert exit.ts <= seen
    print(f"child exit -> on_exit: {[f'{lag * 1e3:.1f} ms' for lag in lags]}")
    # The median of three: one run can lose the CPU for tens of ms on a 2-core machine shared with others.
    assert sorted(lags)[1] < 0.050


def test_kill_by_someone_else_is_abnormal(sup: Supervisor, ev: Events) -> None:
    proc = sup.launch(0, py("import time; time.sleep(30)"))
    os.kill(proc.pid, signal.SIGKILL)
    ((exit, _),) = ev.exits(1)
    assert exit.returncode == -signal.SIGKILL and exit.signal == signal.SIGKILL
    assert exit.abnormal and not exit.requested


def test_requested_termination_is_not_a_failure(sup: Supervisor, ev: Events) -> None:
    sup.launch(0, py("import time; time.sleep(30)"))
    sup.kill(0, signal.SIGTERM, grace_s=5.0)
    ((exit, _),) = ev.exits(1)
    assert exit.requested and not exit.abnormal and exit.returncode == -signal.SIGTERM
    assert sup.status()[0].state == EXITED


def test_ignored_sigterm_escalates_to_sigkill(sup: Supervisor, ev: Events, tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    sup.launch(0, py("import signal, time, pathlib; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                     f"pathlib.Path({str(ready)!r}).touch(); time.sleep(30)"))
    while not ready.exists():
        time.sleep(0.005)
    t0 = time.time()
    sup.kill(0, signal.SIGTERM, grace_s=0.2)
    ((exit, seen),) = ev.exits(1)
    assert exit.returncode == -signal.SIGKILL and exit.requested and not exit.abnormal
    assert 0.2 <= seen - t0 < 2.0


def test_clean_exit_is_not_abnormal(sup: Supervisor, ev: Events) -> None:
    sup.launch(0, py("pass"))
    ((exit, _),) = ev.exits(1)
    assert exit.returncode == 0 and not exit.abnormal


def test_stderr_lines_are_forwarded_and_matched_with_rate_limit(sup: Supervisor, ev: Events) -> None:
    ima = "RuntimeError: CUDA error: an illegal memory access was encountered"
    code = ("import sys\n"
            "print('step 1 ok', file=sys.stderr)\n"
            "print('Watchdog caught collective operation timeout', file=sys.stderr)\n"
            f"for _ in range(3): print({ima!r}, file=sys.stderr)\n"
            "sys.exit(1)\n")
    sup.launch(5, py(code))
    ev.exits(1)
    assert [(r, k, line) for r, k, line, _ in ev.matches] == [
        (5, ErrorKind.NCCL_TIMEOUT, "Watchdog caught collective operation timeout"),
        (5, ErrorKind.ILLEGAL_MEMORY_ACCESS, ima),
    ]
    assert ev.order == ["match", "match", "exit"]  # the cause arrives before the exit
    exit = ev.exits(1)[0][0]
    assert exit.stderr_kind is ErrorKind.ILLEGAL_MEMORY_ACCESS and exit.returncode == 1
    nccl = "Watchdog caught collective operation timeout"
    assert ev.lines == [(5, "step 1 ok"), (5, nccl), (5, ima), (5, ima), (5, ima)]


def test_stderr_is_appended_to_the_ranks_stderr_log_and_forwarded_with_its_task(
        ev: Events, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Before, a rank's stderr reached only the agent's own stderr as ``[rank N] ...``: on a node running
    two tasks nobody could tell whose traceback it was, and the task's logs never had it."""
    s = Supervisor(ev.on_exit, ev.on_match, task="alpha")
    try:
        code = "import sys; print('out line'); print('RuntimeError: bad batch', file=sys.stderr); sys.exit(1)"
        s.launch(0, py(code), stdout_path=str(tmp_path / "rank0.log"), stderr_path=str(tmp_path / "rank0.err"))
        ev.exits(1)
        reader = s._procs[0].reader
        assert reader is not None
        reader.join(10)  # its last line may be written after the exit was handled
    finally:
        s.close(grace_s=1.0)
    assert (tmp_path / "rank0.err").read_text() == "RuntimeError: bad batch\n"
    assert (tmp_path / "rank0.log").read_text() == "out line\n"  # stdout's log is the job's output alone
    assert "[alpha rank 0] RuntimeError: bad batch" in capfd.readouterr().err


def test_exit_runs_thread_pool_shutdown_and_atexit_as_a_new_process_would(sup: Supervisor, ev: Events) -> None:
    code = ("import atexit, sys\n"
            "from concurrent.futures import ThreadPoolExecutor\n"
            "pool = ThreadPoolExecutor(1)\n"
            "pool.submit(int).result()\n"  # an idle non-daemon worker stays: exit must still stop it
            "atexit.register(lambda: print('atexit ran', file=sys.stderr))\n")
    sup.launch(0, py(code))
    ((exit, _),) = ev.exits(1, timeout_s=10.0)
    assert exit.returncode == 0
    deadline = time.monotonic() + 2.0
    while (0, "atexit ran") not in ev.lines and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (0, "atexit ran") in ev.lines


def test_an_uncaught_exception_goes_through_sys_excepthook(sup: Supervisor, ev: Events) -> None:
    code = ("import sys\n"
            "sys.excepthook = lambda t, e, tb: print('hooked', t.__name__, e, file=sys.stderr)\n"
            "raise ValueError('boom')\n")
    sup.launch(0, py(code))
    ((exit, _),) = ev.exits(1)
    assert exit.returncode == 1
    deadline = time.monotonic() + 2.0
    while (0, "hooked ValueError boom") not in ev.lines and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (0, "hooked ValueError boom") in ev.lines


def test_a_rank_ended_by_an_uncaught_keyboard_interrupt_dies_of_sigint(sup: Supervisor, ev: Events) -> None:
    """Python (3.8+) ends a process whose KeyboardInterrupt went unhandled by SIGINT, after its traceback
    and atexit: an exec'd rank reports -2. A forked one reported 1; now -2 too (a review's reproduction)."""
    code = ("import atexit, os, signal, sys, time\n"
            "atexit.register(lambda: print('atexit ran', file=sys.stderr))\n"
            # python leaves SIGINT ignored when it started so (a background job of a shell: a fresh
            # clone's test run under nohup), and the rank would sleep through the signal
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "os.kill(os.getpid(), signal.SIGINT)\n"
            "time.sleep(10)\n")
    sup.launch(0, py(code))
    ((exit, _),) = ev.exits(1)
    assert exit.returncode == -signal.SIGINT
    deadline = time.monotonic() + 2.0
    while (0, "atexit ran") not in ev.lines and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (0, "KeyboardInterrupt") in ev.lines and (0, "atexit ran") in ev.lines


def test_a_c_rank_imports_a_module_from_its_working_directory(sup: Supervisor, ev: Events, tmp_path: Path) -> None:
    """``python -c`` puts '' (the working directory) first on sys.path; a forked rank had the spawner's
    directory there instead, and a module beside it did not import (a review's reproduction; sys.path in
    every form: tests/agent/test_prefork.py)."""
    (tmp_path / "beside_the_rank.py").write_text("VALUE = 42\n")
    sup.launch(0, py("import sys, beside_the_rank; print(beside_the_rank.VALUE, file=sys.stderr)"), cwd=str(tmp_path))
    ((exit, _),) = ev.exits(1)
    assert exit.returncode == 0, ev.lines[-2:]
    assert ev.lines == [(0, "42")]


def test_stop_and_cont(sup: Supervisor, ev: Events, tmp_path: Path) -> None:
    ticks = tmp_path / "ticks"
    loop = f"import time\nwhile True:\n open({str(ticks)!r}, 'a').write('.')\n time.sleep(0.01)"
    proc = sup.launch(0, py(loop))
    while not ticks.exists():
        time.sleep(0.005)
    sup.stop(0)
    assert sup.status()[0].state == STOPPED
    time.sleep(0.05)
    frozen = ticks.stat().st_size
    time.sleep(0.1)
    assert ticks.stat().st_size == frozen
    sup.cont(0)
    assert sup.status()[0].state == RUNNING
    time.sleep(0.1)
    assert ticks.stat().st_size > frozen
    sup.kill(0, signal.SIGTERM)  # a SIGTERM reaches even a stopped rank (it is continued first)
    assert sup.wait(0, 5.0) is not None and proc.exit is not None and not proc.exit.abnormal


def test_a_sigterm_reaches_a_rank_stopped_by_someone_else_without_the_grace(
    sup: Supervisor, ev: Events, tmp_path: Path,
) -> None:
    ready = tmp_path / "ready"
    proc = sup.launch(0, py(f"import pathlib, time; pathlib.Path({str(ready)!r}).touch(); time.sleep(30)"))
    while not ready.exists():
        time.sleep(0.005)
    assert sup.status()[0].state == RUNNING
    os.kill(proc.pid, signal.SIGSTOP)  # not through sup.stop(): the supervisor never asked for it
    # a SIGTERM that lands before the stop takes effect would kill it anyway: wait for state T
    deadline = time.monotonic() + 5.0
    while proc_state(proc.pid) != "T":
        assert time.monotonic() < deadline, "the rank did not stop"
        time.sleep(0.005)
    assert sup.status()[0].state == STOPPED  # the kernel's view: what the coordinator needs behind a hang
    t0 = time.time()
    sup.kill(0, signal.SIGTERM, grace_s=5.0)
    ((exit, seen),) = ev.exits(1)
    assert exit.returncode == -signal.SIGTERM and exit.requested  # not the SIGKILL after the grace
    assert seen - t0 < 2.0


def test_terminate_all(sup: Supervisor, ev: Events) -> None:
    for rank in range(3):
        sup.launch(rank, py("import time; time.sleep(30)"))
    exits = sup.terminate_all(grace_s=2.0)
    assert sorted(e.rank for e in exits) == [0, 1, 2]
    assert all(e.requested and not e.abnormal for e in exits)
    assert {s.state for s in sup.status().values()} == {EXITED}


def test_terminate_all_by_sigkill_gives_no_sigterm_handler_a_chance(sup: Supervisor, ev: Events,
                                                                    tmp_path: Path) -> None:
    """An isolated node's ranks: their SIGTERM handler (the runtime's work-conserving stop) must not run."""
    marker = tmp_path / "stopped politely"
    handler = (f"import signal, sys, time\n"
               f"def stop(*_):\n    open({str(marker)!r}, 'w').close(); sys.exit(0)\n"
               f"signal.signal(signal.SIGTERM, stop)\nprint('ready', file=sys.stderr, flush=True)\n"
               f"time.sleep(30)\n")
    sup.launch(0, py(handler))
    deadline = time.monotonic() + 10.0
    while (0, "ready") not in ev.lines and time.monotonic() < deadline:
        time.sleep(0.02)
    assert (0, "ready") in ev.lines, "the rank never installed its handler"
    (exit,) = sup.terminate_all(grace_s=5.0, sig=signal.SIGKILL)
    assert exit.returncode == -signal.SIGKILL and exit.requested
    assert not marker.exists()


def test_launch_errors(sup: Supervisor) -> None:
    with pytest.raises(PermanentError, match="cannot start"):
        sup.launch(0, ["/nonexistent/trainer"])
    sup.launch(1, py("import time; time.sleep(30)"))
    with pytest.raises(RankStillRunning, match="already running"):  # not the command's fault
        sup.launch(1, py("pass"))


@pytest.mark.parametrize("on_line", [False, True])
@pytest.mark.parametrize("how", ["exec", "prefork"])
def test_a_stdout_log_that_cannot_be_opened_fails_the_launch_as_the_nodes_trouble(
        request: pytest.FixtureRequest, ev: Events, tmp_path: Path, how: str, on_line: bool) -> None:
    """With ``on_line`` (the agent's reconciler always sets it) the rank's stdout log was opened by its
    reader thread after the launch: a failure (a missing directory, ENOSPC, EMFILE) killed the reader, and
    the rank died of BrokenPipeError on its first print, blamed on the task. The log, the agent's file,
    is now opened by the launch, and its failure is an OSError, the node's trouble, either way (without
    ``on_line`` it was the command's PermanentError) (a review's reproduction)."""
    prefork = request.getfixturevalue("spawner") if how == "prefork" else None
    lines: list[str] = []
    sup = Supervisor(ev.on_exit, stderr_sink=ev.sink, prefork=prefork,
                     on_line=(lambda rank, pid, line, ts: lines.append(line)) if on_line else None)
    try:
        with pytest.raises(FileNotFoundError, match="no-such-dir"):
            sup.launch(0, py("print('iteration 1', flush=True)"), stdout_path=str(tmp_path / "no-such-dir" / "r.log"))
        assert sup.status() == {}
        sup.launch(0, py("print('iteration 1', flush=True)"), stdout_path=str(tmp_path / "r.log"))
        ((exit, _),) = ev.exits(1)
        assert exit.returncode == 0 and (tmp_path / "r.log").read_text() == "iteration 1\n"
    finally:
        sup.close(grace_s=1.0)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")  # a zombie is dead, just not yet reaped by its new parent


def _wait_dead(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.01)
    return False


def test_helpers_left_in_the_ranks_group_are_killed_when_it_exits(sup: Supervisor, ev: Events) -> None:
    code = ("import subprocess, sys\n"
            f"p = subprocess.Popen([{PY!r}, '-c', 'import time; time.sleep(30)'])\n"
            "print(p.pid, flush=True, file=sys.stderr)\n")
    sup.launch(0, py(code))
    ev.exits(1)
    helper = int(ev.lines[0][1])
    assert _wait_dead(helper, 2.0)


#: a wrapper script's python: saves "a checkpoint" for a second in its SIGTERM handler (or ignores SIGTERM)
WRAPPED_CHILD = """
import pathlib, signal, sys, time
def stop(*_):
    time.sleep(1.0)
    pathlib.Path(sys.argv[1]).write_text("saved")
    sys.exit(0)
signal.signal(signal.SIGTERM, signal.SIG_IGN if sys.argv[2] == "ignore" else stop)
print("ready", file=sys.stderr, flush=True)
while True:
    time.sleep(0.1)
"""


def _wrapped(tmp_path: Path, on_term: str) -> tuple[list[str], Path]:
    """A rank command as many jobs have it: bash running a script that runs python (a Megatron launcher)."""
    child, saved = tmp_path / "child.py", tmp_path / "saved"
    child.write_text(WRAPPED_CHILD)
    script = tmp_path / "train.sh"
    script.write_text(f"#!/bin/bash\n{shlex.quote(PY)} {shlex.quote(str(child))} {shlex.quote(str(saved))} {on_term}\n"
                      "echo wrapper done\n")
    return ["bash", str(script)], saved


def _ready(ev: Events, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (0, "ready") not in ev.lines:
        assert time.monotonic() < deadline, "the wrapped child never installed its handler"
        time.sleep(0.02)


def test_a_wrapper_scripts_python_gets_the_stops_grace_and_the_exit_waits_for_it(ev: Events, tmp_path: Path) -> None:
    """bash exits on SIGTERM at once; the python it runs saves a checkpoint in its handler. Before, the
    group was SIGKILLed as soon as bash exited and the save was cut short (torchrun waits its grace)."""
    argv, saved = _wrapped(tmp_path, "save")
    sup = Supervisor(ev.on_exit, ev.on_match, stderr_sink=ev.sink)
    try:
        proc = sup.launch(0, argv)
        _ready(ev)
        t0 = time.monotonic()
        sup.kill(0, signal.SIGTERM, grace_s=10.0)
        ((exit, _),) = ev.exits(1, timeout_s=15.0)
        assert saved.exists() and saved.read_text() == "saved", "the wrapped python was killed inside its grace"
        assert exit.requested and not exit.abnormal
        assert time.monotonic() - t0 < 8.0, "the exit waited out the whole grace of an emptied group"
        assert not group_alive(proc.pid), "the exit was reported while its group still ran"
    finally:
        sup.close(grace_s=1.0)


def test_a_wrapped_python_that_ignores_sigterm_is_killed_at_the_end_of_the_grace(ev: Events, tmp_path: Path) -> None:
    argv, _ = _wrapped(tmp_path, "ignore")
    sup = Supervisor(ev.on_exit, ev.on_match, stderr_sink=ev.sink)
    try:
        proc = sup.launch(0, argv)
        _ready(ev)
        t0 = time.monotonic()
        sup.kill(0, signal.SIGTERM, grace_s=0.5)
        ((exit, _),) = ev.exits(1, timeout_s=10.0)
        assert time.monotonic() - t0 >= 0.5
        assert exit.requested and not group_alive(proc.pid)
    finally:
        sup.close(grace_s=1.0)


def test_a_sigkill_ends_the_grace_of_a_wrapped_python(ev: Events, tmp_path: Path) -> None:
    argv, saved = _wrapped(tmp_path, "save")
    sup = Supervisor(ev.on_exit, ev.on_match, stderr_sink=ev.sink)
    try:
        proc = sup.launch(0, argv)
        _ready(ev)
        sup.kill(0, signal.SIGTERM, grace_s=30.0)
        sup.kill(0, signal.SIGKILL)
        ((exit, _),) = ev.exits(1, timeout_s=10.0)
        assert exit.requested and not group_alive(proc.pid) and not saved.exists()
    finally:
        sup.close(grace_s=1.0)


#: a helper of the rank whose memory takes the kernel a while to free once it is SIGKILLed
HEAVY_HELPER = """
import sys, time
held = b"x" * (768 << 20)  # written, so its pages are the process's own
print("ready", file=sys.stderr, flush=True)
time.sleep(60)
"""


def test_a_killed_ranks_exit_is_reported_once_its_group_has_died(ev: Events, tmp_path: Path) -> None:
    """The exit was reported right after the group's SIGKILL, while its helpers were still dying (CI failed
    on it): a relaunch must not meet them still holding the GPU."""
    helper = tmp_path / "helper.py"
    helper.write_text(HEAVY_HELPER)
    script = tmp_path / "train.sh"
    script.write_text(f"#!/bin/bash\n{shlex.quote(PY)} {shlex.quote(str(helper))} &\nwait\n")
    sup = Supervisor(ev.on_exit, ev.on_match, stderr_sink=ev.sink)
    try:
        for attempt in range(3):  # the kernel may free the memory before a look; three chances to see it
            proc = sup.launch(0, ["bash", str(script)])
            _ready(ev, timeout_s=30.0)
            ev.lines.clear()
            sup.kill(0, signal.SIGKILL)
            ((exit, _),) = ev.exits(attempt + 1, timeout_s=10.0)[attempt:]
            assert exit.requested and not group_alive(proc.pid), "the exit was reported while its group still died"
    finally:
        sup.close(grace_s=1.0)


AGENT = """
import sys, time
from unicron.kernel import log as ulog
ulog.configure(stream=sys.stderr)  # stdout carries the answer
from agent.supervisor import Supervisor
sup = Supervisor(lambda e: None, pdeathsig=sys.argv[1] == "1")
proc = sup.launch(0, [sys.executable, "-c", "import time; time.sleep(30)"])
print(proc.pid, flush=True)
time.sleep(30)
"""


@pytest.mark.parametrize("pdeathsig", [True, False])
def test_ranks_die_with_a_sigkilled_agent(pdeathsig: bool) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    agent = subprocess.Popen([PY, "-c", AGENT, "1" if pdeathsig else "0"], env=env, stdout=subprocess.PIPE)
    assert agent.stdout is not None
    rank_pid = int(agent.stdout.readline())
    assert _alive(rank_pid)
    agent.kill()
    agent.wait()
    try:
        if pdeathsig:
            assert _wait_dead(rank_pid, 2.0), "rank outlived its SIGKILLed agent"
        else:  # control: without PDEATHSIG the rank is orphaned, which is what the option prevents
            time.sleep(0.3)
            assert _alive(rank_pid)
    finally:
        if _alive(rank_pid):
            os.killpg(rank_pid, signal.SIGKILL)


# --- the warm spawner itself -------------------------------------------------------------------


def test_forked_module_rank_gets_its_argv_env_cwd_and_stdout(spawner: Prefork, ev: Events, tmp_path: Path) -> None:
    sup = Supervisor(ev.on_exit, ev.on_match, stderr_sink=ev.sink, prefork=spawner)
    try:
        env = {**os.environ, "RANK": "5"}
        out = tmp_path / "rank.log"
        proc = sup.launch(0, [PY, "-m", "agent.prefork", "--help"], env, cwd=str(tmp_path), stdout_path=str(out))
        assert isinstance(proc.popen, PreforkedProcess)  # forked, not exec'd
        ((exit, _),) = ev.exits(1)
        assert exit.returncode == 0
        assert "usage: python -m agent.prefork" in out.read_text()
        code = "import os, sys; print(os.environ['RANK'], os.getcwd(), sys.argv[1:], sys.stdin.read() == '', file=sys.stderr)"
        sup.launch(1, [PY, "-c", code, "x"], env, cwd=str(tmp_path))
        ev.exits(2)
        assert ev.lines == [(1, f"5 {tmp_path} ['x'] True")]
    finally:
        sup.close(grace_s=1.0)


def test_commands_the_spawner_cannot_run_exactly_are_exec(spawner: Prefork, ev: Events, tmp_path: Path) -> None:
    sup = Supervisor(ev.on_exit, ev.on_match, stderr_sink=ev.sink, prefork=spawner)
    try:
        not_preloaded = sup.launch(0, [PY, "-m", "json.tool", "--help"])
        other_path = sup.launch(1, py("pass"), {**os.environ, "PYTHONPATH": str(tmp_path)})
        more_threads = sup.launch(2, py("pass"), {**os.environ, "OMP_NUM_THREADS": "4"})
        for proc in (not_preloaded, other_path, more_threads):
            assert isinstance(proc.popen, subprocess.Popen)
        ev.exits(3)
    finally:
        sup.close(grace_s=1.0)


def test_a_stopped_spawner_falls_back_to_exec(ev: Events, tmp_path: Path) -> None:
    prefork = started(Prefork([], str(tmp_path / "s"), restart_backoff_s=0.0))
    prefork.close()  # closed: not started again either
    sup = Supervisor(ev.on_exit, ev.on_match, stderr_sink=ev.sink, prefork=prefork)
    try:
        proc = sup.launch(0, py("raise SystemExit(4)"))
        assert isinstance(proc.popen, subprocess.Popen)
        ((exit, _),) = ev.exits(1)
        assert exit.returncode == 4
    finally:
        sup.close(grace_s=1.0)


def test_a_spawner_that_died_is_started_again(ev: Events, tmp_path: Path) -> None:
    prefork = started(Prefork([], str(tmp_path / "s"), restart_backoff_s=0.0))
    sup = Supervisor(ev.on_exit, ev.on_match, stderr_sink=ev.sink, prefork=prefork)
    try:
        assert prefork._proc is not None
        prefork._proc.kill()
        prefork._proc.wait()
        meanwhile = sup.launch(0, py("pass"))
        assert isinstance(meanwhile.popen, subprocess.Popen)  # exec'd while the spawner restarts
        deadline = time.monotonic() + 30
        while not prefork.ready():
            assert time.monotonic() < deadline, "the spawner was not started again"
            time.sleep(0.02)
        assert isinstance(sup.launch(1, py("pass")).popen, PreforkedProcess)
        ev.exits(2)
    finally:
        sup.close(grace_s=1.0)
        prefork.close()


PREFORK_AGENT = """
import sys, time
from unicron.kernel import log as ulog
ulog.configure(stream=sys.stderr)  # stdout carries the answer
from unicron.kernel import log as ulog
ulog.configure(stream=sys.stderr)  # stdout carries the answer
from agent.prefork import Prefork
from agent.supervisor import Supervisor
from unicron.kernel.parentdeath import preexec
import signal
pf = Prefork([], sys.argv[1], preexec=preexec(signal.SIGKILL)).start()
while not pf.ready():
    time.sleep(0.02)
proc = Supervisor(lambda e: None, prefork=pf).launch(0, [sys.executable, "-c", "import time; time.sleep(30)"])
print(type(proc.popen).__name__, proc.pid, flush=True)
time.sleep(30)
"""


def test_forked_ranks_die_with_a_sigkilled_agent(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    agent = subprocess.Popen([PY, "-c", PREFORK_AGENT, str(tmp_path / "s")], env=env, stdout=subprocess.PIPE)
    assert agent.stdout is not None
    kind, pid = agent.stdout.readline().split()
    rank_pid = int(pid)
    assert kind == b"PreforkedProcess" and _alive(rank_pid)
    agent.kill()
    agent.wait()
    try:
        assert _wait_dead(rank_pid, 2.0), "a forked rank outlived its SIGKILLed agent"
    finally:
        if _alive(rank_pid):
            os.killpg(rank_pid, signal.SIGKILL)


def test_a_supervisors_lines_name_its_task(ev: Events) -> None:
    """A node runs ranks of several tasks: 'rank started' / 'rank process exited' with a rank alone
    named no one's."""
    stream = io.StringIO()
    ulog.configure("INFO", stream=stream)
    sup = Supervisor(ev.on_exit, ev.on_match, stderr_sink=ev.sink, task="pretrain")
    try:
        sup.launch(0, [PY, "-c", "pass"])
        ev.exits(1)
    finally:
        sup.close(grace_s=1.0)
        ulog.configure("INFO")
    lines = [json.loads(raw) for raw in stream.getvalue().splitlines()]
    events = {line["event"]: line for line in lines if line.get("logger") == "agent.supervisor"}
    assert events["rank started"]["task"] == "pretrain" and events["rank process exited"]["task"] == "pretrain"
