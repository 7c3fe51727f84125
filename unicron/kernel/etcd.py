"""All etcd access goes through this module.

Client library: ``etcd-sdk-python`` (import ``pyetcd``), the maintained, API-compatible fork of
python-etcd3. python-etcd3 0.12.0 (last released 2020) fails to import with protobuf >= 4 and its
``lock()`` breaks under contention with tenacity 9; the fork works and was about 2x faster on
put/get here. Its ``Endpoint(time_retry=300)`` default would leave a client refusing an endpoint
for five minutes after one failed call, so we set it to ``retry_s`` (0.5 s by default).

What this module adds on top of the client:

* errors converted at the boundary, raised ``from`` the client error: failing to reach etcd is
  :class:`~unicron.kernel.errors.StoreUnavailable` (temporary; retry), a lease etcd no longer knows is
  :class:`~unicron.kernel.errors.LeaseLost`, a request etcd refuses is
  :class:`~unicron.kernel.errors.StoreRejected` and a closed client
  :class:`~unicron.kernel.errors.StoreClosed` (both permanent). Anything else (a ``TypeError`` from a
  bad argument of ours) propagates: a bug must not be retried as an outage;
* :class:`Lease`: a lease with a keep-alive thread that notices loss (expiry while we were
  stopped or partitioned) and tells its owner, who re-registers;
* :class:`PrefixWatch`: a prefix watch that survives etcd restarts. Neither Python client
  re-establishes a watch by itself (measured); we re-watch from ``last seen revision + 1``, which
  makes etcd replay every event we missed, and fall back to a full resync if that revision was
  compacted;
* :meth:`Store.guarded_txn`: writes that only apply while a guard key still has the revision we
  hold (leader fencing).
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import pyetcd
from pyetcd import etcdrpc
from pyetcd import exceptions as etcd_exc

from unicron.kernel import log as ulog
from unicron.kernel.address import host_port
from unicron.kernel.errors import (
    ConfigError,
    LeaseLost,
    StoreClosed,
    StoreRejected,
    StoreUnavailable,
    UnicronError,
)
from unicron.kernel.tls import TLSConfig

log = ulog.get(__name__)

#: "1" keeps gRPC's default reconnect backoff (1 s, x1.6 per failure, up to 120 s) instead of ours:
#: the baseline of ``bench/reconnect.py``, never a production setting.
GRPC_DEFAULT_BACKOFF_ENV = "UNICRON_ETCD_GRPC_DEFAULT_BACKOFF"
#: gRPC keep-alive on every connection to etcd: a member that stops answering without closing the
#: connection (a partition, a stopped process) is noticed within about the sum of the two, and the
#: watches streaming from it move to another member; without it a watch waited for as long as TCP
#: let it (minutes). The interval is twice etcd's default ``--grpc-keepalive-min-time`` (5 s): a
#: client pinging more often is sent away by the server ("too many pings").
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000
_KEEPALIVE_OPTIONS = [("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
                      ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
                      # gRPC stops pinging after two pings without data by default: an idle watch
                      # would be checked twice, then never again
                      ("grpc.http2.max_pings_without_data", 0),
                      # and waits 5 min between pings when no data came back: an idle stream's pings
                      # would be too far apart to notice anything
                      ("grpc.http2.min_time_between_pings_ms", KEEPALIVE_TIME_MS),
                      ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS)]

# gRPC codes under which the same request can succeed later: etcd down, restarting, electing a
# leader, or shedding load. pyetcd converts UNAVAILABLE / DEADLINE_EXCEEDED / INTERNAL to its own
# exceptions and re-raises the rest as raw ``grpc.RpcError``.
_OUTAGE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                           grpc.StatusCode.INTERNAL, grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED,
                           grpc.StatusCode.UNKNOWN})
_OUTAGE_EXCEPTIONS = (etcd_exc.ConnectionFailedError, etcd_exc.ConnectionTimeoutError,
                      etcd_exc.NoServerAvailableError, etcd_exc.InternalServerError, etcd_exc.WatchTimedOut)
# What ``close()`` and the shutdown paths swallow: any of the converted errors.
_CLIENT_ERRORS = (etcd_exc.Etcd3Exception, grpc.RpcError, ValueError)
# gRPC codes after which the client marks its endpoint failed and fails over (pyetcd's own rule)
_ENDPOINT_DOWN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL)


def connect_error(exc: BaseException) -> str:
    """gRPC's own words for why a connection failed ("Connection refused", "Handshake read failed",
    "Socket closed"), found under pyetcd's exception (it chains the RpcError); "" when there are none."""
    seen: BaseException | None = exc
    for _ in range(4):  # pyetcd wraps once; a bounded walk, not a loop on a cyclic chain
        if seen is None:
            break
        if isinstance(seen, grpc.Call):
            details = seen.details() or ""
            # "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:10.0.0.1:2379: Socket closed"
            last = details.rpartition("last error: ")[2]
            return re.sub(r"^[A-Z_]+: (ipv[46]:\S+?:\d+: )?", "", last)
        seen = seen.__cause__ or seen.__context__
    return ""


