from __future__ import annotations

import os
import subprocess
import sys

from unicron.kernel.procs import pid_alive


def test_a_running_process_is_alive_and_a_reaped_one_is_not() -> None:
    assert pid_alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not pid_alive(child.pid)
