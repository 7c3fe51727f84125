"""Processes by PID, for records that name a process (an agent's registration, a harness's namespace
network, a supervised rank): is its owner still running on this host, and is it stopped?"""

from __future__ import annotations

import os
from dataclasses import dataclass


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



@dataclass(frozen=True)
class ProcStat:
    """The fields of ``/proc/<pid>/stat`` that name a process and its group."""

    pid: int
    """The process."""
    state: str
    """The kernel's one-letter state (see :func:`proc_state`)."""
    pgid: int
    """Its process group."""
    sid: int
    """Its session."""
    start_ticks: int
    """When it started, in clock ticks since the boot: with the pid, it names one process (pids are reused)."""


def proc_stat(pid: int) -> ProcStat | None:
    """``pid``'s :class:`ProcStat`; None where there is no such process, or no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()  # after the command name, as in proc_state
        return ProcStat(pid, fields[0], int(fields[2]), int(fields[3]), int(fields[19]))
    except (OSError, IndexError, ValueError):
        return None


def started_at(pid: int) -> float | None:
    """When ``pid`` started, in wall-clock seconds (the boot's time plus its start ticks); None where
    there is no such process, or no /proc."""
    st = proc_stat(pid)
    if st is None:
        return None
    try:
        with open("/proc/stat") as fh:
            btime = next(int(line.split()[1]) for line in fh if line.startswith("btime "))
    except (OSError, StopIteration, IndexError, ValueError):
        return None
    return btime + st.start_ticks / os.sysconf("SC_CLK_TCK")


def group_members(pgid: int) -> list[ProcStat]:
    """The processes of group ``pgid`` that have not ended (zombies left out), from /proc."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    found = (proc_stat(int(name)) for name in names if name.isdigit())
    return [st for st in found if st is not None and st.pgid == pgid and st.state not in DEAD_STATES]


def group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` has a member that has not ended. Signal 0 to the group counts its
    zombies too (orphans reaped late, or never where PID 1 reaps nothing), so /proc has the last word."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if not os.path.isdir("/proc/self"):
        return True
    return bool(group_members(pgid))


def boot_id() -> str:
    """This boot's id (``/proc/sys/kernel/random/boot_id``): start times count from the boot; "" without /proc."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return ""
