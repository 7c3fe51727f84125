from __future__ import annotations

import os
import subprocess
import sys
import time

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
