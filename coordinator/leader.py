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

import itertools
import json
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from unicron.kernel import jsontext
from unicron.kernel import log as ulog
from unicron.kernel.errors import InvalidRecord, NotLeader, PermanentError, StoreUnavailable
from unicron.kernel.etcd import MAX_TXN_BYTES, MAX_TXN_OPS, Lease, Store
from unicron.kernel.keyspace import Keyspace

log = ulog.get(__name__)


class KeyPresent(PermanentError):
    """A fenced write required a key absent that exists: nothing was written, and this coordinator
    still leads."""

#: operations of one chunk of a wide write; its apply adds the staged key's delete and the commit's
CHUNK_OPS = MAX_TXN_OPS - 8
#: bytes of one chunk's values (its staged copy is JSON-escaped, so somewhat larger)
CHUNK_BYTES = MAX_TXN_BYTES // 2
#: how long a committed wide write waits between attempts to apply its rest while etcd is down
APPLY_RETRY_S = 0.2


@dataclass
class _Chunk:
    puts: dict[str, str] = field(default_factory=dict)
    deletes: list[str] = field(default_factory=list)
    size: int = 0

    @property
    def ops(self) -> int:
        return len(self.puts) + len(self.deletes)

    def to_json(self) -> str:
        return json.dumps({"puts": self.puts, "deletes": self.deletes}, ensure_ascii=False)

    @classmethod
    def from_json(cls, raw: bytes) -> _Chunk:
        """InvalidRecord when ``raw`` is no chunk this version wrote."""
        data = jsontext.parse(raw, "staged chunk")
        puts, deletes = (data.get("puts"), data.get("deletes")) if isinstance(data, dict) else (None, None)
        if not (isinstance(puts, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in puts.items())
                and isinstance(deletes, list) and all(isinstance(k, str) for k in deletes)):
            raise InvalidRecord("staged chunk: expected {\"puts\": {key: value}, \"deletes\": [key]}")
        return cls(puts, deletes)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _staged_bytes(text: str) -> int:
    """What ``text`` adds to a staged chunk, in bytes: etcd's limits count UTF-8 bytes, and JSON
    escapes every quote of a record (counting characters let non-ASCII chunks grow past the limit)."""
    return len(json.dumps(text, ensure_ascii=False).encode())


def _bytes(value: str | bytes) -> int:
    return len(value.encode()) if isinstance(value, str) else len(value)