def unreachable_remedy(error: str, tls: bool) -> str:
    """What an operator should do when etcd could not be reached, from :func:`connect_error`'s text: a
    TLS client's handshake with a plaintext server, or a plaintext client sent away by a TLS server,
    read as etcd not running unless told apart."""
    if tls and "Handshake" in error:
        return "is etcd serving TLS there? point --etcd at its TLS port, or drop --tls-dir / UNICRON_TLS_DIR"
    if tls and ("handshaker" in error or "TSI_" in error):
        # gRPC's words for a handshake that failed on the certificates: ours refused by etcd (expired,
        # another CA's, its key not matching) or etcd's refused by our ca.crt; etcd is running
        return ("the TLS handshake with etcd failed: check that --tls-dir's certificate and key belong together, "
                "are issued by the CA etcd trusts (its ca.crt) and are not expired ('openssl x509 -noout -dates -in "
                "NAME.crt'), and that this machine's clock is right")
    if not tls and "Socket closed" in error:
        return "does etcd require TLS? pass --tls-dir / UNICRON_TLS_DIR"
    return "start it or pass --etcd / UNICRON_ETCD"


def _classify(what: str, exc: Exception) -> UnicronError:
    message = f"etcd {what} failed: {type(exc).__name__}: {exc}"
    if isinstance(exc, _OUTAGE_EXCEPTIONS):
        why = connect_error(exc)
        return StoreUnavailable(f"{message} ({why})" if why else message)
    if isinstance(exc, grpc.RpcError) and isinstance(exc, grpc.Call):
        code, details = exc.code(), exc.details() or ""
        message = f"etcd {what} failed: {code.name}: {details}"
        if code == grpc.StatusCode.NOT_FOUND and "lease" in details:
            return LeaseLost(message)
        # RESOURCE_EXHAUSTED is both etcd shedding load (retry) and a message over gRPC's size limit (never).
        shedding = code == grpc.StatusCode.RESOURCE_EXHAUSTED and "too many requests" in details
        return StoreUnavailable(message) if code in _OUTAGE_CODES or shedding else StoreRejected(message)
    return StoreRejected(message)  # PreconditionFailed, RevisionCompacted: etcd answered "no"


#: told of every converted etcd error (a daemon counts them in its metrics); must not raise
ErrorObserver = Callable[[UnicronError], None]


@contextlib.contextmanager
def _converted(what: str, observe: ErrorObserver | None = None) -> Iterator[None]:
    try:
        yield
    except (etcd_exc.Etcd3Exception, grpc.RpcError) as exc:
        error = _classify(what, exc)
        _tell(observe, error)
        raise error from exc
    except ValueError as exc:
        if "closed channel" not in str(exc):
            raise  # a bad argument of ours: a bug, not an outage
        error = StoreClosed(f"etcd {what} after the client was closed")
        _tell(observe, error)
        raise error from exc


