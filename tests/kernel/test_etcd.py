"""The etcd module against a real etcd: leases, guarded writes, watches that survive restarts."""

from __future__ import annotations

import threading
import time

import pytest

from unicron.cluster.etcd_server import EtcdServer
from unicron.kernel.errors import StoreUnavailable
from unicron.kernel.etcd import Store, WatchEvent, parse_endpoints


def _wait(pred, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


def test_parse_endpoints_rejects_garbage() -> None:
    assert parse_endpoints("127.0.0.1:1,http://h:2") == [("127.0.0.1", 1), ("h", 2)]
    with pytest.raises(ValueError, match="host:port"):
        parse_endpoints("nonsense")
    with pytest.raises(ValueError, match="no etcd endpoint"):
        parse_endpoints(" , ")


def test_put_get_prefix_and_delete(store: Store) -> None:
    store.put("/a/1", "x")
    store.put("/a/2", b"y")
    kvs, rev = store.get_prefix("/a/")
    assert [(kv.key, kv.value) for kv in kvs] == [("/a/1", b"x"), ("/a/2", b"y")]
    assert rev >= kvs[-1].mod_revision
    assert store.put_if_absent("/a/1", "z") is False
    assert store.get("/a/1").value == b"x"  # type: ignore[union-attr]
    store.delete("/a/1")
    assert store.get("/a/1") is None


def test_lease_expires_when_not_kept_alive(store: Store) -> None:
    lease = store.lease(2)
    store.put("/leased", "v", lease=lease)
    lease.stop()  # stop refreshing, as a SIGSTOPped agent would
    assert _wait(lambda: store.get("/leased") is None, timeout=6.0)


def test_lease_kept_alive_outlives_ttl(store: Store) -> None:
    lease = store.lease(2)
    store.put("/kept", "v", lease=lease)
    time.sleep(3.0)
    assert store.get("/kept") is not None
    lease.revoke()
    assert store.get("/kept") is None


def test_guarded_txn_fences_a_deposed_leader(store: Store) -> None:
    store.put("/leader", "me")
    rev = store.get("/leader").create_revision  # type: ignore[union-attr]
    assert store.guarded_txn("/leader", rev, puts={"/x": "1"})
    store.delete("/leader")
    store.put("/leader", "someone-else")
    assert not store.guarded_txn("/leader", rev, puts={"/x": "2"})
    assert store.get("/x").value == b"1"  # type: ignore[union-attr]


def test_unreachable_etcd_raises_store_unavailable() -> None:
    from unicron.kernel.net import free_port

    s = Store(f"127.0.0.1:{free_port()}", timeout_s=0.5)
    with pytest.raises(StoreUnavailable, match="etcd get"):
        s.get("/x")
    s.close()


def test_watch_resumes_after_restart_without_losing_events(etcd_server: EtcdServer) -> None:
    store = Store(etcd_server.endpoint, timeout_s=1.0)
    seen: list[WatchEvent] = []
    lock = threading.Lock()

    def on_event(ev: WatchEvent) -> None:
        with lock:
            seen.append(ev)

    watch = store.watch_prefix("/w/", on_event, start_revision=store.revision() + 1)
    store.put("/w/before", "1")
    assert _wait(lambda: len(seen) == 1)
    etcd_server.stop()
    etcd_server.start()
    # Written by another client while our watch is re-establishing: must be replayed, not lost.
    other = Store(etcd_server.endpoint)
    other.put("/w/during", "2")
    other.delete("/w/before")
    assert _wait(lambda: len(seen) == 3, timeout=15.0), seen
    with lock:
        assert [(e.kind, e.key) for e in seen] == [("put", "/w/before"), ("put", "/w/during"), ("delete", "/w/before")]
    watch.stop()
    other.close()
    store.close()


def test_lease_survives_an_etcd_outage_longer_than_its_ttl(etcd_server: EtcdServer) -> None:
    store = Store(etcd_server.endpoint, timeout_s=0.5)
    lost = threading.Event()
    lease = store.lease(2, on_lost=lost.set)
    store.put("/held", "v", lease=lease)
    etcd_server.stop()
    time.sleep(3.0)  # longer than the TTL: the client must not give the lease up on its own
    etcd_server.start()
    time.sleep(1.5)  # several keepalive rounds after the restart
    assert not lost.is_set()
    assert store.get("/held") is not None
    lease.revoke()
    store.close()
