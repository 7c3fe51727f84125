from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from unicron.kernel import procs
from unicron.kernel.procs import DEAD_STATES, pid_alive, proc_state


def test_a_running_process_is_alive_and_a_reaped_one_is_not() -> None:
    assert pid_alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not pid_alive(child.pid)


def test_a_zombie_is_not_alive() -> None:
    """An ended child its parent has not reaped yet (what a SIGKILLed agent is until its harness waits
    for it) does not run: the node's next agent must not take it for one."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while proc_state(child.pid) not in DEAD_STATES and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc_state(child.pid) == "Z"  # ended, not reaped: os.kill(pid, 0) still succeeds
    os.kill(child.pid, 0)
    assert not pid_alive(child.pid)
    child.wait()


def test_a_process_reaped_between_the_probe_and_the_state_read_is_not_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    """The signal probe found it, then it was reaped before /proc/<pid>/stat was read."""
    monkeypatch.setattr(procs, "proc_state", lambda pid: None)
    assert not procs.pid_alive(os.getpid())


def test_another_users_process_hidden_from_proc_is_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    """/proc mounted with hidepid: the probe says it exists (EPERM) and its state cannot be read."""
    def eperm(pid: int, sig: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "kill", eperm)
    monkeypatch.setattr(procs, "proc_state", lambda pid: None)
    assert procs.pid_alive(1)
