"""The coordinator's end of the persistent agent connections (paper §4.1, node health monitoring).

Each agent keeps one TCP connection to the leader and sends a heartbeat every ``heartbeat_s``.
Two ways a node is lost, both reported through ``on_lost``:

* the connection closes: the agent process died (the kernel closes its socket at once), so the
  loss is known within milliseconds;
* heartbeats stop while the connection stays open: the agent is stopped or its host hangs. A
  single watchdog thread sleeps until the earliest heartbeat deadline (no fixed poll), so the loss
  is known ``timeout_s`` after the last heartbeat.

The etcd lease is the third, slowest path (lease expiry deletes ``nodes/<node>``); the daemon
watches it as the authority for "this node is gone" when the coordinator itself restarts.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from unicron.kernel import link, wire
from unicron.kernel.errors import InvalidRecord

log = logging.getLogger(__name__)

#: on_lost(node, reason, ts): reason is "connection closed" or "heartbeat timeout"
LostCallback = Callable[[str, str, float], None]
#: on_connected(node, ts)
ConnectedCallback = Callable[[str, float], None]


@dataclass
class _Peer:
    node: str
    conn: wire.LineSocket
    last_heartbeat: float
    lost: bool = False


class LinkServer:
    def __init__(
        self,
        host: str,
        port: int,
        timeout_s: float,
        on_lost: LostCallback,
        on_connected: ConnectedCallback | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.on_lost = on_lost
        self.on_connected = on_connected
        self._sock = socket.create_server((host, port), reuse_port=False)
        host, port = self._sock.getsockname()[:2]
        self.address = f"{host}:{port}"
        self._peers: dict[str, _Peer] = {}
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._accept_loop, name="link-accept", daemon=True),
            threading.Thread(target=self._watchdog, name="link-watchdog", daemon=True),
        ]

    def start(self) -> LinkServer:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._sock.close()
        with self._cond:
            peers = list(self._peers.values())
            self._cond.notify_all()
        for p in peers:
            p.conn.close()

    def connected_nodes(self) -> list[str]:
        with self._cond:
            return sorted(n for n, p in self._peers.items() if not p.lost)

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = self._sock.accept()
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(wire.LineSocket(sock),), daemon=True).start()

    def _hello(self, conn: wire.LineSocket) -> str | None:
        conn.sock.settimeout(5.0)
        try:
            line = conn.recv_line()
            msg = wire.decode(line) if line is not None else None
        except (OSError, InvalidRecord) as exc:
            log.warning("link: bad hello (%s); closing", exc)
            return None
        conn.sock.settimeout(None)
        try:
            hello = link.parse(msg) if msg is not None else None
        except InvalidRecord as exc:
            log.warning("link: bad hello (%s); closing", exc)
            return None
        if not isinstance(hello, link.LinkHello):
            log.warning("link: first message was not a hello: %r", msg)
            return None
        return hello.node

    def _serve(self, conn: wire.LineSocket) -> None:
        node = self._hello(conn)
        if node is None:
            conn.close()
            return
        now = time.time()
        peer = _Peer(node, conn, now)
        with self._cond:
            old = self._peers.get(node)
            self._peers[node] = peer
            self._cond.notify_all()
        if old is not None:
            old.lost = True  # replaced by a reconnect: the old socket's close is not a loss
            old.conn.close()
        with contextlib.suppress(OSError):
            conn.send(link.Welcome().to_wire())
        if self.on_connected is not None:
            self.on_connected(node, now)
        self._read_heartbeats(peer)

    def _read_heartbeats(self, peer: _Peer) -> None:
        while True:
            try:
                line = peer.conn.recv_line()
            except (OSError, InvalidRecord):
                line = None
            if line is None:
                self._lose(peer, "connection closed")
                return
            with self._cond:
                peer.last_heartbeat = time.time()
                self._cond.notify_all()

    def _lose(self, peer: _Peer, reason: str) -> None:
        with self._cond:
            if peer.lost:
                return
            peer.lost = True
            if self._peers.get(peer.node) is peer:
                del self._peers[peer.node]
        if self._stop.is_set():
            return
        ts = time.time()
        log.warning("link: node %s lost (%s)", peer.node, reason)
        self.on_lost(peer.node, reason, ts)
        peer.conn.close()

    def _watchdog(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                live = [p for p in self._peers.values() if not p.lost]
                now = time.time()
                expired = [p for p in live if now - p.last_heartbeat >= self.timeout_s]
                if not expired:
                    wait = min((p.last_heartbeat + self.timeout_s - now for p in live), default=1.0)
                    self._cond.wait(timeout=max(0.005, wait))
                    continue
            for p in expired:
                self._lose(p, "heartbeat timeout")
