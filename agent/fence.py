"""Self-fencing: a node cut off from the whole control plane kills its own ranks.

When a node's link to the coordinator and its etcd lease both go quiet (a partition), the coordinator
declares the node lost after its heartbeat timeout and relaunches the node's ranks elsewhere. The
node's own ranks do not know: before this module they ran on for the whole partition, two processes
per rank identity, the old ones free to write checkpoints to shared storage (seen: a 20 s partition
kept both for 17.5 s). The agent now kills them once it has heard from neither for ``fence_s``: since
its last lease renewal and since its link broke, whichever came later.

Either contact alone vetoes the fence: a whole-etcd outage leaves the link up (nothing was declared
lost: etcd took no writes), a coordinator failover leaves the lease renewing. Only both at once
fences: a partition, or the double fault of an etcd outage during a coordinator failover (then the
agent reports the fenced task when contact returns, and the coordinator relaunches it as a new
generation: ``Agent._fence_restored``).

A process starved of the CPU (the agent's threads all late) must not read its own silence as the
cluster's: a check that comes late by more than a few intervals judges nothing, and the fence needs
two checks in a row past ``fence_s``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from unicron.kernel import log as ulog
from unicron.kernel.errors import TemporaryError

log = ulog.get(__name__)

CHECK_INTERVAL_S = 0.25
#: a check this many intervals late was starved: it skips its judgement
LATE_CHECKS = 4


@dataclass(frozen=True)
class Contact:
    """What the agent last knew of the control plane (``time.monotonic()`` values)."""

    #: etcd's last answer granting or renewing this node's lease; None before the first registration
    lease_renewed_at: float | None
    #: since when the link to the coordinator has been down; None while it is up
    link_down_since: float | None


def cut_off_for(contact: Contact, now: float) -> float:
    """Seconds the node has heard from neither etcd nor the coordinator (0: the link is up).

    Counted from the later of the two: a whole-etcd outage ends with the leader deposed (its lease
    expired meanwhile), so the links break just as etcd comes back, before the agent's next lease
    renewal. Counting from the lease alone fenced a node there (chaos seed 83: lease silent 9.5 s,
    link down 0.3 s), killing ranks nobody had replaced."""
    if contact.link_down_since is None or contact.lease_renewed_at is None:
        return 0.0
    return max(0.0, now - max(contact.lease_renewed_at, contact.link_down_since))


class Fence:
    """Watches :class:`Contact`; calls ``kill`` once cut off for ``fence_s``, and ``restored`` when
    either contact returns: the link up, or the lease renewed since (a re-registration, the old lease
    having expired). ``restored`` raising :class:`TemporaryError` is retried at the next check."""

    def __init__(self, fence_s: float, read: Callable[[], Contact], kill: Callable[[float], None],
                 restored: Callable[[], None], stop: threading.Event) -> None:
        self.fence_s = fence_s
        self.read, self.kill, self.restored = read, kill, restored
        self.stop = stop
        self.fenced = threading.Event()
        self._over = 0  # consecutive on-time checks past fence_s
        self._fenced_at = 0.0  # when it fenced: a lease renewed after it is contact regained
        self._thread = threading.Thread(target=self._run, name="fence", daemon=True)

    def start(self) -> Fence:
        if self.fence_s > 0:
            self._thread.start()
        return self

    def _run(self) -> None:
        last = time.monotonic()
        while not self.stop.wait(CHECK_INTERVAL_S):
            now = time.monotonic()
            late = now - last > LATE_CHECKS * CHECK_INTERVAL_S
            last = now
            try:
                self.check(now, late)
            except Exception:  # a bug must not end the fence's watch for the agent's lifetime
                log.exception("fence check failed; checking again")

    def check(self, now: float, late: bool = False) -> None:
        contact = self.read()
        cut = cut_off_for(contact, now)
        if self.fenced.is_set():
            renewed = contact.lease_renewed_at is not None and contact.lease_renewed_at > self._fenced_at
            if contact.link_down_since is None or renewed:
                self._restore()
            return
        self._over = 0 if late or cut <= self.fence_s else self._over + 1
        if self._over >= 2:
            self._fenced_at = now
            self.fenced.set()
            log.error("cut off from etcd and the coordinator; killing this node's ranks (the coordinator "
                      "has declared the node lost and relaunches them elsewhere)", cut_off_s=round(cut, 2))
            self.kill(cut)

    def _restore(self) -> None:
        try:
            self.restored()
        except TemporaryError as exc:
            log.warning("contact is back but the assignment could not be read; retrying", error=str(exc))
            return
        self._over = 0
        self.fenced.clear()
        log.info("contact with the control plane restored; the node's assignment is applied again")
