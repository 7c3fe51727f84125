"""The agent link with mutual TLS: only a node certificate may speak, and only for its own node."""

from __future__ import annotations

import shutil
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.link import LinkClient
from coordinator.link import LinkServer
from unicron.kernel import link, tls, wire

TOKENS = {"node1": "secret-1", "node2": "secret-2"}


@pytest.fixture
def server(cert_dir: Path) -> Iterator[LinkServer]:
    s = LinkServer("127.0.0.1", 0, 1.0, on_lost=lambda *a: None, verify=lambda n, t: TOKENS.get(n) == t,
                   tls_config=tls.TLSConfig.from_dir(cert_dir, "coordinator")).start()
    try:
        yield s
    finally:
        s.stop()


def hello_accepted(server: LinkServer, cfg: tls.TLSConfig | None, node: str) -> bool:
    """Connect (with ``cfg``'s certificate, or plaintext), say hello as ``node``: was it welcomed?"""
    host, _, port = server.address.rpartition(":")
    raw = socket.create_connection((host, int(port)), timeout=3.0)
    try:
        sock = cfg.client_context().wrap_socket(raw, server_hostname=host) if cfg is not None else raw
        conn = wire.LineSocket(sock)
        conn.send(link.LinkHello(node=node, token=TOKENS[node]).to_wire())
        line = conn.recv_line()
    except (OSError, ssl.SSLError):
        return False
    finally:
        raw.close()
    return line is not None and isinstance(link.parse(wire.decode(line)), link.Welcome)


def test_link_takes_only_a_node_certificate_for_its_own_node(
    server: LinkServer, cert_dir: Path, foreign_cert_dir: Path,
) -> None:
    node1 = tls.TLSConfig.from_dir(cert_dir, "node1")
    assert not hello_accepted(server, node1, "node2")  # node1's certificate cannot speak as node2
    assert not hello_accepted(server, tls.TLSConfig.from_dir(cert_dir, "operator"), "node1")
    assert not hello_accepted(server, None, "node1")  # plaintext against a TLS link
    foreign = tls.TLSConfig(cert_dir / "ca.crt", foreign_cert_dir / "node1.crt", foreign_cert_dir / "node1.key")
    assert not hello_accepted(server, foreign, "node1")
    assert server.connected_nodes() == []
    assert hello_accepted(server, node1, "node1")


def test_agent_client_connects_over_tls(server: LinkServer, cert_dir: Path) -> None:
    client = LinkClient("node2", 0.05, lambda: [server.address], TOKENS["node2"],
                        tls_config=tls.TLSConfig.from_dir(cert_dir, "node2")).start()
    try:
        assert client.connected.wait(5.0)
        time.sleep(0.3)  # heartbeats flow: the node stays connected past a few intervals
        assert server.connected_nodes() == ["node2"]
        assert server.heartbeat_ages()["node2"] < 0.3
    finally:
        client.stop(goodbye="test over")
    deadline = time.monotonic() + 3
    while server.connected_nodes() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.connected_nodes() == []


@pytest.mark.parametrize("impostor", ["node1", "operator"])
def test_agent_link_refuses_a_coordinator_that_shows_a_non_coordinator_certificate(cert_dir: Path, impostor: str) -> None:
    """The agent checked only that the server's certificate was the cluster CA's and named the dialled
    host (every leaf names loopback, a node's its own host): node1's or an operator's key could serve
    as 'the coordinator' to node2's agent, which then counted as control-plane contact (no fencing)
    and recorded the impostor as the leader. Now the agent requires a coordinator certificate."""
    impostor_server = LinkServer("127.0.0.1", 0, 5.0, on_lost=lambda *a: None, verify=lambda n, t: True,
                                 tls_config=tls.TLSConfig.from_dir(cert_dir, impostor)).start()
    client = LinkClient("node2", 0.05, lambda: [impostor_server.address], TOKENS["node2"],
                        tls_config=tls.TLSConfig.from_dir(cert_dir, "node2"))
    try:
        conn = client._connect_to(impostor_server.address)
        if conn is not None:
            conn.close()
        assert conn is None, f"node2's agent linked to a server holding the {impostor!r} certificate"
        assert impostor_server.connected_nodes() == []
    finally:
        impostor_server.stop()


def test_a_node_revoked_while_connected_is_dropped_and_refused_again(
        cert_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A link holds for weeks: revoking the node's certificate must end the one it has, not only the
    next handshake (its heartbeats would keep a lost or compromised node counted as up)."""
    monkeypatch.setattr(tls.Revocations, "STAT_INTERVAL_S", 0.0)
    d, held_by_node2 = tmp_path / "certs", tmp_path / "node2"
    shutil.copytree(cert_dir, d)
    shutil.copytree(cert_dir, held_by_node2)  # its own machine's copy: revoking moves the CA's aside
    node2 = tls.TLSConfig.from_dir(held_by_node2, "node2")
    lost: list[str] = []
    s = LinkServer("127.0.0.1", 0, 5.0, on_lost=lambda node, *a: lost.append(node),
                   verify=lambda n, t: TOKENS.get(n) == t, tls_config=tls.TLSConfig.from_dir(d, "coordinator")).start()
    client = LinkClient("node2", 0.05, lambda: [s.address], TOKENS["node2"], tls_config=node2).start()
    try:
        assert client.connected.wait(5.0)
        tls.revoke(d, "node2")
        deadline = time.monotonic() + 3
        while not lost and time.monotonic() < deadline:
            time.sleep(0.02)
        assert lost == ["node2"] and s.connected_nodes() == []
        time.sleep(0.5)  # the client dials again: refused at the handshake
        assert s.connected_nodes() == [] and not hello_accepted(s, node2, "node2")
    finally:
        client.stop()
        s.stop()
