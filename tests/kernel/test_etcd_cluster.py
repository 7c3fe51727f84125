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
from unicron.kernel.etcd import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS, Store, WatchEvent


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


def test_a_watch_on_a_member_that_went_silent_moves_to_another(cluster: EtcdCluster) -> None:
    """The member a watch streams from is stopped (SIGSTOP: its connections stay open and answer
    nothing, as a member cut off by a partition does). Writes through the other members must still
    reach the watch, once the connection's keep-alive goes unanswered (10 s + 5 s): before, its stream
    waited on the silent member for as long as TCP let it (minutes), and an agent watching its
    assignments never saw another."""
    store, writer = Store(cluster.endpoint, timeout_s=1.0), Store(cluster.endpoint, timeout_s=1.0)
    silent = None
    try:
        seen: list[WatchEvent] = []
        got = threading.Event()

        def on_event(ev: WatchEvent) -> None:
            seen.append(ev)
            got.set()

        watch = store.watch_prefix("/w/", on_event, start_revision=store.revision() + 1)
        store.put("/w/0", "0")
        assert got.wait(5.0)
        silent = in_use(store, cluster)
        silent.pause()
        others = [m.endpoint for m in cluster.members if m is not silent]
        writer.close()
        writer = Store(",".join(others), timeout_s=1.0)
        retry(functools.partial(writer.put, "/w/1", "1"), timeout_s=20.0)
        deadline = time.monotonic() + KEEPALIVE_TIME_MS / 1000 + KEEPALIVE_TIMEOUT_MS / 1000 + 10.0
        while "/w/1" not in {ev.key for ev in seen} and time.monotonic() < deadline:
            got.wait(0.1)
        assert [ev.key for ev in seen] == ["/w/0", "/w/1"], seen
        watch.stop()
    finally:
        if silent is not None:
            silent.resume()
        store.close()
        writer.close()
