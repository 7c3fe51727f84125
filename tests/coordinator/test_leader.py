"""Leadership on a real etcd: one leader at a time, and a deposed leader's writes never land."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from coordinator.leader import Leadership
from unicron.cluster.etcd_server import EtcdServer
from unicron.kernel.errors import NotLeader, StoreUnavailable
from unicron.kernel.etcd import KeyValue, Store
from unicron.kernel.keyspace import Keyspace


def test_a_deposed_leader_cannot_write(store: Store) -> None:
    keys = Keyspace("/fence")
    deposed = threading.Event()
    a = Leadership(store, keys, "a", ttl_s=2, on_deposed=deposed.set)
    assert a.campaign(threading.Event())
    a.write(puts={"/fence/x": "from a"})
    assert a.lease is not None
    a.lease.stop()  # a stops refreshing (stopped, partitioned): its lease expires
    deadline = time.monotonic() + 10
    while store.get(keys.leader()) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    b = Leadership(store, keys, "b", ttl_s=2, on_deposed=lambda: None)
    assert b.campaign(threading.Event())
    with pytest.raises(NotLeader):
        a.write(puts={"/fence/x": "from a, too late"})
    assert deposed.is_set()
    b.write(puts={"/fence/x": "from b"})
    assert store.get("/fence/x").value == b"from b"  # type: ignore[union-attr]
    b.resign()


def test_only_one_campaigner_wins(store: Store) -> None:
    keys = Keyspace("/one")
    a = Leadership(store, keys, "a", ttl_s=3, on_deposed=lambda: None)
    b = Leadership(store, keys, "b", ttl_s=3, on_deposed=lambda: None)
    assert a.campaign(threading.Event())
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    assert not b.campaign(stop, poll_s=0.05)  # b keeps waiting while a leads
    a.resign()


def _wait(pred: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_leader_campaigns_again_after_an_etcd_outage_longer_than_its_lease(
        etcd_server: EtcdServer, store: Store) -> None:
    """Issue #19 item 4: the lease lost to an outage is not a lost election; with no other
    coordinator, the leader takes the key again and keeps writing."""
    keys = Keyspace("/outage")
    deposed, back = threading.Event(), threading.Event()
    a = Leadership(store, keys, "a", ttl_s=2, on_deposed=deposed.set, on_reelected=back.set, poll_s=0.05)
    assert a.campaign(threading.Event())
    assert a.lease is not None
    first, lease_id = a.token, a.lease.lease_id
    etcd_server.stop()
    time.sleep(3.0)  # longer than the TTL
    etcd_server.start()
    # etcd renews leases on restart; whether the keepalive reconnects in time is luck, so make the
    # expiry the outage risks certain.
    other = Store(etcd_server.endpoint)
    try:
        other.client.revoke_lease(lease_id)
        _wait(back.is_set, 15.0, "the leader to campaign again")
        assert not deposed.is_set()
        assert a.token is not None and a.token != first
        assert a.must_reload
        with pytest.raises(StoreUnavailable, match="reloaded before anything is written"):
            a.write(puts={"/outage/x": "decided on the state held before"})
        a.state_reloaded(a.losses - 1)  # a reload begun before this loss: not enough
        assert a.must_reload
        a.state_reloaded(a.losses)  # what the coordinator does once it reloaded its state
        a.write(puts={"/outage/x": "still leading"})
        kv = other.get(keys.leader())
        assert kv is not None and kv.value == b"a"
    finally:
        other.close()
        a.resign()


def test_leader_steps_down_only_when_another_holds_the_key(store: Store) -> None:
    keys = Keyspace("/taken")
    deposed = threading.Event()
    a = Leadership(store, keys, "a", ttl_s=2, on_deposed=deposed.set, poll_s=0.05)
    assert a.campaign(threading.Event())
    assert a.lease is not None
    b = Leadership(store, keys, "b", ttl_s=2, on_deposed=lambda: None)
    # a's lease ends and b is quicker: b really leads, so a steps down
    a.lease.stop()
    store.client.revoke_lease(a.lease.lease_id)
    assert b.campaign(threading.Event())
    with pytest.raises(NotLeader):
        a.write(puts={"/taken/x": "from a"})
    assert deposed.is_set()
    b.resign()


class _GetFailsOnce(Store):
    """A real store whose next ``get`` of ``key`` raises as if etcd blipped (the put before it landed)."""

    def __init__(self, endpoint: str, key: str) -> None:
        super().__init__(endpoint)
        self.key = key
        self.armed = True

    def get(self, key: str) -> KeyValue | None:
        if self.armed and key == self.key:
            self.armed = False
            raise StoreUnavailable("etcd unavailable (injected: the read after the create)")
        return super().get(key)


def test_a_campaign_whose_read_back_fails_does_not_lock_out_every_leader(etcd_server: EtcdServer) -> None:
    """_try_once creates the leader key under a fresh lease, then reads it back. If that read fails
    (etcd blip), the lease is neither revoked nor stopped: its keepalive thread renews it forever, so
    the leader key it holds never expires. This coordinator (and every standby) then campaigns forever
    against a key held by a lease nobody owns."""
    keys = Keyspace("/leak")
    store = _GetFailsOnce(etcd_server.endpoint, keys.leader())
    lead = Leadership(store, keys, "a", ttl_s=1, on_deposed=lambda: None, poll_s=0.05)
    stop = threading.Event()
    timer = threading.Timer(4.0, stop.set)  # four TTLs: a lease that was let go has long expired
    timer.start()
    try:
        won = lead.campaign(stop)
        assert won, "campaign never won: the leader key is held by a leaked, still renewed lease"
    finally:
        timer.cancel()
        lead.resign()
        store.close()
