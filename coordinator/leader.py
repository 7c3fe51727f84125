"""Leader election on etcd, and the fencing token every leader write carries.

A coordinator becomes leader by creating the ``leader`` key under its own lease. The key's
``create_revision`` is the fencing token: every write the leader makes is a transaction guarded by
it (:meth:`unicron.kernel.etcd.Store.guarded_txn`). If the lease expires (the leader was stopped or cut
off) and another coordinator takes over, the old leader's token no longer matches and none of its
writes land, even if it wakes up believing it still leads.

Losing the lease is not losing the leadership: after an etcd outage longer than the TTL the key may
simply be gone, with nobody else leading. The leader then campaigns again (a fresh lease, a fresh
token) and steps down only when it finds another coordinator's key in place.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence

from unicron.kernel import log as ulog
from unicron.kernel.errors import NotLeader, StoreUnavailable
from unicron.kernel.etcd import Lease, Store
from unicron.kernel.keyspace import Keyspace

log = ulog.get(__name__)


class Leadership:
    def __init__(self, store: Store, keys: Keyspace, address: str, ttl_s: int,
                 on_deposed: Callable[[], None], on_reelected: Callable[[], None] = lambda: None,
                 poll_s: float = 0.2) -> None:
        self.store = store
        self.keys = keys
        self.address = address
        self.ttl_s = ttl_s
        self.on_deposed = on_deposed
        self.on_reelected = on_reelected
        self.poll_s = poll_s
        self.lease: Lease | None = None
        self.token: int | None = None
        self.deposed = False
        self._lock = threading.Lock()
        self._regaining = False
        self._closed = threading.Event()

    def campaign(self, stop: threading.Event, poll_s: float | None = None) -> bool:
        """Block until this coordinator leads (True) or ``stop`` is set (False)."""
        while not stop.is_set():
            try:
                if self._try_once():
                    return True
            except StoreUnavailable as exc:
                log.warning("campaign: etcd unavailable", error=str(exc))
            stop.wait(self.poll_s if poll_s is None else poll_s)
        return False

    def _try_once(self) -> bool:
        lease = self.store.lease(self.ttl_s, on_lost=self._lost)
        if self.store.put_if_absent(self.keys.leader(), self.address, lease=lease):
            kv = self.store.get(self.keys.leader())
            if kv is not None and kv.lease == lease.lease_id:
                self.lease, self.token = lease, kv.create_revision
                log.info("elected leader", address=self.address, token=self.token)
                return True
        lease.revoke()
        return False

    # --- losing the lease ---------------------------------------------------------------------

    def _lost(self) -> None:
        log.warning("leadership lease lost; campaigning again")
        self._start_regain()

    def _start_regain(self) -> None:
        with self._lock:
            self.token = None
            if self._regaining or self.deposed or self._closed.is_set():
                return
            self._regaining = True
        threading.Thread(target=self._regain, name="leader-regain", daemon=True).start()

    def _regain(self) -> None:
        """Campaign again until the key is ours, or another coordinator is found holding it."""
        old = self.lease
        while not self._closed.is_set():
            try:
                kv = self.store.get(self.keys.leader())
                if kv is not None and (old is None or kv.lease != old.lease_id):
                    self._depose(f"another coordinator holds the leader key: {kv.value!r}")
                    return
                if kv is None and self._try_once():
                    with self._lock:
                        self._regaining = False
                    if old is not None:
                        old.stop()
                    log.warning("leadership regained", token=self.token)
                    self.on_reelected()
                    return
            except StoreUnavailable as exc:
                log.warning("campaigning again: etcd unavailable", error=str(exc))
            self._closed.wait(self.poll_s)

    def _depose(self, why: str) -> None:
        with self._lock:
            self.token = None
            self._regaining = False
            if self.deposed:
                return
            self.deposed = True
        log.error("deposed", reason=why)
        self.on_deposed()

    # --- writes -------------------------------------------------------------------------------

    def write(self, puts: Mapping[str, str | bytes] = {}, deletes: Sequence[str] = ()) -> None:
        """A fenced write: applies only while we still hold the leader key we created.

        Raises :class:`NotLeader` once another coordinator leads, and
        :class:`~unicron.kernel.errors.StoreUnavailable` (retry later) while our lease is lost and we
        campaign again.
        """
        token = self.token
        if token is None:
            if self.deposed:
                raise NotLeader("this coordinator was deposed")
            raise StoreUnavailable("leadership lease lost; campaigning again")
        if self.store.guarded_txn(self.keys.leader(), token, puts=puts, deletes=deletes):
            return
        kv = self.store.get(self.keys.leader())
        if kv is None:
            # Our key expired (the keepalive may not have noticed yet): nobody else leads.
            self._start_regain()
            raise StoreUnavailable("the leader key expired; campaigning again")
        self._depose(f"another coordinator holds the leader key: {kv.value!r}")
        raise NotLeader("the leader key changed hands; this coordinator was deposed")

    def resign(self) -> None:
        self._closed.set()
        if self.lease is not None:
            self.lease.revoke()
        self.token = None
