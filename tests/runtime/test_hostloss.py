"""A survivor cuts its connections to lost hosts as its agent names them (unicron/runtime/hostloss.py):
``PeersLost`` looks the lost processes' hosts up in the task's store (per incarnation), ``StoreMoved``
cuts the store's old host, and this rank's own host is never cut. Real sockets, a real task store."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from tests.runtime.test_sever import blocked_recv, local_address, server  # noqa: F401 (fixture)
from unicron.kernel import protocol
from unicron.kernel.net import free_port
from unicron.runtime import hostloss
from unicron.runtime import store as keys
from unicron.runtime.comm import TCPStore
from unicron.runtime.hostloss import HostLoss


@pytest.fixture
def task_store() -> Iterator[tuple[TCPStore, int]]:
    port = free_port()
    srv = keys.serve_store("127.0.0.1", port)
    yield keys.connect("127.0.0.1", port), port
    del srv


def test_peers_lost_cuts_the_lost_incarnations_hosts_only(task_store: tuple[TCPStore, int],
                                                         server: socket.socket) -> None:  # noqa: F811
    store, port = task_store
    far_host = local_address()
    store.set(keys.host_key(1, 2), far_host)  # rank 1's live process (incarnation 2) is on the far host
    store.set(keys.host_key(2, 1), "127.0.0.1")
    store.set(keys.host_key(3, 1), far_host)  # an incarnation the epoch no longer has: not looked at
    members = {0: 1, 1: 2, 2: 1, 3: 2}
    loss = HostLoss(0, "127.0.0.1", port, 0, own_address="10.255.255.1", incarnations=lambda: members)
    far = socket.create_connection((far_host, server.getsockname()[1]))
    peer, _ = server.accept()
    try:
        th, got = blocked_recv(far)
        loss.on_message(protocol.PeersLost(membership_epoch=1, lost=[3]))  # rank 3 at incarnation 2: no key
        th.join(0.3)
        assert th.is_alive(), "a host was cut that no lost process of the epoch was on"
        t0 = time.monotonic()
        loss.on_message(protocol.PeersLost(membership_epoch=2, lost=[1, 2]))
        th.join(5.0)
        assert not th.is_alive() and time.monotonic() - t0 < 2.0, "the call on the lost host stayed blocked"
        assert got == [b""] or isinstance(got[0], OSError)
    finally:
        far.close()
        peer.close()


def test_the_own_host_is_never_cut(task_store: tuple[TCPStore, int], server: socket.socket) -> None:  # noqa: F811
    store, port = task_store
    here = local_address()
    store.set(keys.host_key(1, 1), here)  # a lost rank said it was on this rank's own host
    loss = HostLoss(0, "127.0.0.1", port, 0, own_address=here, incarnations=lambda: {0: 1, 1: 1})
    far = socket.create_connection((here, server.getsockname()[1]))
    peer, _ = server.accept()
    try:
        th, _ = blocked_recv(far)
        loss.on_message(protocol.PeersLost(membership_epoch=1, lost=[1]))
        th.join(0.3)
        assert th.is_alive()
    finally:
        far.close()
        peer.close()


def test_store_moved_cuts_the_old_store_host_once_and_later_lookups_use_the_new_store(
        task_store: tuple[TCPStore, int], server: socket.socket) -> None:  # noqa: F811
    new_store, new_port = task_store
    far_host = local_address()
    loss = HostLoss(0, far_host, 1, 0, own_address="10.255.255.1", incarnations=lambda: {0: 1, 1: 1})
    far = socket.create_connection((far_host, server.getsockname()[1]))
    peer, _ = server.accept()
    try:
        th, _ = blocked_recv(far)
        loss.on_message(protocol.StoreMoved(store_epoch=1, host="127.0.0.1", port=new_port, lost=[]))
        th.join(5.0)
        assert not th.is_alive(), "the old store's host was not cut"
    finally:
        far.close()
        peer.close()
    # the lookups go to the new store now: a lost rank's host published there is found and cut
    new_store.set(keys.host_key(1, 1), far_host)
    again = socket.create_connection((far_host, server.getsockname()[1]))
    peer, _ = server.accept()
    try:
        th, _ = blocked_recv(again)
        loss.on_message(protocol.StoreMoved(store_epoch=1, host="127.0.0.1", port=new_port, lost=[]))  # told twice
        th.join(0.3)
        assert th.is_alive(), "a second StoreMoved of the same epoch cut again"
        loss.on_message(protocol.PeersLost(membership_epoch=1, lost=[1]))
        th.join(5.0)
        assert not th.is_alive(), "the lost rank's host, read from the new store, was not cut"
    finally:
        again.close()
        peer.close()


def test_an_unreachable_store_cuts_nothing_and_raises_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hostloss, "READ_TIMEOUT_S", 0.5)
    loss = HostLoss(0, "127.0.0.1", free_port(), 0, own_address="", incarnations=lambda: {0: 1, 1: 1})
    loss.on_message(protocol.PeersLost(membership_epoch=1, lost=[1]))  # logged: collectives time out instead