def chunks(puts: Mapping[str, str | bytes], deletes: Sequence[str]) -> list[_Chunk]:
    """The operations split into chunks of at most ``CHUNK_OPS`` operations and ``CHUNK_BYTES``."""
    out = [_Chunk()]
    for key, value in [*((k, _text(v)) for k, v in puts.items()), *((k, None) for k in deletes)]:
        size = _staged_bytes(key) + (_staged_bytes(value) if value is not None else 0)
        if out[-1].ops >= CHUNK_OPS or (out[-1].ops and out[-1].size + size > CHUNK_BYTES):
            out.append(_Chunk())
        if value is None:
            out[-1].deletes.append(key)
        else:
            out[-1].puts[key] = value
        out[-1].size += size
    return out


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
        #: the lease was lost and the state may have moved on under another leader since: set until the
        #: owner reloaded it (:meth:`state_reloaded`), and no decision is written meanwhile
        self.reload_due = False
        #: leases lost so far: a reload clears ``reload_due`` only if no loss came while it ran
        self.losses = 0
        self._closed = threading.Event()
        self._txn_seq: Iterator[int] = itertools.count()
        #: wide writes reported failed whose rollback has not landed yet: (txn id, staged chunk keys)
        self._unresolved: list[tuple[str, list[str]]] = []

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
        try:
            if self.store.put_if_absent(self.keys.leader(), self.address, lease=lease):
                kv = self.store.get(self.keys.leader())
                if kv is not None and kv.lease == lease.lease_id:
                    self.lease, self.token = lease, kv.create_revision
                    log.info("elected leader", address=self.address, token=self.token)
                    return True
        except BaseException:  # the key may have been created: a lease kept alive by nobody held it for ever
            lease.revoke()
            raise
        lease.revoke()
        return False

    # --- losing the lease ---------------------------------------------------------------------

    def _lost(self) -> None:
        log.warning("leadership lease lost; campaigning again")
        self._start_regain()

    def _start_regain(self) -> None:
        with self._lock:
            self.token = None
            self.reload_due = True  # before any token of a regained lease can be read
            self.losses += 1
            if self._regaining or self.deposed or self._closed.is_set():
                return
            self._regaining = True
        threading.Thread(target=self._regain, name="leader-regain", daemon=True).start()

    def state_reloaded(self, losses: int) -> None:
        """The owner reloaded the decision state after regaining the lease: writes may go on, unless
        the lease was lost again since the reload began (``losses``: :attr:`losses` then): what it
        read may predate an interim leader's writes."""
        with self._lock:
            if self.losses == losses:
                self.reload_due = False

    @property
    def must_reload(self) -> bool:
        """Leading again after losing the lease, and the state not reloaded yet."""
        return self.reload_due and self.token is not None

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

    def write(self, puts: Mapping[str, str | bytes] = {}, deletes: Sequence[str] = (),
              absent: Sequence[str] = ()) -> None:
        """A fenced write: applies only while we still hold the leader key we created, and none of the
        keys ``absent`` exists.

        Raises :class:`NotLeader` once another coordinator leads,
        :class:`~unicron.kernel.errors.StoreUnavailable` (retry later) while our lease is lost and we
        campaign again, and :class:`KeyPresent` (nothing written, still leading) when a key of ``absent`` exists.
        """
        token = self._token()
        if self.reload_due:
            # An interim leader may have decided meanwhile: a decision taken on the state held before
            # the lease was lost would overwrite its records under our new, valid token.
            raise StoreUnavailable("leadership regained; the decision state is reloaded before anything is written")
        if self._unresolved:
            self._resolve()  # a rolled-back wide write first: its commit may have landed
        size = sum(_bytes(k) + _bytes(v) for k, v in puts.items()) + sum(_bytes(k) for k in deletes)
        if len(puts) + len(deletes) > MAX_TXN_OPS or size > MAX_TXN_BYTES:
            self._wide(token, puts, deletes, absent)
            return
        self._guarded(token, puts, deletes, absent)

    def _token(self) -> int:
        token = self.token
        if token is None:
            if self.deposed:
                raise NotLeader("this coordinator was deposed")
            raise StoreUnavailable("leadership lease lost; campaigning again")
        return token

    def _guarded(self, token: int, puts: Mapping[str, str | bytes], deletes: Sequence[str],
                 absent: Sequence[str] = ()) -> None:
        """One fenced transaction; raises NotLeader / StoreUnavailable / KeyPresent when it did not land."""
        if self.store.guarded_txn(self.keys.leader(), token, puts=puts, deletes=deletes, absent=absent):
            return
        kv = self.store.get(self.keys.leader())
        if absent and kv is not None and kv.create_revision == token:
            # our key stands, so it was a compare of ``absent`` that failed: no reason to campaign or resign
            present = [k for k in absent if self.store.get(k) is not None]
            raise KeyPresent(f"not written: {', '.join(present) or 'a key required absent'} exists")
        if kv is None:
            # Our key expired (the keepalive may not have noticed yet): nobody else leads.
            self._start_regain()
            raise StoreUnavailable("the leader key expired; campaigning again")
        self._depose(f"another coordinator holds the leader key: {kv.value!r}")
        raise NotLeader("the leader key changed hands; this coordinator was deposed")

    # --- writes wider than one etcd transaction ------------------------------------------------

    def _wide(self, token: int, puts: Mapping[str, str | bytes], deletes: Sequence[str],
              absent: Sequence[str] = ()) -> None:
        """A fenced write of more operations (or bytes) than one etcd transaction takes, still all or
        nothing for whoever leads next:

        1. stage: each chunk's operations are written as one value, ``txn/<id>/<i>``; the last
           staging transaction also writes ``txn/<id>`` (the commit record, the point of no return);
        2. apply: each chunk in one transaction that also deletes its staged copy; the last deletes
           the commit record too.

        Every step is guarded by the leader key, so a deposed leader's steps never land; the commit
        also by ``absent``, the write's point of no return. A leader that
        stops before the commit leaves staged chunks that nothing reads, and the next leader deletes
        them; one that stops after it leaves chunks that the next leader applies (:meth:`recover`)
        before it reads any state. Once committed, this call does not fail with StoreUnavailable: it
        applies the rest until it is done or deposed (NotLeader: the next leader finishes it), or until it
        finds the lease lost and regained (StoreUnavailable: the reload's recover() finishes it).
        """
        parts = chunks(puts, deletes)
        txn_id = f"{token:016x}-{next(self._txn_seq):08d}"
        staged = [self.keys.txn_chunk(txn_id, i) for i in range(len(parts))]
        try:
            for i, part in enumerate(parts):
                commits = i == len(parts) - 1
                commit = {self.keys.txn(txn_id): str(len(parts))} if commits else {}
                self._guarded(token, {staged[i]: part.to_json(), **commit}, (), absent if commits else ())
        except (StoreUnavailable, KeyPresent):
            self._discard(txn_id, staged)
            raise
        for i, part in enumerate(parts):
            last = [self.keys.txn(txn_id)] if i == len(parts) - 1 else []
            self._apply_committed(token, part.puts, [*part.deletes, staged[i], *last])

    def _apply_committed(self, token: int, puts: Mapping[str, str], deletes: Sequence[str]) -> None:
        while True:
            current = self.token
            if current is not None and current != token:
                # The lease was lost and regained meanwhile: an interim leader may have applied the rest
                # (its recover()) and written over it. The owner reloads first, and its recover()
                # applies what is still staged; chunks held here would overwrite the interim's writes.
                raise StoreUnavailable("the lease was lost while a committed wide write was applied; "
                                       "the state is reloaded, and the write's rest applied, from etcd")
            try:
                self._guarded(self._token(), puts, deletes)
                return
            except StoreUnavailable as exc:
                if self._closed.is_set():
                    raise NotLeader("stopped while applying a committed write; the next leader applies the rest") from exc
                log.warning("committed wide write waits for etcd", error=str(exc))
                self._closed.wait(APPLY_RETRY_S)

    def _discard(self, txn_id: str, staged: Sequence[str]) -> None:
        """Roll back a wide write whose staging failed, as its caller was told. Its commit record may
        have landed with only the answer lost, so it is deleted first; until that succeeds no other
        write is made (:meth:`write` retries it first), or a later recover() would apply this write
        over newer ones."""
        self._unresolved.append((txn_id, list(staged)))
        try:
            self._resolve()
        except StoreUnavailable as exc:
            log.warning("a failed wide write is rolled back before the next write", txn=txn_id, error=str(exc))

    def _resolve(self) -> None:
        while self._unresolved:
            txn_id, staged = self._unresolved[0]
            self._guarded(self._token(), {}, [self.keys.txn(txn_id)])
            for i in range(0, len(staged), CHUNK_OPS):
                self._guarded(self._token(), {}, staged[i:i + CHUNK_OPS])
            self._unresolved.pop(0)

    def recover(self) -> int:
        """Finish what a previous leader's wide write left: apply a committed one's remaining chunks,
        delete an uncommitted one's. Called by a new leader before it reads any state. Returns the
        number of chunks applied."""
        kvs, _ = self.store.get_prefix(self.keys.txns())
        by_id: dict[str, dict[str, bytes]] = {}
        for kv in kvs:
            txn_id = self.keys.tail(kv.key, self.keys.txns()).split("/", 1)[0]
            by_id.setdefault(txn_id, {})[kv.key] = kv.value
        applied = 0
        for txn_id, entries in sorted(by_id.items()):
            commit = self.keys.txn(txn_id)
            staged = sorted(k for k in entries if k != commit)
            if commit not in entries:
                log.warning("deleting an uncommitted wide write's staged chunks", txn=txn_id, chunks=len(staged))
                for i in range(0, len(staged), CHUNK_OPS):
                    self._guarded(self._token(), {}, staged[i:i + CHUNK_OPS])
                continue
            log.warning("applying the rest of a committed wide write", txn=txn_id, chunks=len(staged))
            for i, key in enumerate(staged):
                last = [commit] if i == len(staged) - 1 else []
                try:
                    part = _Chunk.from_json(entries[key])
                except InvalidRecord as exc:
                    # damaged in etcd: its part of the write is lost, the rest still lands (every leader
                    # that took over would otherwise die here, each in turn)
                    log.error("unreadable staged chunk of a committed wide write; deleting it", key=key,
                              error=str(exc), value=entries[key].decode(errors="replace")[:2000])
                    part = _Chunk({}, [])
                self._guarded(self._token(), part.puts, [*part.deletes, key, *last])
                applied += 1
            if not staged:
                self._guarded(self._token(), {}, [commit])
        return applied

    def resign(self) -> None:
        self._closed.set()
        if self.lease is not None:
            self.lease.revoke()
        self.token = None
