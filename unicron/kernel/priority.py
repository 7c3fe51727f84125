"""CPU priority (Linux nice values) of the agent and of the ranks it starts.

Why: where the ranks keep every core busy (six ranks importing Megatron beside two busy loops on two
cores here; data-loader workers on a GPU node), an agent at their priority waits in the run queue
between its heartbeats. Measured: up to 0.37 s of run-queue wait in one 0.1 s heartbeat interval
(``bench/RESULTS.md``, "Agent CPU priority"). Once a gap passes the coordinator's heartbeat timeout
(1 s), a healthy node is taken for lost and isolated: that happened in one test run (not instrumented,
so its cause is inferred). So the agent raises its own priority and starts the ranks at theirs: the job
keeps its share of the node against everything else, and the monitor watching it is not starved by it.

Nice values are per thread on Linux: :func:`set_own` sets every thread of the process, and a child
starts with the value of the thread that forked it. So the children the agent starts for itself (the
task's store sidecar, the failure marker) keep the agent's priority, and the warm spawner, whose
imports are rank work, is started at the ranks' (its forked ranks inherit it).
"""

from __future__ import annotations

import os

#: the range Linux accepts
LOWEST, HIGHEST = 19, -20


def current() -> int:
    """The calling thread's nice value."""
    return os.getpriority(os.PRIO_PROCESS, 0)


def set_own(nice: int) -> str | None:
    """Set every thread of this process to ``nice``. Returns why it could not (a priority above the
    current one needs root or ``CAP_SYS_NICE``), or None."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]  # no procfs: the calling thread only
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except ProcessLookupError:
            continue  # the thread ended meanwhile
        except PermissionError:
            return f"cannot set nice {nice} (now {current()}): raising a priority needs root or CAP_SYS_NICE"
    return None


def set_thread(nice: int) -> None:
    """Set the calling thread (in a freshly forked child: the whole process) to ``nice``."""
    os.setpriority(os.PRIO_PROCESS, 0, nice)
