"""The agent's CPU priority (unicron/kernel/priority.py), in child processes: renicing the test's own
process would change every later test's children."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# threads started before and after set_own(); each thread's nice value is read by its id
CHILD = """
import os, sys, threading
from unicron.kernel import priority
if sys.argv[2] == "unprivileged" and os.geteuid() == 0:
    os.setuid(65534)
hold = threading.Event()
before = [threading.Thread(target=hold.wait) for _ in range(3)]
for t in before:
    t.start()
why = priority.set_own(int(sys.argv[1]))
after = threading.Thread(target=hold.wait)
after.start()
nices = sorted({os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir("/proc/self/task")})
hold.set()
print(nices, why is None)
"""


def run(nice: int, who: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", CHILD, str(nice), who], env=env, capture_output=True, text=True,
                         timeout=30, check=True)
    return out.stdout.strip()


def test_set_own_sets_every_thread_of_the_process_and_those_started_later() -> None:
    assert run(5, "as-is") == "[5] True"


@pytest.mark.skipif(os.geteuid() != 0, reason="raising a priority needs root")
def test_set_own_raises_the_priority_of_every_thread_as_root() -> None:
    assert run(-10, "as-is") == "[-10] True"


def test_without_the_privilege_set_own_says_why_and_leaves_the_priority() -> None:
    start = os.getpriority(os.PRIO_PROCESS, 0)
    assert run(start - 1, "unprivileged") == f"[{start}] False"
