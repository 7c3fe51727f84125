"""Leadership on a real etcd: one leader at a time, and a deposed leader's writes never land."""

from __future__ import annotations

import threading
import time

import pytest

from coordinator.leader import Leadership
from unicron.kernel.errors import NotLeader
from unicron.kernel.etcd import Store
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
