"""The records of the ranks' process groups (agent/rankgroups.py): what a SIGKILLed agent's ranks left
running (a wrapper script's python, which PR_SET_PDEATHSIG does not reach) is killed at the agent's
next start, and only that."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.rankgroups import RankGroups
from unicron.kernel.procs import boot_id, pid_alive, proc_stat

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable


def wait_until(pred: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.02)


def wrapper(tmp_path: Path) -> tuple[list[str], Path]:
    """bash running python, which writes its pid to the returned file (the orphan to be)."""
    pidfile = tmp_path / "child.pid"
    child = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    script = tmp_path / "train.sh"
    script.write_text(f"#!/bin/bash\n{shlex.quote(PY)} -c {shlex.quote(child)}\necho wrapper done\n")
    return ["bash", str(script)], pidfile


def read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


AGENT = """
import sys, time
from unicron.kernel import log as ulog
ulog.configure(stream=sys.stderr)
from agent.rankgroups import RankGroups
from agent.supervisor import Supervisor
sup = Supervisor(lambda e: None, groups=RankGroups(sys.argv[1]))
proc = sup.launch(0, sys.argv[2:])
print(proc.pid, flush=True)
time.sleep(60)
"""


def test_a_wrapped_rank_orphaned_by_a_sigkilled_agent_is_killed_at_the_next_start(tmp_path: Path) -> None:
    argv, pidfile = wrapper(tmp_path)
    groups = str(tmp_path / "n0.groups")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    agent = subprocess.Popen([PY, "-c", AGENT, groups, *argv], env=env, stdout=subprocess.PIPE)
    child: int | None = None
    try:
        assert agent.stdout is not None
        leader = int(agent.stdout.readline())
        wait_until(lambda: read_pid(pidfile), 30.0, "the wrapped python")
        child = read_pid(pidfile)
        assert child is not None
        agent.kill()
        agent.wait()
        wait_until(lambda: not pid_alive(leader), 10.0, "the shell's PDEATHSIG")
        assert pid_alive(child), "control: PDEATHSIG does not reach the wrapper's child"
        assert RankGroups(groups).kill_orphans() == [leader]
        assert not pid_alive(child), "the orphan survived the next start"
        assert os.listdir(groups) == []
    finally:
        if agent.poll() is None:
            agent.kill()
        if child is not None and pid_alive(child):
            os.kill(child, signal.SIGKILL)


@pytest.fixture
def stranger() -> Iterator[subprocess.Popen[bytes]]:
    """A process group that is no rank's (as if the pid had been reused since the record)."""
    p = subprocess.Popen([PY, "-c", "import time; time.sleep(60)"], process_group=0)
    try:
        wait_until(lambda: (st := proc_stat(p.pid)) is not None and st.pgid == p.pid, 10.0, "its group")
        yield p
    finally:
        p.kill()
        p.wait()


def dead_agent() -> str:
    """The owner field of a record written by an agent that has ended."""
    p = subprocess.Popen(["true"])
    p.wait()
    return f"{p.pid} 1"


def record(directory: Path, leader: int, sid: int, start: int, boot: str, owner: str) -> None:
    directory.mkdir(exist_ok=True)
    (directory / str(leader)).write_text(f"{sid} {start} {boot} {owner}\n")


@pytest.mark.parametrize("change", ["start", "session", "boot"])
def test_a_recorded_group_that_is_someone_elses_now_is_left_alone(
    tmp_path: Path, stranger: subprocess.Popen[bytes], change: str,
) -> None:
    st = proc_stat(stranger.pid)
    assert st is not None
    sid, start, boot = st.sid, st.start_ticks, boot_id()
    if change == "start":
        start -= 1  # the leader's pid names another process than the recorded one
    elif change == "session":
        sid += 1
    else:
        boot = "another-boot"
    directory = tmp_path / "n0.groups"
    record(directory, stranger.pid, sid, start, boot, dead_agent())
    (directory / "12.tmp").write_text("torn")  # a record whose write was cut short: dropped
    assert RankGroups(str(directory)).kill_orphans() == []
    assert stranger.poll() is None and pid_alive(stranger.pid)
    assert os.listdir(directory) == []


def test_the_record_of_a_dead_agents_rank_names_it(tmp_path: Path, stranger: subprocess.Popen[bytes]) -> None:
    """Control for the test above: the unchanged record kills the group."""
    st = proc_stat(stranger.pid)
    assert st is not None
    directory = tmp_path / "n0.groups"
    record(directory, stranger.pid, st.sid, st.start_ticks, boot_id(), dead_agent())
    assert RankGroups(str(directory)).kill_orphans() == [stranger.pid]
    assert stranger.wait(10) == -signal.SIGKILL


def test_the_groups_of_an_agent_that_still_runs_are_left_alone(tmp_path: Path,
                                                               stranger: subprocess.Popen[bytes]) -> None:
    """A second agent started by mistake on the same node name and run dir must not kill the first's ranks."""
    directory = tmp_path / "n0.groups"
    RankGroups(str(directory)).add(stranger.pid)  # recorded by this process, which runs on
    first = (directory / str(stranger.pid)).read_text()
    assert RankGroups(str(directory)).kill_orphans() == []
    assert stranger.poll() is None
    assert (directory / str(stranger.pid)).read_text() == first
