"""Processes by PID, for records that name a process (an agent's registration, a harness's namespace
network, a supervised rank): is its owner still running on this host, and is it stopped?"""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this host (signal 0 probes without delivering anything). A
    zombie does not: it has ended and only waits for its parent to reap it (an agent SIGKILLed by a
    harness that had not reaped it yet was taken for a running one, and its node's restarted agent
    refused to start)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        # it exists, owned by another user; its /proc entry may be hidden (hidepid): unreadable is alive
        return proc_state(pid) not in DEAD_STATES
    state = proc_state(pid)
    if state is None:  # reaped since the probe, unless there is no /proc to read at all
        return not os.path.isdir("/proc/self")
    return state not in DEAD_STATES


#: kernel states of a process that runs no code until something continues it (a SIGSTOP, a debugger)
STOPPED_STATES = frozenset({"T", "t"})
#: kernel states of a process that has ended and awaits (or is being) reaped
DEAD_STATES = frozenset({"Z", "X"})


def proc_state(pid: int) -> str | None:
    """The kernel's one-letter state of ``pid`` (``R``, ``S``, ``D``, ``T`` stopped, ``t`` traced,
    ``Z`` zombie, ...) from ``/proc/<pid>/stat``; None where there is no such process, or no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            # the command name, in parentheses, may itself hold spaces and parentheses: split after it
            return fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
