"""The etcd module against a real 3-member etcd cluster (loopback ports): one client given every
endpoint fails over when the member it uses dies, or the raft leader dies; its watch and lease go on."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from unicron.cluster.etcd_server import EtcdCluster, EtcdServer
from unicron.kernel.errors import StoreUnavailable
from unicron.kernel.etcd import Store, WatchEvent


@pytest.fixture
def cluster() -> Iterator[EtcdCluster]:
    with EtcdCluster(3) as c:
        yield c


def retry(call: Callable[[], Any], timeout_s: float = 10.0) -> Any:
    """What every daemon does: an outage is retried."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return call()
        except StoreUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def in_use(store: Store, cluster: EtcdCluster) -> EtcdServer:
    """The member the client talks to now."""
    ep = store.client.endpoint_in_use
    return next(m for m in cluster.members if m.endpoint == ep.netloc)


@pytest.mark.parametrize("victim", ["member in use", "raft leader"])
def test_the_client_fails_over_and_keeps_its_watch_and_lease(cluster: EtcdCluster, victim: str) -> None:
    store = Store(cluster.endpoint, timeout_s=1.0)
    try:
        seen: list[WatchEvent] = []
        got = threading.Event()
        store.put("/w/0", "0")
        def on_event(ev: WatchEvent) -> None:
            seen.append(ev)
            got.set()

        watch = store.watch_prefix("/w/", on_event, start_revision=store.revision() + 1)
        lease = store.lease(2)
        store.put("/leased", "x", lease=lease)
        dead = in_use(store, cluster) if victim == "member in use" else cluster.leader()
        dead.kill()
        for i in range(1, 6):
            retry(functools.partial(store.put, f"/w/{i}", str(i)))
        deadline = time.monotonic() + 10
        while {ev.key for ev in seen} != {f"/w/{i}" for i in range(1, 6)} and time.monotonic() < deadline:
            got.wait(0.1)
        assert sorted(ev.key for ev in seen) == [f"/w/{i}" for i in range(1, 6)]  # none lost, none twice
        time.sleep(3.0)  # past the lease's TTL: only the keep-alive through another member keeps it
        assert not lease.lost.is_set()
        kv = retry(lambda: store.get("/leased"))
        assert kv is not None and kv.lease == lease.lease_id
        watch.stop()
        lease.revoke()
    finally:
        store.close()
