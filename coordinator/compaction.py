"""etcd history compaction, run by the leading coordinator.

etcd keeps every revision of every key until it is compacted, and the cluster rewrites each node's
status once a second. A 1,000-node run (``bench/scale.py``) filled etcd's default 2 GiB backend quota in
about two minutes; from then on etcd refuses every write (its NOSPACE alarm) until an operator
compacts, defragments and disarms it: no status, no report, no decision lands. So the leader compacts,
as kube-apiserver does: every half retention it notes the store's revision and compacts to the one it
noted ``retention_s`` ago. Nothing reads history older than that: the daemons' watches resume from
their last revision after a short outage, and one that finds it compacted re-lists
(:class:`unicron.kernel.etcd.PrefixWatch`). Freed pages are reused, so the database stops growing.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from unicron.kernel import log as ulog
from unicron.kernel.errors import PermanentError, StoreUnavailable
from unicron.kernel.etcd import Store

log = ulog.get(__name__)


class Compactor:
    """Compacts ``store`` to the revision it read ``retention_s`` ago (one :meth:`step` per call)."""

    def __init__(self, store: Store, retention_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.retention_s, self.clock = store, retention_s, clock
        self._seen: deque[tuple[float, int]] = deque()
        #: the revision compacted to last (0: none yet)
        self.compacted = 0

    def step(self) -> int | None:
        """Note the current revision; compact to the newest one noted at least ``retention_s`` ago.
        Returns the revision compacted to, or None when there was nothing new to compact."""
        now = self.clock()
        self._seen.append((now, self.store.revision()))
        due: int | None = None
        while self._seen and self._seen[0][0] <= now - self.retention_s:
            due = self._seen.popleft()[1]
        if due is None or due <= self.compacted:
            return None
        self.compacted = due  # also when etcd says it is compacted already (another leader did it)
        self.store.compact(due)
        return due


def run(compactor: Compactor, stop: threading.Event) -> None:
    """Step every half retention until ``stop``; etcd errors are logged and the next step tries again."""
    while not stop.wait(compactor.retention_s / 2):
        try:
            revision = compactor.step()
        except StoreUnavailable as exc:
            log.warning("etcd compaction skipped: etcd unavailable", error=str(exc))
            continue
        except PermanentError as exc:  # compacted already (a predecessor did it), or not permitted
            log.warning("etcd compaction refused", error=str(exc))
            continue
        if revision is not None:
            log.info("etcd history compacted", revision=revision)
