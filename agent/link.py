"""The agent's end of its persistent connection to the leading coordinator (paper §4.1, node health
monitoring): connect, say hello, heartbeat; reconnect when it breaks. The server is
:mod:`coordinator.link`; the messages are :mod:`unicron.kernel.link`."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable

from unicron.kernel import link, wire

log = logging.getLogger(__name__)


class LinkClient:
    """The agent's end: connect to the leader, say hello, heartbeat; reconnect when it breaks."""

    def __init__(self, node: str, heartbeat_s: float, resolve: Callable[[], str | None]) -> None:
        self.node = node
        self.heartbeat_s = heartbeat_s
        self.resolve = resolve  # returns the current leader's "host:port", or None
        self._stop = threading.Event()
        self.connected = threading.Event()
        self._thread = threading.Thread(target=self._run, name="link-client", daemon=True)

    def start(self) -> LinkClient:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)

    def _connect(self) -> wire.LineSocket | None:
        addr = self.resolve()
        if not addr:
            return None
        host, _, port = addr.rpartition(":")
        try:
            sock = socket.create_connection((host, int(port)), timeout=2.0)
        except (OSError, ValueError) as exc:
            log.info("link: cannot reach coordinator at %s: %s", addr, exc)
            return None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = wire.LineSocket(sock)
        conn.send(link.LinkHello(node=self.node).to_wire())
        return conn

    def _run(self) -> None:
        backoff = 0.05
        while not self._stop.is_set():
            conn = self._connect()
            if conn is None:
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 1.0)
                continue
            backoff = 0.05
            self.connected.set()
            try:
                while not self._stop.wait(self.heartbeat_s):
                    conn.send(link.Heartbeat().to_wire())
            except OSError as exc:
                log.warning("link to coordinator broke (%s); reconnecting", exc)
            finally:
                self.connected.clear()
                conn.close()