def _tell(observe: ErrorObserver | None, error: UnicronError) -> None:
    if observe is None:
        return
    try:
        observe(error)
    except Exception:  # an observer's bug must not replace the etcd error the caller handles
        log.exception("etcd error observer failed")


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


@dataclass(frozen=True)
class WatchEvent:
    kind: str  # "put" | "delete"
    key: str
    value: bytes
    mod_revision: int


def _key(raw: bytes) -> str | None:
    """A key as text; None (logged) for one that is not UTF-8: no key of ours, and its decode error
    killed a watch thread and escaped ``get_prefix``."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        log.warning("skipping a key that is not UTF-8", key=repr(raw[:80]))
        return None


def parse_endpoints(spec: str | Sequence[str]) -> list[tuple[str, int]]:
    """``"127.0.0.1:2379,127.0.0.1:2381"`` (or a list of ``host:port``) -> [(host, port), ...].

    A bad spec is a :class:`ConfigError` (a setting's value, not a bug), so every entry point prints
    it as one line."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out: list[tuple[str, int]] = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        item = item.removeprefix("http://")
        endpoint = host_port(item)
        if endpoint is None:
            raise ConfigError(f"--etcd / UNICRON_ETCD: bad endpoint {item!r}: expected host:port with a port "
                              "in 1-65535, e.g. 127.0.0.1:2379")
        out.append(endpoint)
    if not out:
        raise ConfigError("--etcd / UNICRON_ETCD: no endpoint given: expected host:port[,host:port...]")
    return out


#: etcd's default ``--max-txn-ops``: a transaction with more operations is refused ("too many operations")
MAX_TXN_OPS = 128
#: etcd's default ``--max-request-bytes`` is 1.5 MiB; a write is split well below it
MAX_TXN_BYTES = 1024 * 1024


class Store:
    """A connection to an etcd cluster (one or more endpoints, with failover)."""

    def __init__(self, endpoints: str | Sequence[str], timeout_s: float = 2.0, retry_s: float = 0.5,
                 tls_config: TLSConfig | None = None) -> None:
        """With ``tls_config`` every endpoint is dialled over mutual TLS; etcd started with
        ``--client-cert-auth`` takes the certificate's CN as the etcd user (docs/api.md, etcd auth)."""
        self.endpoints = parse_endpoints(endpoints)
        self.timeout_s = timeout_s
        # gRPC's own reconnect backoff (1 s growing x1.6 to 120 s) left clients idle for 10-18 s after
        # an etcd outage of ~15 s (issue #19 item 5): cap it near our retry interval instead.
        backoff_ms = max(100, int(retry_s * 1000))
        opts = [("grpc.initial_reconnect_backoff_ms", backoff_ms), ("grpc.min_reconnect_backoff_ms", backoff_ms),
                ("grpc.max_reconnect_backoff_ms", 2 * backoff_ms)]
        if os.environ.get(GRPC_DEFAULT_BACKOFF_ENV) == "1":
            opts = []  # gRPC's own backoff: only bench/reconnect.py's baseline sets this
        opts += _KEEPALIVE_OPTIONS
        creds = tls_config.grpc_channel_credentials() if tls_config is not None else None
        eps = [pyetcd.Endpoint(h, p, secure=creds is not None, creds=creds, time_retry=retry_s, opts=opts)
               for h, p in self.endpoints]
        self._client = pyetcd.MultiEndpointEtcd3Client(endpoints=eps, timeout=timeout_s, failover=True)
        self._closed = False
        #: told of every etcd error this store, its leases and its watches meet (metrics)
        self.on_error: ErrorObserver | None = None

    def converted(self, what: str) -> contextlib.AbstractContextManager[None]:
        """Errors of the calls in the block converted (see the module doc) and told to :attr:`on_error`."""
        return _converted(what, self.on_error)

    @property
    def client(self) -> Any:
        # Checked here, not left to gRPC: a call on a closed channel can crash the process (seen:
        # a segfault after a failed call), where a shutdown race should only end the caller's loop.
        if self._closed:
            raise StoreClosed("etcd client used after close()")
        return self._client

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(*_CLIENT_ERRORS):
            self._client.close()

    # --- key/value ---------------------------------------------------------------------------

    def get(self, key: str) -> KeyValue | None:
        with self.converted(f"get {key}"):
            value, meta = self.client.get(key)
        if value is None:
            return None
        return KeyValue(key, value, meta.create_revision, meta.mod_revision, meta.lease_id)

    def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix`` and the store revision the read was taken at."""
        with self.converted(f"get prefix {prefix}"):
            resp = self.client.get_prefix_response(prefix, sort_order="ascend", sort_target="key")
        kvs = [
            KeyValue(key, kv.value, kv.create_revision, kv.mod_revision, kv.lease)
            for kv in resp.kvs if (key := _key(kv.key)) is not None
        ]
        return kvs, int(resp.header.revision)

    def put(self, key: str, value: str | bytes, lease: Lease | None = None) -> int:
        """Write ``key``; returns the new revision."""
        with self.converted(f"put {key}"):
            resp = self.client.put(key, value, lease=lease.lease_id if lease else None)
        return int(resp.header.revision)

    def delete(self, key: str) -> bool:
        with self.converted(f"delete {key}"):
            return bool(self.client.delete(key))

    def put_if_absent(self, key: str, value: str | bytes, lease: Lease | None = None) -> bool:
        with self.converted(f"create {key}"):
            return bool(self.client.put_if_not_exists(key, value, lease=lease.lease_id if lease else None))

    def delete_if_unchanged(self, key: str, mod_revision: int) -> bool:
        """Delete ``key`` iff it was last written at ``mod_revision`` (nobody replaced it since)."""
        tx = self.client.transactions
        with self.converted(f"delete {key} at revision {mod_revision}"):
            ok, _ = self.client.transaction(compare=[tx.mod(key) == mod_revision], success=[tx.delete(key)],
                                             failure=[])
        return bool(ok)

    def revision(self) -> int:
        """The store's current revision. Asked of the member's status, not read from a key range: a
        user of etcd's auth may read only its own ranges (unicron.kernel.etcdauth)."""
        client = self.client
        with self.converted("status"):
            try:
                resp = client.maintenancestub.Status(etcdrpc.StatusRequest(), self.timeout_s, metadata=client.metadata)
            except grpc.RpcError as exc:
                # what pyetcd's own calls do (its decorator): mark a dead endpoint failed for failover
                client._manage_grpc_errors(exc)
                raise
        return int(resp.header.revision)

    def compact(self, revision: int) -> None:
        """Drop the history before ``revision``: etcd keeps every revision of every key until told to.
        :class:`StoreRejected` if it was compacted already; a watch resuming from before it re-lists."""
        with self.converted(f"compact to revision {revision}"):
            self.client.compact(revision)

    def guarded_txn(
        self,
        guard_key: str,
        guard_revision: int,
        puts: Mapping[str, str | bytes] = {},
        deletes: Sequence[str] = (),
        lease: Lease | None = None,
        absent: Sequence[str] = (),
    ) -> bool:
        """Apply ``puts``/``deletes`` atomically iff ``guard_key`` still has ``create_revision == guard_revision``
        and none of the keys ``absent`` exists.

        This is etcd's election fencing: a coordinator that lost its leadership key (expired, then
        re-created by another) holds a stale revision, so none of its writes land. ``absent`` makes a
        condition read before the write hold at the write (a read, then a write, leaves a window).
        """
        tx = self.client.transactions
        compare = [tx.create(guard_key) == guard_revision, *(tx.version(k) == 0 for k in absent)]
        ops = [tx.put(k, v, lease=lease.lease_id if lease else None) for k, v in puts.items()]
        ops += [tx.delete(k) for k in deletes]
        with self.converted(f"guarded txn on {guard_key}"):
            ok, _ = self.client.transaction(compare=compare, success=ops, failure=[])
        return bool(ok)

    def put_many(self, items: Sequence[tuple[str, str | bytes, Lease | None]]) -> None:
        """Write up to ``MAX_TXN_OPS`` keys in one transaction (no guard): many small records of
        different owners in one round trip (the hollow nodes' status records, unicron.cluster.hollow)."""
        tx = self.client.transactions
        ops = [tx.put(k, v, lease=lease.lease_id if lease else None) for k, v, lease in items]
        with self.converted(f"put {len(ops)} keys"):
            self.client.transaction(compare=[], success=ops, failure=[])

    def refresh_leases(self, lease_ids: Sequence[int]) -> list[int]:
        """Keep many leases alive over one stream; returns each one's TTL (<= 0: expired). What
        :class:`Lease` does for one, for the hollow nodes of unicron.cluster.hollow."""
        client = self.client
        reqs = [etcdrpc.LeaseKeepAliveRequest(ID=lease_id) for lease_id in lease_ids]
        with self.converted(f"keepalive of {len(reqs)} leases"):
            try:
                responses = list(client.leasestub.LeaseKeepAlive(iter(reqs), self.timeout_s,
                                                                 credentials=client.call_credentials,
                                                                 metadata=client.metadata))
            except grpc.RpcError as exc:
                client._manage_grpc_errors(exc)  # as pyetcd's own calls do: fail over
                raise
        ttl = {int(r.ID): int(r.TTL) for r in responses}
        return [ttl.get(lease_id, 0) for lease_id in lease_ids]

    # --- leases and watches ------------------------------------------------------------------

    def lease(self, ttl_s: int, on_lost: Callable[[], None] | None = None) -> Lease:
        return Lease(self, ttl_s, on_lost)

    def watch_prefix(
        self,
        prefix: str,
        on_event: Callable[[WatchEvent], None],
        start_revision: int | None = None,
        on_resync: Callable[[list[KeyValue]], None] | None = None,
        known: Iterable[str] = (),
    ) -> PrefixWatch:
        """``known``: the keys the caller listed at ``start_revision - 1``; a resync (the history was
        compacted) delivers a delete for each of them, and for each key put since, that is gone."""
        return PrefixWatch(self, prefix, on_event, start_revision, on_resync, known)


class Lease:
    """An etcd lease kept alive by a background thread.

    ``on_lost`` is called (once) when etcd reports the lease expired — e.g. this process was
    stopped for longer than the TTL — so the owner can re-register under a new lease.
    """

    def __init__(self, store: Store, ttl_s: int, on_lost: Callable[[], None] | None) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.on_lost = on_lost
        with self.store.converted("lease grant"):
            self._lease = store.client.lease(ttl_s)
        self.lease_id: int = int(self._lease.id)
        #: time.monotonic() of etcd's last answer granting or renewing the lease: how long ago this
        #: process last knew the cluster could see it (the agent's fence reads it)
        self.renewed_at = time.monotonic()
        self._stop = threading.Event()
        self.lost = threading.Event()
        self._thread = threading.Thread(target=self._keepalive, name=f"lease-{self.lease_id:x}", daemon=True)
        self._thread.start()

    def _keepalive(self) -> None:
        # Only etcd's own answer (TTL <= 0: the lease expired) marks the lease lost. While etcd is
        # unreachable we keep trying: etcd renews every lease when it restarts, so an outage longer
        # than the TTL does not by itself end the lease, and giving up early made a healthy leader
        # step down (seen). Safety never rests on this guess: leader writes are fenced.
        interval = max(0.1, self.ttl_s / 4)
        while not self._stop.wait(interval):
            try:
                with self.store.converted("lease keepalive"):
                    responses = list(self.store.client.refresh_lease(self.lease_id))
            except StoreClosed:
                return  # the owner closed the store: it is shutting down
            except StoreUnavailable as exc:
                log.warning("lease keepalive failed; will retry", lease=f"{self.lease_id:x}", error=str(exc))
                continue
            except Exception:  # refused (StoreRejected) or a bug: this thread ending unseen let the lease
                # expire with nobody told (no on_lost: its owner never registered again)
                log.exception("lease keepalive refused; will retry", lease=f"{self.lease_id:x}")
                continue
            if not responses or int(responses[0].TTL) <= 0:
                self._mark_lost()
                return
            self.renewed_at = time.monotonic()

    def _mark_lost(self) -> None:
        if self.lost.is_set():
            return
        self.lost.set()
        log.warning("lease lost", lease=f"{self.lease_id:x}")
        if self.on_lost is not None:
            self.on_lost()

    def revoke(self) -> None:
        self._stop.set()
        with contextlib.suppress(StoreUnavailable, StoreClosed), self.store.converted("lease revoke"):
            self.store.client.revoke_lease(self.lease_id)

    def stop(self) -> None:
        """Stop refreshing without revoking (the lease then expires by itself)."""
        self._stop.set()


class PrefixWatch:
    """Watches a prefix and delivers events in order, resuming across etcd restarts without loss."""

    def __init__(
        self,
        store: Store,
        prefix: str,
        on_event: Callable[[WatchEvent], None],
        start_revision: int | None,
        on_resync: Callable[[list[KeyValue]], None] | None,
        known: Iterable[str] = (),
    ) -> None:
        self.store = store
        self.prefix = prefix
        self.on_event = on_event
        self.on_resync = on_resync
        #: the keys that exist as far as the owner was told; a resync finds which of them went
        self._live = set(known)
        self.next_revision = start_revision
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"watch{prefix}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)

    def _subscribe(self, deliver: Callable[[Any], None]) -> Any:
        """A watch on a stream of its own; returns that stream's watcher (close it to drop the watch).

        Not on the client's shared stream: pyetcd hands a create's answer to whichever create is
        pending on the stream, so a create that timed out in an outage and was answered once etcd
        was back bound the *next* watch's handler to the first one's prefix (chaos run: after a node
        partition an agent's injection watch got ``stores/`` events, its assignment watch
        ``inject/`` ones, and its own assignments never again). Alone on its stream, a late answer
        can only be to this watch, and a new stream is opened for every retry."""
        client = self.store.client
        kwargs: dict[str, Any] = {"range_end": pyetcd.utils.prefix_range_end(pyetcd.utils.to_bytes(self.prefix))}
        if self.next_revision is not None:
            kwargs["start_revision"] = self.next_revision
        with self.store.converted(f"watch {self.prefix}"):
            watcher = client.get_watcher()
            try:
                watcher.add_callback(self.prefix, deliver, **kwargs)
            except grpc.RpcError as exc:
                if exc.code() in _ENDPOINT_DOWN:
                    _fail_endpoint(client)
                watcher.close()
                raise
            except etcd_exc.WatchTimedOut:  # the member took the connection and never answered
                _fail_endpoint(client)
                watcher.close()
                raise
            except BaseException:
                watcher.close()
                raise
        return watcher

    def _resync(self) -> None:
        kvs, rev = self.store.get_prefix(self.prefix)
        log.warning("watch revision compacted; resynced", prefix=self.prefix, revision=rev)
        self.next_revision = rev + 1
        # deletes in the compacted history: only puts were replayed, so the owner kept what was gone
        # (the agent's stale store addresses and coordinators)
        for key in sorted(self._live - {kv.key for kv in kvs}):
            self._deliver(WatchEvent("delete", key, b"", rev))
        if self.on_resync is not None:
            self._live = {kv.key for kv in kvs}
            self.on_resync(kvs)
            return
        for kv in kvs:  # what was put while the history was compacted away, as puts
            self._deliver(WatchEvent("put", kv.key, kv.value, kv.mod_revision))

    def _run(self) -> None:
        with contextlib.suppress(StoreClosed):  # the owner closed the store under us: shutting down
            self._serve()

    def _serve(self) -> None:
        backoff = 0.05
        while not self._stop.is_set():
            inbox: queue.Queue[Any] = queue.Queue()
            live = threading.Event()
            live.set()

            def deliver(item: Any, inbox: queue.Queue[Any] = inbox, live: threading.Event = live) -> None:
                if live.is_set():  # a retired stream may still answer: nobody reads its inbox
                    inbox.put(item)

            try:
                if self.next_revision is None:  # "from now": pin now, so a re-watch resumes from it
                    self.next_revision = self.store.revision() + 1
                watcher = self._subscribe(deliver)
            except (StoreUnavailable, StoreRejected) as exc:
                live.clear()
                if isinstance(exc.__cause__, etcd_exc.RevisionCompactedError):
                    with contextlib.suppress(StoreUnavailable):
                        self._resync()
                    continue
                level = log.debug if isinstance(exc, StoreUnavailable) else log.error
                level("watch failed; retrying", prefix=self.prefix, error=str(exc), retry_s=backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 1.0)
                continue
            backoff = 0.05
            try:
                self._pump(inbox)
            finally:
                live.clear()
                with contextlib.suppress(*_CLIENT_ERRORS):
                    watcher.close()

    def _pump(self, inbox: queue.Queue[Any]) -> None:
        """Deliver events until the stream breaks, the revision was compacted, or we are stopped."""
        while not self._stop.is_set():
            try:
                item = inbox.get(timeout=0.2)
            except queue.Empty:
                continue
            if isinstance(item, etcd_exc.RevisionCompactedError):
                with contextlib.suppress(StoreUnavailable):
                    self._resync()
                return
            if isinstance(item, grpc.RpcError) and item.code() in _ENDPOINT_DOWN:
                # the stream broke with its member (its keep-alive unanswered, say): resume elsewhere
                with contextlib.suppress(StoreClosed):
                    _fail_endpoint(self.store.client)
            if isinstance(item, BaseException) or item is None:
                log.info("watch interrupted; resuming", prefix=self.prefix, cause=str(item),
                         revision=self.next_revision)
                return
            for ev in item.events:
                kind = "delete" if isinstance(ev, pyetcd.events.DeleteEvent) else "put"
                self.next_revision = int(ev.mod_revision) + 1
                key = _key(ev.key)
                if key is None:
                    continue
                self._deliver(WatchEvent(kind, key, ev.value, int(ev.mod_revision)))

    def _deliver(self, event: WatchEvent) -> None:
        if event.kind == "delete":
            self._live.discard(event.key)
        else:
            self._live.add(event.key)
        try:
            self.on_event(event)
        except Exception:  # the owner's bug: logged, and the watch goes on
            log.exception("watch handler failed", prefix=self.prefix, key=event.key)


def _fail_endpoint(client: Any) -> None:
    """Mark the member ``client`` uses failed, as the client's own calls do on an outage code: its
    next call (or watch) goes to another member, if it has one."""
    with contextlib.suppress(ValueError):  # no member in use right now
        client.endpoint_in_use.fail()


def connect_with_retry(endpoints: str, timeout_s: float, stop: threading.Event, who: str,
                       tls_config: TLSConfig | None = None) -> Store | None:
    """Connect to etcd, retrying with backoff (a daemon started before etcd waits for it), and say
    clearly what is wrong while it is down. None if ``stop`` is set first."""
    backoff = 0.2
    while not stop.is_set():
        store = Store(endpoints, timeout_s=timeout_s, tls_config=tls_config)
        try:
            store.revision()
            return store
        except StoreUnavailable as exc:
            store.close()
            # the hint from gRPC's own words: a TLS failure is not "start etcd"
            log.error("etcd unreachable; retrying", who=who, endpoints=endpoints, error=str(exc), retry_s=backoff,
                      hint=unreachable_remedy(connect_error(exc), tls_config is not None))
            stop.wait(backoff)
            backoff = min(backoff * 2, 1.0)
    return None
