"""The agent's LinkClient against a real LinkServer in this process.

Issue 19 item 6: a planned stop says goodbye (reported through ``on_goodbye``, never ``on_lost``);
a crash or a stop without goodbye is still a loss. Issue 19 item 13: the client proves its
registration with its token, and is not "connected" until the coordinator welcomed it.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from agent.link import Coordinators, LinkClient
from coordinator.link import LinkServer
from unicron.kernel.errors import StoreRejected, StoreUnavailable
from unicron.kernel.net import free_port

TIMEOUT_S = 0.5
HEARTBEAT_S = 0.05


class Events:
    def __init__(self) -> None:
        self.lost: list[tuple[str, str]] = []
        self.goodbyes: list[tuple[str, str]] = []
        self.connected: list[str] = []
        self.changed = threading.Condition()

    def on_lost(self, node: str, reason: str, ts: float) -> None:
        with self.changed:
            self.lost.append((node, reason))
            self.changed.notify_all()

    def on_goodbye(self, node: str, reason: str, ts: float) -> None:
        with self.changed:
            self.goodbyes.append((node, reason))
            self.changed.notify_all()

    def on_connected(self, node: str, ts: float) -> None:
        with self.changed:
            self.connected.append(node)
            self.changed.notify_all()

    def wait(self, what: str, pred: object, timeout_s: float = 3.0) -> None:
        with self.changed:
            assert self.changed.wait_for(pred, timeout=timeout_s), f"timed out waiting for {what}: {vars(self)}"  # type: ignore[arg-type]


@pytest.fixture
def events() -> Events:
    return Events()


@pytest.fixture
def server(events: Events) -> Iterator[LinkServer]:
    s = LinkServer("127.0.0.1", 0, TIMEOUT_S, on_lost=events.on_lost, on_connected=events.on_connected,
                   on_goodbye=events.on_goodbye, verify=lambda node, token: token == f"token-of-{node}").start()
    try:
        yield s
    finally:
        s.stop()


def client(server: LinkServer, node: str, token: str) -> LinkClient:
    return LinkClient(node, HEARTBEAT_S, lambda: [server.address], token=token).start()


def test_goodbye_on_a_planned_stop_is_not_a_loss(server: LinkServer, events: Events) -> None:
    c = client(server, "node1", "token-of-node1")
    assert c.connected.wait(3.0)
    time.sleep(TIMEOUT_S * 2)  # heartbeats keep it alive past the timeout
    assert events.lost == []
    c.stop(goodbye="agent stopping")
    # stop() returns once the coordinator has taken the goodbye: the agent may revoke its lease next.
    assert events.goodbyes == [("node1", "agent stopping")]
    time.sleep(TIMEOUT_S * 2)
    assert events.lost == []
    assert server.connected_nodes() == []


def test_stop_without_goodbye_is_a_loss(server: LinkServer, events: Events) -> None:
    c = client(server, "node1", "token-of-node1")
    assert c.connected.wait(3.0)
    c.stop()
    events.wait("the loss", lambda: events.lost == [("node1", "connection closed")])
    assert events.goodbyes == []


def test_refused_hello_never_connects_and_loses_nothing(server: LinkServer, events: Events) -> None:
    c = client(server, "node1", "wrong")
    try:
        assert not c.connected.wait(TIMEOUT_S * 2)
    finally:
        c.stop(goodbye="agent stopping")  # nothing to say goodbye on: must return promptly
    assert events.lost == [] and events.goodbyes == [] and events.connected == []


def test_client_reconnects_after_the_server_drops_it(server: LinkServer, events: Events) -> None:
    c = client(server, "node2", "token-of-node2")
    try:
        assert c.connected.wait(3.0)
        events.wait("the first connection", lambda: events.connected == ["node2"])
        with server._cond:  # the coordinator side closes the connection (e.g. a network reset)
            peer = server._peers["node2"]
        # a reset: the socket reads EOF (closing it would only drop it from the server's selector)
        peer.conn.sock.shutdown(socket.SHUT_RDWR)
        events.wait("the reconnection", lambda: events.connected == ["node2", "node2"])
        assert events.lost == [("node2", "connection closed")]
        assert server.connected_nodes() == ["node2"]
    finally:
        c.stop(goodbye="done")
    assert events.goodbyes == [("node2", "done")]


def test_each_heartbeat_reports_the_real_interval_since_the_previous_one(server: LinkServer, events: Events) -> None:
    """What ``unicron_agent_heartbeat_interval_seconds`` observes: a late send shows as a long interval
    (here the agent's own thread is held up once, as a starved agent's would be)."""
    seen: list[float] = []
    done = threading.Event()

    def on_sent(interval_s: float) -> None:
        seen.append(interval_s)
        if len(seen) == 3:
            time.sleep(0.3)
        if len(seen) == 6:
            done.set()

    c = LinkClient("node1", HEARTBEAT_S, lambda: [server.address], token="token-of-node1", on_sent=on_sent).start()
    try:
        assert done.wait(5.0)
    finally:
        c.stop(goodbye="test over")
    assert all(s >= HEARTBEAT_S * 0.9 for s in seen), seen
    assert seen[3] >= 0.3 + HEARTBEAT_S * 0.9, seen  # the held-up one


def test_without_etcd_the_client_tries_every_announced_coordinator_and_links_only_to_the_leader(
        events: Events) -> None:
    """The double fault of chaos seed 97: the leader died (the link broke with it), a standby took
    over, and etcd went down before the agent read the new leader key. The agent tries the coordinators
    it saw announced: the dead one, and a standby that does not lead refuse or do not answer; the one that
    leads welcomes it. Before, the agent had no address without etcd and fenced its ranks."""
    others = Events()
    standby = LinkServer("127.0.0.1", 0, TIMEOUT_S, on_lost=others.on_lost, on_connected=others.on_connected,
                         verify=lambda node, token: True, accepting=lambda: False).start()
    leader = LinkServer("127.0.0.1", 0, TIMEOUT_S, on_lost=events.on_lost, on_connected=events.on_connected,
                        verify=lambda node, token: token == f"token-of-{node}").start()
    etcd_up = True
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there

    def read_leader() -> str | None:
        if not etcd_up:
            raise StoreUnavailable("etcd: no endpoint answers")
        return dead  # the killed leader's key, not yet expired

    coordinators = Coordinators(read_leader)
    for address in (dead, standby.address, leader.address):
        coordinators.announced(f"/unicron/coordinators/{address}", address)
    assert coordinators.candidates() == [dead]  # etcd answers: the leader key alone
    etcd_up = False
    assert coordinators.candidates()[0] == dead  # the last leader first, then every other one
    assert sorted(coordinators.candidates()) == sorted([dead, standby.address, leader.address])
    c = LinkClient("node1", HEARTBEAT_S, coordinators.candidates, token="token-of-node1",
                   superseded=coordinators.superseded, on_linked=coordinators.linked).start()
    try:
        assert c.connected.wait(5.0)
        events.wait("the leader's welcome", lambda: events.connected == ["node1"])
        assert others.connected == [] and standby.connected_nodes() == []
        # the leader it found is not the one the key last named: still no reason to leave it
        time.sleep(HEARTBEAT_S * 6)
        assert events.connected == ["node1"] and events.lost == []
    finally:
        c.stop(goodbye="done")
        standby.stop()
        leader.stop()
    coordinators.announced(f"/unicron/coordinators/{standby.address}", None)  # its clean stop withdrew it
    assert standby.address not in coordinators.candidates()


def test_a_new_leader_takes_the_link_from_one_that_stopped_without_dying(server: LinkServer, events: Events) -> None:
    """A leader SIGSTOPped (or on a hung host) keeps its links up: its kernel acknowledges every
    heartbeat, so no send fails. Here it is a live server that keeps taking them. Once the leader key's
    watch names another coordinator, the agent closes the old link and makes one to the new leader;
    before, it heartbeated the old one for as long as it stayed stopped."""
    others = Events()
    successor = LinkServer("127.0.0.1", 0, TIMEOUT_S, on_lost=others.on_lost, on_connected=others.on_connected,
                           verify=lambda node, token: token == f"token-of-{node}").start()
    leader = server.address
    coordinators = Coordinators(lambda: leader)
    c = LinkClient("node1", HEARTBEAT_S, coordinators.candidates, token="token-of-node1",
                   superseded=coordinators.superseded).start()
    try:
        events.wait("the first leader's welcome", lambda: events.connected == ["node1"])
        coordinators.elected(server.address)  # the watch sees the key it linked by: nothing to do
        time.sleep(HEARTBEAT_S * 4)
        assert server.connected_nodes() == ["node1"] and others.connected == []
        leader = successor.address
        coordinators.elected(successor.address)
        others.wait("the successor's welcome", lambda: others.connected == ["node1"])
        assert c.connected.wait(1.0)
        events.wait("the old link closed", lambda: events.lost == [("node1", "connection closed")])
        coordinators.elected(None)  # the key gone (the successor's lease lapsed): the link stays
        time.sleep(HEARTBEAT_S * 4)
        assert successor.connected_nodes() == ["node1"] and others.lost == []
    finally:
        c.stop(goodbye="done")
        successor.stop()


def test_one_rejected_leader_read_does_not_end_the_link_for_good(server: LinkServer) -> None:
    """etcd can answer a read with a non-outage error (StoreRejected: PERMISSION_DENIED, a
    RESOURCE_EXHAUSTED other than "too many requests", ...). Coordinators.candidates lets it out and the
    link thread dies: the node never links to any coordinator again (its fence then sees the link down
    for the agent's whole life)."""
    calls = [0]

    def read_leader() -> str | None:
        calls[0] += 1
        if calls[0] == 1:
            raise StoreRejected("etcd get leader failed: PERMISSION_DENIED: etcdserver: permission denied")
        return server.address

    c = LinkClient("node1", 0.05, Coordinators(read_leader).candidates, token="token-of-node1").start()
    try:
        assert c.connected.wait(3.0), \
            f"never linked (leader read {calls[0]} time(s); link thread alive: {c._thread.is_alive()})"
    finally:
        c.stop()
