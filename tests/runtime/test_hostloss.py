"""A survivor cuts its connections to lost hosts as its agent names them (unicron/runtime/hostloss.py):
``PeersLost`` cuts the lost ranks' hosts as the rank learned them at its epoch's barrier
(``Membership.hosts``), ``StoreMoved`` cuts the store's old host, and this rank's own host is never cut.
Real sockets; the members' hosts are read from a real task store."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from tests.runtime.test_sever import blocked_recv, local_address, server  # noqa: F401 (fixture)
from unicron.kernel import protocol
from unicron.kernel.net import free_port
from unicron.runtime import store as keys
from unicron.runtime.comm import TCPStore
from unicron.runtime.epoch import EpochRecord
from unicron.runtime.hostloss import HostLoss, HostLost
from unicron.runtime.membership import CommSettings, Membership
from unicron.runtime.plan import Topology


@pytest.fixture
def task_store() -> Iterator[TCPStore]:
    port = free_port()
    srv = keys.serve_store("127.0.0.1", port)
    yield keys.connect("127.0.0.1", port)
    del srv


def connected(far_host: str, srv: socket.socket) -> tuple[socket.socket, socket.socket]:
    far = socket.create_connection((far_host, srv.getsockname()[1]))
    peer, _ = srv.accept()
    return far, peer


def cuts(loss: HostLoss, msg: HostLost, blocked: threading.Thread, wait_s: float) -> bool:
    """Whether ``msg`` makes ``loss`` end the ``blocked`` call (on a connection) within ``wait_s``."""
    loss.on_message(msg)
    blocked.join(wait_s)
    return not blocked.is_alive()


def test_peers_lost_cuts_the_lost_ranks_hosts_only(server: socket.socket) -> None:  # noqa: F811
    far_host = local_address()
    hosts = {0: "10.255.255.1", 1: far_host, 2: "127.0.0.1", 4: ""}
    loss = HostLoss(0, "127.0.0.1", 0, own_address="10.255.255.1", hosts=lambda: hosts)
    far, peer = connected(far_host, server)
    try:
        th, got = blocked_recv(far)
        # rank 3 is no member the rank knows of, rank 4 published no host: nothing to cut
        assert not cuts(loss, protocol.PeersLost(membership_epoch=1, lost=[3, 4]), th, 0.3), \
            "a host was cut that no lost member was on"
        t0 = time.monotonic()
        assert cuts(loss, protocol.PeersLost(membership_epoch=2, lost=[1, 2]), th, 5.0), \
            "the call on the lost host stayed blocked"
        assert time.monotonic() - t0 < 2.0
        assert got == [b""] or isinstance(got[0], OSError)
    finally:
        far.close()
        peer.close()


def test_the_own_host_is_never_cut(server: socket.socket) -> None:  # noqa: F811
    here = local_address()
    # a lost rank said it was on this rank's own host (its own key, or a stale one)
    loss = HostLoss(0, "127.0.0.1", 0, own_address=here, hosts=lambda: {0: here, 1: here})
    far, peer = connected(here, server)
    try:
        th, _ = blocked_recv(far)
        assert not cuts(loss, protocol.PeersLost(membership_epoch=1, lost=[0, 1]), th, 0.3)
    finally:
        far.close()
        peer.close()


def test_store_moved_cuts_the_old_store_host_once(server: socket.socket) -> None:  # noqa: F811
    far_host = local_address()
    loss = HostLoss(0, far_host, 0, own_address="10.255.255.1", hosts=lambda: {})
    far, peer = connected(far_host, server)
    try:
        th, _ = blocked_recv(far)
        moved = protocol.StoreMoved(store_epoch=1, host="127.0.0.1", port=9, lost=[])
        assert cuts(loss, moved, th, 5.0), "the old store's host was not cut"
    finally:
        far.close()
        peer.close()
    again, peer = connected(far_host, server)
    try:
        th, _ = blocked_recv(again)
        assert not cuts(loss, moved, th, 0.3), "a second StoreMoved of the same epoch cut again"
    finally:
        again.close()
        peer.close()


def test_a_node_lost_with_the_store_is_cut_without_asking_any_store(server: socket.socket) -> None:  # noqa: F811
    """The store's node and another node lost in one resize: the moved store never had the other node's
    ranks (here it does not even answer), so their hosts come from the rank's epoch, learned at its
    barrier. Before, they were read from the moved store, and the survivors waited out their timeout."""
    far_host = local_address()
    loss = HostLoss(0, "10.255.255.2", 0, own_address="10.255.255.1",
                    hosts=lambda: {0: "10.255.255.1", 1: "10.255.255.2", 2: far_host})
    far, peer = connected(far_host, server)
    try:
        collective, _ = blocked_recv(far)
        assert not cuts(loss, protocol.StoreMoved(store_epoch=1, host="192.0.2.1", port=9, lost=[1, 2]), collective,
                        0.3), "a store move cut a host that only ran lost ranks"
        t0 = time.monotonic()
        assert cuts(loss, protocol.PeersLost(membership_epoch=3, lost=[1, 2]), collective, 5.0), \
            "the other lost node's host was not cut"
        assert time.monotonic() - t0 < 1.0
    finally:
        far.close()
        peer.close()


def test_a_member_learns_every_members_host_at_its_epochs_barrier(task_store: TCPStore) -> None:
    """One call for all members where each published its host; key by key where one did not."""
    address = keys.publish_host(task_store, 0, 1, "127.0.0.1", 9)  # as a rank does: its route to the store
    m = Membership(task_store, 0, Topology(world_size=1, tp=1), 1, CommSettings(regroup_timeout_s=10))
    m.start()
    assert m.hosts == {0: address} and address.startswith("127.")
    for r, host in ((0, "10.0.0.1"), (1, "10.0.0.2"), (2, "")):
        task_store.set(keys.host_key(r, 1), host)
    task_store.set(keys.host_key(3, 2), "10.0.0.4")  # rank 3's second process
    rec = EpochRecord(5, (0, 1, 2, 3), {0: 1, 1: 1, 2: 1, 3: 2})
    assert m._hosts_of(rec) == {0: "10.0.0.1", 1: "10.0.0.2", 2: "", 3: "10.0.0.4"}
    # a member that published no host (a runtime before hosts were published): the others still count
    assert m._hosts_of(EpochRecord(6, (0, 1, 3), {0: 1, 1: 1, 3: 3})) == {0: "10.0.0.1", 1: "10.0.0.2"}
