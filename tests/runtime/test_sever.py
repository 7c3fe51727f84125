"""Cutting a process's TCP connections to one host (unicron/runtime/sever.py): a call blocked on one
fails at once, connections to other hosts are untouched, and loopback is never cut."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from unicron.kernel.net import route_address
from unicron.runtime.sever import sever


def local_address() -> str:
    """A non-loopback address of this host (the one a UDP socket would send from)."""
    try:
        addr = route_address("192.0.2.1", 9)  # a documentation address: only the route is looked up
    except OSError:
        addr = ""
    if not addr or addr.startswith("127."):
        pytest.skip("no non-loopback address on this host")
    return addr


@pytest.fixture
def server() -> Iterator[socket.socket]:
    srv = socket.socket()
    srv.bind(("0.0.0.0", 0))
    srv.listen()
    yield srv
    srv.close()


def blocked_recv(sock: socket.socket) -> tuple[threading.Thread, list[bytes | Exception]]:
    got: list[bytes | Exception] = []

    def run() -> None:
        try:
            got.append(sock.recv(1))
        except OSError as exc:
            got.append(exc)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, got


def test_a_call_blocked_on_a_connection_to_the_host_returns_at_once_and_others_stay(server: socket.socket) -> None:
    host = local_address()
    port = server.getsockname()[1]
    far = socket.create_connection((host, port))
    near = socket.create_connection(("127.0.0.1", port))
    accepted = [server.accept(), server.accept()]
    peers = [conn for conn, _ in accepted]
    near_peer = next(conn for conn, (_, port_) in accepted if port_ == near.getsockname()[1])
    try:
        th, got = blocked_recv(far)
        time.sleep(0.2)
        assert th.is_alive()  # blocked: the peer sends nothing
        t0 = time.monotonic()
        assert sever(host) >= 1  # far, and its accepted end (also to this host's address)
        th.join(5.0)
        assert not th.is_alive() and time.monotonic() - t0 < 2.0
        assert got == [b""] or isinstance(got[0], OSError)
        assert sever("127.0.0.1") == 0  # loopback names no other host
        near_peer.sendall(b"x")
        assert near.recv(1) == b"x"  # the loopback connection still works
    finally:
        for s in (far, near, *peers):
            s.close()


def test_an_unknown_host_cuts_nothing() -> None:
    assert sever("no-such-host.invalid") == 0


def test_only_connected_tcp_sockets_to_the_host_are_cut(server: socket.socket) -> None:
    """Each descriptor's peer is asked on a duplicate: a listener, a UDP socket aimed at the host and
    a Unix socket pair are not connections to it, and each stays usable."""
    host = local_address()
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.connect((host, 9))
    left, right = socket.socketpair()
    far = socket.create_connection((host, server.getsockname()[1]))
    accepted, _ = server.accept()
    try:
        assert sever(host) == 2  # the connection's two ends, both to this host's address
        left.sendall(b"x")
        assert right.recv(1) == b"x"
        assert udp.getpeername()[0] == host
        again = socket.create_connection((host, server.getsockname()[1]))  # the listener still accepts
        server.accept()[0].close()
        again.close()
        assert far.recv(1) == b""  # shut down: end of stream at once
    finally:
        for s in (udp, left, right, far, accepted):
            s.close()


def test_a_connect_under_way_to_the_host_is_cut() -> None:
    """A connect to the lost host still sending its SYN (a rank reaching the store or a peer there) has
    no peer to ask; it is found by its destination and cut, and the connect fails at once."""
    host = local_address()
    listener = socket.socket()
    listener.bind((host, 0))
    listener.listen(0)  # an accept queue of one: a second connection's SYN is dropped, it stays SYN_SENT
    port = listener.getsockname()[1]
    first = socket.create_connection((host, port))
    time.sleep(0.1)
    pending = socket.socket()
    got: list[str | OSError] = []

    def connect() -> None:
        try:
            pending.connect((host, port))
            got.append("connected")
        except OSError as exc:
            got.append(exc)

    th = threading.Thread(target=connect, daemon=True)
    try:
        th.start()
        time.sleep(0.3)
        assert th.is_alive(), got  # blocked in connect: the listener drops its SYN
        assert sever(host) >= 1
        th.join(2.0)
        assert not th.is_alive(), "the connect to the lost host is still blocked after the cut"
        assert isinstance(got[0], OSError), got
    finally:
        for s in (pending, first, listener):
            s.close()


def test_sockets_not_to_the_host_keep_their_blocking_mode_under_a_default_timeout() -> None:
    """A process-wide default timeout (a training script may set one) must not reach the open files the
    cut looks at: a blocking loopback socket stays blocking."""
    host = local_address()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    near = socket.create_connection(("127.0.0.1", listener.getsockname()[1]))
    accepted, _ = listener.accept()
    near.settimeout(None)
    assert os.get_blocking(near.fileno())
    old = socket.getdefaulttimeout()
    socket.setdefaulttimeout(30.0)
    try:
        sever(host)
        assert os.get_blocking(near.fileno()), "the cut made an unrelated blocking socket non-blocking"
    finally:
        socket.setdefaulttimeout(old)
        for s in (near, accepted, listener):
            s.close()
