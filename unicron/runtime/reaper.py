"""Released process groups are destroyed on a thread of their own, while the rank goes on recovering.

A failed rank releases its epoch's groups so that peers blocked in a collective with it fail fast:
gloo closes its connections only in a group's destructor (:meth:`unicron.runtime.membership.Groups.release`).
That destructor also stops the group's worker threads, which took 10-30 ms on the training thread here,
between a survivor's failed collective and its regroup, on the path of every in-place recovery
(measured on the reconfigure of ``bench/transition.py``). The regroup does not need the old groups
gone: it builds the next epoch's under a fresh store prefix. So the training thread hands them to a
short thread and goes on; the destructor does not hold the GIL (torch binds its process groups with a
holder that releases it), so the two do not take turns.

The thread is not a daemon: an interpreter that exits waits for it, rather than stopping it halfway
through the destructor (a destructor that waits on a collective blocked on a peer nobody cut waits
for the collective timeout at most, as the training thread itself did before).
"""

from __future__ import annotations

import gc
import threading
import weakref

import structlog

from unicron.kernel import log as ulog
from unicron.runtime.comm import CommGroup

log = ulog.get(__name__)


def destroy(groups: list[CommGroup], logger: structlog.stdlib.BoundLogger = log) -> threading.Thread | None:
    """Drop ``groups`` on a new thread; returns it (None when there is nothing to drop).

    The caller gives up its references: the list is emptied on that thread, so the caller must hold
    no other one (its failed call's frames cleared first). A group still referenced after that (a
    cycle) is collected; one that outlives even that is logged, since its peers then wait for the
    collective timeout.
    """
    if not groups:
        return None
    refs = [weakref.ref(g) for g in groups]

    def run() -> None:
        groups.clear()  # the destructors run here when these were the last references
        if any(r() is not None for r in refs):
            gc.collect()  # slow with a big model loaded: only when reference counting was not enough
        if any(r() is not None for r in refs):
            logger.warning("a released process group is still referenced; peers may wait for the "
                           "collective timeout")

    thread = threading.Thread(target=run, name="unicron-group-reaper")
    thread.start()
    return thread
