"""The process groups of this node's ranks, recorded under the run dir, so that an agent killed
without clean-up (SIGKILL, the OOM killer) kills what its ranks left running when it starts again.

``PR_SET_PDEATHSIG`` kills the process the agent started (a forked rank through its spawner), but the
kernel does not pass it on to that process's children: the python of a wrapper script (a command
``["bash", "train.sh"]``), data-loader workers. They are in the rank's process group, which the
supervisor SIGKILLs when the rank exits, but nobody does when the agent dies first: they train on as
orphans while the coordinator relaunches the task elsewhere, the same rank on two nodes. Under the
shipped systemd unit (``KillMode=mixed``) systemd SIGKILLs what is left in the unit's cgroup before
it restarts the agent; run any other way (a container, the local-cluster harness, another
supervisor), these records are what is left.

One file per group: ``<run_dir>/<node>.groups/<pgid>`` holding the leader's session, its start time
(clock ticks since the boot), the boot's id and the agent that wrote it (pid and start time), written
when the rank starts and removed once the supervisor has killed the group. A record whose agent still
runs is left alone: a second agent started by mistake under the same node name and run dir (it
refuses to start once it finds the name held) must not kill the first one's ranks. A group found at
the next start is the recorded one while every live member is in the recorded session and started no
earlier than the leader, and the leader, if it lives, has the recorded start time: the kernel reuses
no pgid while a member lives, and a group made anew under a reused pid would have to be made by a
process of the dead agent's session.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

from unicron.kernel import log as ulog
from unicron.kernel.procs import DEAD_STATES, boot_id, group_alive, group_members, proc_stat

log = ulog.get(__name__)

#: how long a starting agent waits for the orphans it SIGKILLed to be gone (their GPU memory freed)
#: before it goes on (registers, takes ranks)
ORPHAN_WAIT_S = 5.0
_POLL_S = 0.02


class RankGroups:
    """The records of one node's rank process groups (``directory``: ``<run_dir>/<node>.groups``)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._boot = boot_id()
        me = proc_stat(os.getpid())
        self._owner = f"{os.getpid()} {me.start_ticks if me is not None else 0}"

    def _path(self, pgid: int) -> str:
        return os.path.join(self.directory, str(pgid))

    def add(self, pgid: int) -> None:
        """Record the group whose leader is ``pgid`` (a rank just started). Best effort: a record that
        cannot be written costs only the clean-up after an agent's death, never the rank."""
        leader = proc_stat(pgid)
        if leader is None or leader.pgid != pgid:
            return  # gone already: the supervisor's waiter kills what it left
        tmp = self._path(pgid) + ".tmp"
        try:
            os.makedirs(self.directory, exist_ok=True)
            with open(tmp, "w") as fh:
                fh.write(f"{leader.sid} {leader.start_ticks} {self._boot} {self._owner}\n")
            os.replace(tmp, self._path(pgid))  # a torn record is never read
        except OSError as exc:
            log.warning("rank process group not recorded", pgid=pgid, error=str(exc))

    def remove(self, pgid: int) -> None:
        """Forget ``pgid``'s group (the supervisor killed it)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(pgid))

    def kill_orphans(self, wait_s: float = ORPHAN_WAIT_S) -> list[int]:
        """At the agent's start, before it registers: SIGKILL every recorded group that is still the
        recorded one (a previous agent's ranks' orphans), forget every record, and wait up to
        ``wait_s`` for the killed groups to be gone. Records of an agent that still runs are kept, and
        nothing they name is killed. Returns the pgids killed."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        killed: list[int] = []
        for name in names:
            path = os.path.join(self.directory, name)
            record = _read(path) if name.isdigit() else None
            if record is not None and self._owner_runs(record):
                log.warning("rank process groups recorded by an agent that still runs are left alone",
                            pgid=int(name), agent_pid=record[3])
                continue
            if record is not None and self._same_group(int(name), record):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(int(name), signal.SIGKILL)
                    killed.append(int(name))
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        deadline = time.monotonic() + wait_s
        left = killed
        while left and time.monotonic() < deadline:
            time.sleep(_POLL_S)
            left = [pgid for pgid in left if group_alive(pgid)]
        if killed:
            log.warning("killed the ranks' processes a dead agent left running", pgids=killed, still_alive=left)
        return killed

    def _owner_runs(self, record: tuple[int, int, str, int, int]) -> bool:
        owner = proc_stat(record[3])
        return (record[2] == self._boot and owner is not None and owner.start_ticks == record[4]
                and owner.state not in DEAD_STATES)

    def _same_group(self, pgid: int, record: tuple[int, int, str, int, int]) -> bool:
        sid, start, boot = record[:3]
        if boot != self._boot:
            return False  # before a reboot: start times count from another boot
        members = group_members(pgid)
        same = bool(members) and all(
            m.sid == sid and m.start_ticks >= start and (m.pid != pgid or m.start_ticks == start) for m in members)
        if members and not same:
            log.info("a recorded rank process group is someone else's now; left alone", pgid=pgid)
        return same


def _read(path: str) -> tuple[int, int, str, int, int] | None:
    """A record's (session, leader's start, boot id, agent's pid, agent's start); None if unreadable
    or torn: nothing it names is killed."""
    try:
        with open(path) as fh:
            sid, start, boot, owner, owner_start = fh.read().split()
        return int(sid), int(start), boot, int(owner), int(owner_start)
    except (OSError, ValueError):
        return None
