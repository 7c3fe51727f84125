"""Leader election on etcd, and the fencing token every leader write carries.

A coordinator becomes leader by creating the ``leader`` key under its own lease. The key's
``create_revision`` is the fencing token: every write the leader makes is a transaction guarded by
it (:meth:`unicron.kernel.etcd.Store.guarded_txn`). If the lease expires (the leader was stopped or cut
off) and another coordinator takes over, the old leader's token no longer matches and none of its
writes land, even if it wakes up believing it still leads.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence

from unicron.kernel.errors import NotLeader, StoreUnavailable
from unicron.kernel.etcd import Lease, Store
from unicron.kernel.keyspace import Keyspace

log = logging.getLogger(__name__)


class Leadership:
    def __init__(self, store: Store, keys: Keyspace, address: str, ttl_s: int,
                 on_deposed: Callable[[], None]) -> None:
        self.store = store
        self.keys = keys
        self.address = address
        self.ttl_s = ttl_s
        self.on_deposed = on_deposed
        self.lease: Lease | None = None
        self.token: int | None = None

    def campaign(self, stop: threading.Event, poll_s: float = 0.2) -> bool:
        """Block until this coordinator leads (True) or ``stop`` is set (False)."""
        while not stop.is_set():
            try:
                lease = self.store.lease(self.ttl_s, on_lost=self._lost)
                if self.store.put_if_absent(self.keys.leader(), self.address, lease=lease):
                    kv = self.store.get(self.keys.leader())
                    if kv is not None and kv.lease == lease.lease_id:
                        self.lease, self.token = lease, kv.create_revision
                        log.info("elected leader at %s (token %d)", self.address, self.token)
                        return True
                lease.revoke()
            except StoreUnavailable as exc:
                log.warning("campaign: %s", exc)
            stop.wait(poll_s)
        return False

    def _lost(self) -> None:
        log.error("leadership lease lost: stepping down")
        self.token = None
        self.on_deposed()

    def write(self, puts: Mapping[str, str | bytes] = {}, deletes: Sequence[str] = ()) -> None:
        """A fenced write: applies only while we still hold the leader key we created."""
        if self.token is None:
            raise NotLeader("not the leader")
        if not self.store.guarded_txn(self.keys.leader(), self.token, puts=puts, deletes=deletes):
            self.token = None
            self.on_deposed()
            raise NotLeader("the leader key changed hands; this coordinator was deposed")

    def resign(self) -> None:
        if self.lease is not None:
            self.lease.revoke()
        self.token = None
