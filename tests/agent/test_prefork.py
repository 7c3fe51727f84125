"""The warm spawner's own robustness (its use by the supervisor: tests/agent/test_supervisor.py)."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.prefork import Prefork, PreforkUnavailable

PY = sys.executable


@pytest.fixture
def prefork(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Prefork]:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    p = Prefork([], str(tmp_path / "s")).start().wait_ready(30.0)
    try:
        yield p
    finally:
        p.close()


def _exit_code(prefork: Prefork, code: str, tmp_path: Path) -> int:
    with open(tmp_path / "out.log", "wb") as out:
        proc = prefork.spawn([PY, "-c", code], None, None, out.fileno(), out.fileno())
    return proc.wait()


@pytest.mark.parametrize("garbage", [
    b"",  # connects and hangs up
    b"not a length-prefixed request",
    struct.pack(">I", 1 << 30) + b"{}",  # absurd length
    struct.pack(">I", 7) + b"{broken",  # not JSON
    struct.pack(">I", 2) + b"{}",  # JSON, but no descriptors attached
])
def test_bad_requests_are_refused_and_the_spawner_keeps_serving(prefork: Prefork, tmp_path: Path,
                                                                garbage: bytes) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(10.0)
        conn.connect(prefork.socket_path)
        conn.sendall(garbage)
        conn.shutdown(socket.SHUT_WR)
        assert conn.recv(100) == b""  # refused: closed without an answer
    assert prefork.ready()
    assert _exit_code(prefork, "raise SystemExit(7)", tmp_path) == 7


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_a_refused_request_leaves_the_spawner_none_of_its_descriptors(prefork: Prefork, tmp_path: Path) -> None:
    """A request refused after its stdout and stderr descriptors arrived (not JSON, say) left the spawner
    holding both: at 1024 its select() failed and serve()'s finally SIGKILLed every forked rank. They are
    closed with the refused connection (since f463310; a review's reproduction)."""
    assert prefork._proc is not None
    before = _open_fds(prefork._proc.pid)
    for _ in range(20):
        r, w = os.pipe()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(10.0)
                conn.connect(prefork.socket_path)
                socket.send_fds(conn, [struct.pack(">I", 7) + b"{broken"], [w, w])
                conn.shutdown(socket.SHUT_WR)
                assert conn.recv(100) == b""  # refused: closed without an answer
        finally:
            os.close(r)
            os.close(w)
    assert _exit_code(prefork, "pass", tmp_path) == 0  # served after the refused ones (one loop, in order)
    deadline = time.monotonic() + 2.0  # (it closes the good request's connection right after the report)
    while (after := _open_fds(prefork._proc.pid)) > before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert after == before, f"the spawner holds {after - before} more descriptors after 20 refused requests"


def test_exit_codes_follow_popen_conventions(prefork: Prefork, tmp_path: Path) -> None:
    assert _exit_code(prefork, "pass", tmp_path) == 0
    assert _exit_code(prefork, "raise SystemExit('bad config')", tmp_path) == 1
    assert "bad config" in (tmp_path / "out.log").read_text()
    assert _exit_code(prefork, "raise ValueError('boom')", tmp_path) == 1
    assert "ValueError: boom" in (tmp_path / "out.log").read_text()
    assert _exit_code(prefork, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)", tmp_path) == -9


def test_an_out_of_range_exit_status_is_cpythons_and_spares_the_other_ranks(prefork: Prefork, tmp_path: Path) -> None:
    """``sys.exit(2**31)`` made the forked rank's os._exit raise OverflowError, which climbed back into
    the child's copy of the spawner's loop: its finally SIGKILLed every rank the spawner had forked
    and unlinked its socket. The rank now exits with the status python would (the low byte; 255 past
    a C long), and nothing in the child can return to that loop (a review's reproduction)."""
    with open(tmp_path / "other.log", "wb") as out:
        other = prefork.spawn([PY, "-c", "import time; time.sleep(60)"], None, None, out.fileno(), out.fileno())
    for value in ["2**31", "2**31 + 3", "-1", "2**63", "-2**63", "2**70"]:
        code = f"import sys; sys.exit({value})"
        assert _exit_code(prefork, code, tmp_path) == subprocess.run([PY, "-c", code]).returncode, value
    with pytest.raises(subprocess.TimeoutExpired):  # the other rank still runs
        other.wait(0.3)
    assert prefork.ready(), "the spawner's socket is gone"


def test_poll_does_not_block_and_sees_the_exit(prefork: Prefork, tmp_path: Path) -> None:
    with open(tmp_path / "out.log", "wb") as out:
        proc = prefork.spawn([PY, "-c", "import time; time.sleep(0.5)"], None, None, out.fileno(), out.fileno())
    t0 = time.monotonic()
    assert proc.poll() is None and time.monotonic() - t0 < 0.1
    deadline = time.monotonic() + 10
    while proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert proc.returncode == 0


def test_a_spawner_whose_imports_start_threads_refuses_to_serve(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    mod = tmp_path / "threaded_mod.py"
    mod.write_text("import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    p = Prefork(["threaded_mod"], str(tmp_path / "s")).start()
    try:
        with pytest.raises(PreforkUnavailable, match="did not come up"):
            p.wait_ready(30.0)
    finally:
        p.close()


def test_forked_ranks_do_not_share_numpy_random_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    p = Prefork(["numpy"], str(tmp_path / "s")).start().wait_ready(60.0)
    try:
        draws = []
        for i in range(2):
            out = tmp_path / f"out{i}.log"
            with open(out, "wb") as fh:
                proc = p.spawn([PY, "-c", "import numpy; print(numpy.random.randint(1 << 30))"], None, None,
                               fh.fileno(), fh.fileno())
            assert proc.wait() == 0
            draws.append(out.read_text().strip())
        assert draws[0] != draws[1]  # a new process's entropy each, not the spawner's state twice
    finally:
        p.close()


def test_a_rank_whose_connection_the_agent_dropped_is_killed(prefork: Prefork, tmp_path: Path) -> None:
    """A rank lives only while someone waits on it: an agent that gave up on the pid (and starts the
    rank as a new process instead) must not leave a forked twin running."""
    with open(tmp_path / "out.log", "wb") as out:
        proc = prefork.spawn([PY, "-c", "import time; time.sleep(60)"], None, None, out.fileno(), out.fileno())
    proc._reader.close()  # (the socket closes with its last file object)
    proc._conn.close()
    deadline = time.monotonic() + 5
    while Path(f"/proc/{proc.pid}").exists() and "Z" not in Path(f"/proc/{proc.pid}/stat").read_text().split()[2]:
        assert time.monotonic() < deadline, "the orphaned rank still runs"
        time.sleep(0.02)
    assert _exit_code(prefork, "pass", tmp_path) == 0  # and the spawner serves on


def test_a_script_runs_forked_as_python_script_would_run_it(prefork: Prefork, tmp_path: Path) -> None:
    # A user's ``python train.py ARGS`` (a torchrun-style script): argv, __file__, __name__ and the
    # script's directory first on sys.path, as the interpreter sets them; a module beside it imports.
    work = tmp_path / "job"
    work.mkdir()
    (work / "helper.py").write_text("VALUE = 42\n")
    (work / "train.py").write_text(
        "import os, sys, helper\n"
        "print(sys.argv, os.path.basename(__file__), __name__, sys.path[0] == os.path.dirname(__file__),"
        " helper.VALUE, flush=True)\n"
        "sys.exit(3)\n")
    argv = [PY, "train.py", "--steps", "5"]
    assert prefork.eligible(argv, None, str(work))
    assert not prefork.eligible([PY, "missing.py"], None, str(work))  # exec'd: python's own error
    assert not prefork.eligible(["python", "train.py"], None, str(work))  # not the spawner's interpreter
    assert prefork.eligible([os.path.relpath(PY, work), "train.py"], None, str(work))  # it, named relative
    with open(tmp_path / "out.log", "wb") as out:
        proc = prefork.spawn(argv, None, str(work), out.fileno(), out.fileno())
    assert proc.wait() == 3
    assert (tmp_path / "out.log").read_text().strip() == "['train.py', '--steps', '5'] train.py __main__ True 42"


@pytest.mark.parametrize("var", ["TORCH_DISTRIBUTED_DEBUG", "TORCH_LOGS", "TORCH_CPP_LOG_LEVEL", "OMP_NUM_THREADS"])
def test_a_rank_asking_for_what_torch_reads_at_import_is_not_forked(prefork: Prefork, tmp_path: Path,
                                                                     var: str) -> None:
    """Jobs review: forked from a spawner that had imported torch, a rank's TORCH_DISTRIBUTED_DEBUG=DETAIL
    (collective checks to debug a hang) silently read OFF; such a rank is exec'd instead."""
    (tmp_path / "train.py").write_text("")
    argv = [PY, "train.py"]
    env = prefork.env
    assert prefork.eligible(argv, env, str(tmp_path))
    env[var] = "DETAIL" if var == "TORCH_DISTRIBUTED_DEBUG" else "7"
    assert not prefork.eligible(argv, env, str(tmp_path))


@pytest.mark.parametrize("safe_path", [False, True])
def test_a_rank_gets_the_sys_path_python_would_give_its_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                safe_path: bool) -> None:
    """A forked rank kept the spawner's sys.path[0] (the agent's directory), so a ``-c`` rank could not
    import a module from its working directory; and a script's directory replaced an entry python had put
    there under PYTHONSAFEPATH. Now sys.path[0] is python's: '' for -c, the working directory for -m, the
    script's real directory, nothing under safe_path (a review's reproduction)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    work, real = tmp_path / "job", tmp_path / "real"
    if safe_path:  # what -m and the spawner import then is found on PYTHONPATH only
        monkeypatch.setenv("PYTHONSAFEPATH", "1")
        monkeypatch.setenv("PYTHONPATH", f"{Path(__file__).resolve().parents[2]}{os.pathsep}{real}")
    work.mkdir()
    real.mkdir()
    show = "import sys; print(sys.path)"
    (real / "show_path.py").write_text(show + "\n")
    (work / "show_path.py").symlink_to(real / "show_path.py")
    p = Prefork([], str(tmp_path / "s")).start().wait_ready(30.0)
    try:
        for args in (["-c", show], ["-m", "show_path"], ["show_path.py"]):
            exec_out = subprocess.run([PY, *args], cwd=work, capture_output=True, text=True, check=True).stdout
            with open(tmp_path / "out.log", "wb") as out:
                assert p.spawn([PY, *args], None, str(work), out.fileno(), out.fileno()).wait() == 0
            assert (tmp_path / "out.log").read_text() == exec_out, args
    finally:
        p.close()


def _slow_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> None:
    (tmp_path / "slow_mod.py").write_text(body)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.mark.parametrize("warm_wait_s", [30.0, 0.5])
def test_a_rank_waits_for_an_importing_spawner_up_to_the_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               warm_wait_s: float) -> None:
    _slow_module(tmp_path, monkeypatch, "import time\ntime.sleep(2)\n")
    p = Prefork(["slow_mod"], str(tmp_path / "s"), warm_wait_s=warm_wait_s).start()
    try:
        assert p.importing() and not p.ready()
        t0 = time.monotonic()
        p.await_warm()
        waited = time.monotonic() - t0
        if warm_wait_s > 2:
            assert p.ready() and not p.importing(), "returned before the spawner served"
        else:  # bounded: the rank goes on as a new process while the spawner still imports
            assert p.importing() and waited < 1.5, waited
    finally:
        p.close()


def test_a_spawner_that_fails_its_imports_is_not_waited_for_and_its_restart_never(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _slow_module(tmp_path, monkeypatch, "import time\ntime.sleep(1.5)\nraise ImportError('no such thing')\n")
    p = Prefork(["slow_mod"], str(tmp_path / "s"), warm_wait_s=60.0, restart_backoff_s=0.0).start()
    try:
        t0 = time.monotonic()
        p.await_warm()
        assert not p.ready() and not p.importing() and time.monotonic() - t0 < 30
        with pytest.raises(PreforkUnavailable, match="not running"):
            p.spawn([PY, "-c", "pass"], None, None, None)  # starts it again, in the background
        deadline = time.monotonic() + 10
        while not p.importing():
            assert time.monotonic() < deadline, "the spawner was not restarted"
            time.sleep(0.01)
        t0 = time.monotonic()
        p.await_warm()  # a restarted spawner may be one that never serves: no wait
        assert time.monotonic() - t0 < 0.5 and p.importing()
    finally:
        p.close()


def test_one_failed_fork_does_not_kill_the_ranks_the_spawner_already_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fork() can fail transiently (EAGAIN: the pids cgroup or RLIMIT_NPROC, ENOMEM). The spawner lets
    the OSError out of its serve loop, whose ``finally`` SIGKILLs every rank it forked before."""
    mod = tmp_path / "failing_fork.py"
    mod.write_text(
        "import errno, os\n"
        "_real, _n = os.fork, [0]\n"
        "def _fork():\n"
        "    _n[0] += 1\n"
        "    if _n[0] == 2:\n"
        "        raise BlockingIOError(errno.EAGAIN, 'Resource temporarily unavailable')\n"
        "    return _real()\n"
        "os.fork = _fork\n"
    )
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    p = Prefork(["failing_fork"], str(tmp_path / "s")).start().wait_ready(30.0)
    try:
        with open(tmp_path / "out.log", "wb") as out:
            healthy = p.spawn([sys.executable, "-c", "import time; time.sleep(30)"], None, None,
                              out.fileno(), out.fileno())
            with pytest.raises(PreforkUnavailable):  # this one is exec'd instead: fine
                p.spawn([sys.executable, "-c", "pass"], None, None, out.fileno(), out.fileno())
        assert healthy.poll() is None
        time.sleep(0.5)
        assert healthy.poll() is None, f"a healthy forked rank died with code {healthy.returncode}"
        assert p.ready(), "the spawner died of one failed fork"
    finally:
        p.close()


def test_a_rank_reads_the_stdin_it_was_given(prefork: Prefork, tmp_path: Path) -> None:
    """The agent's failure marker is forked too, and takes its requests on stdin."""
    requests_r, requests_w = os.pipe()
    with open(tmp_path / "out.log", "wb") as out:
        proc = prefork.spawn([PY, "-c", "import sys; print(sys.stdin.readline().strip()[::-1])"], None, None,
                             out.fileno(), out.fileno(), stdin=requests_r)
    os.close(requests_r)
    with os.fdopen(requests_w, "w") as requests:
        requests.write("spawned\n")
    assert proc.wait() == 0
    assert (tmp_path / "out.log").read_text() == "denwaps\n"


def test_wait_with_a_timeout_and_terminate_follow_popen(prefork: Prefork, tmp_path: Path) -> None:
    with open(tmp_path / "out.log", "wb") as out:
        proc = prefork.spawn([PY, "-c", "import time; time.sleep(60)"], None, None, out.fileno(), out.fileno())
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.2)
    proc.terminate()
    assert proc.wait(10.0) == -15
    assert proc.poll() == -15
