"""The coordinator's end of the persistent agent connections (paper §4.1, node health monitoring).

Each agent keeps one TCP connection to the leader and sends a heartbeat every ``heartbeat_s``.
Two ways a node is lost, both reported through ``on_lost``:

* the connection closes: the agent process died (the kernel closes its socket at once), so the
  loss is known within milliseconds;
* heartbeats stop while the connection stays open: the agent is stopped or its host hangs, so the
  loss is known ``timeout_s`` after the last heartbeat.

A node that leaves on purpose (its agent stops: ``systemctl stop``) sends ``Goodbye`` first; that is
reported through ``on_goodbye`` and is no loss.

Who may speak for a node: a hello must carry the token of the node's current registration
(``verify``), and with TLS (``tls_config``) the connection must present a ``node`` certificate of
the cluster CA whose name is the hello's node: node A's certificate cannot speak for node B, an
operator's cannot speak for any node. Heartbeats and goodbyes belong to the hello's node, so they
cannot be sent for another one. A refused hello is closed and is nothing else: it is not a
loss, and it never replaces the node's live connection (issue 19 item 13).

The etcd lease is the third, slowest path (lease expiry deletes ``nodes/<node>``); the daemon
watches it as the authority for "this node is gone" when the coordinator itself restarts.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import select
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from unicron.kernel import link, tls, wire
from unicron.kernel import log as ulog
from unicron.kernel.errors import ConfigError, InvalidRecord

log = ulog.get(__name__)

#: on_lost(node, reason, ts): reason is "connection closed" or "heartbeat timeout"; ts (wall clock) is when
#: the node was last known alive: the close, or its last heartbeat (the silence before a timeout fired is
#: part of the detection time, paper Eq. 1)
LostCallback = Callable[[str, str, float], None]
#: on_connected(node, ts)
ConnectedCallback = Callable[[str, float], None]
#: on_goodbye(node, reason, ts): the agent said it stops on purpose
GoodbyeCallback = Callable[[str, str, float], None]
#: verify(node, token): whether ``token`` is the one of ``node``'s current registration
VerifyCallback = Callable[[str, str], bool]
#: accepting(): whether this coordinator takes links at all (it leads); a standby refuses every hello
AcceptingCallback = Callable[[], bool]
#: on_heartbeat(gap_s): seconds since the node's previous heartbeat (metrics); called on its reader thread
HeartbeatCallback = Callable[[float], None]

HELLO_TIMEOUT_S = 5.0  # a connection that says nothing this long after connecting is dropped


@dataclass(eq=False)
class _Peer:
    node: str
    conn: wire.LineSocket
    #: time.monotonic() of the last heartbeat; written by the reader thread without a lock (a float
    #: store is atomic); the watchdog only ever reads it
    last_heartbeat: float
    lost: bool = False
    #: the node's certificate (TLS), checked against the revocation list again as it sends
    cert: tls.Peer | None = None
    #: bytes read and not yet a whole line
    buf: bytearray = field(default_factory=bytearray)
    #: the reader's turn on this peer: set before it drains the socket, cleared after what it read is
    #: counted (the watchdog must not judge a heartbeat that left the socket but is not counted yet)
    reading: bool = False


#: how soon a peer past its deadline with unread bytes in its socket is looked at again
UNREAD_RECHECK_S = 0.05


def _unread(peer: _Peer) -> bool:
    """Whether ``peer``'s socket holds bytes the reader has not taken yet (poll, no read)."""
    try:
        fd = peer.conn.sock.fileno()
        if fd < 0:
            return False
        p = select.poll()
        p.register(fd, select.POLLIN)
        return any(ev & select.POLLIN for _, ev in p.poll(0))
    except (OSError, ValueError):
        return False


class LinkServer:
    def __init__(
        self,
        host: str,
        port: int,
        timeout_s: float,
        on_lost: LostCallback,
        verify: VerifyCallback,
        on_connected: ConnectedCallback | None = None,
        on_goodbye: GoodbyeCallback | None = None,
        on_heartbeat: HeartbeatCallback | None = None,
        tls_config: tls.TLSConfig | None = None,
        accepting: AcceptingCallback = lambda: True,
    ) -> None:
        self.timeout_s = timeout_s
        self.accepting = accepting
        self._tls = tls_config
        self._ssl = tls_config.server_context() if tls_config is not None else None
        self.on_heartbeat = on_heartbeat
        self.on_lost = on_lost
        self.verify = verify
        self.on_connected = on_connected
        self.on_goodbye = on_goodbye
        try:
            self._sock = socket.create_server((host, port), reuse_port=False)
        except OSError as exc:  # a port in use, an address not of this host: the settings', not a bug
            raise ConfigError(f"the agent link cannot listen on {host}:{port} ({exc.strerror or exc}); change "
                              "--listen-host / UNICRON_COORDINATOR_HOST or --link-port / UNICRON_LINK_PORT") from exc
        host, port = self._sock.getsockname()[:2]
        self.address = f"{host}:{port}"
        self._peers: dict[str, _Peer] = {}
        # The watchdog's deadlines, checked lazily: an entry may be older than its peer's last
        # heartbeat; it is then pushed again at the real deadline. Heartbeats touch no shared state
        # but their peer's timestamp, so N peers cost N pushes per timeout, not a scan per heartbeat.
        self._deadlines: list[tuple[float, int, _Peer]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        # One thread reads every connection (was: one thread per connection, 1,000 at 1,000 nodes,
        # each woken ten times a second). A connection gets a thread of its own only for its TLS
        # handshake and hello, which may block; then it joins the selector.
        self._selector = selectors.DefaultSelector()
        self._sel_lock = threading.Lock()  # registrations and closes; select() itself runs unlocked
        self._acceptor = threading.Thread(target=self._accept_loop, name="link-accept", daemon=True)
        self._threads = [
            self._acceptor,
            threading.Thread(target=self._watchdog, name="link-watchdog", daemon=True),
            threading.Thread(target=self._reader, name="link-reader", daemon=True),
        ]

    def start(self) -> LinkServer:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        wire.stop_listening(self._sock, self._acceptor)
        with self._cond:
            peers = list(self._peers.values())
            self._cond.notify_all()
        for p in peers:
            self._close(p)

    def connected_nodes(self) -> list[str]:
        with self._cond:
            return sorted(n for n, p in self._peers.items() if not p.lost)

    def heartbeat_ages(self) -> dict[str, float]:
        """Seconds since each connected node's last heartbeat (or its hello)."""
        now = time.monotonic()
        with self._cond:
            return {n: now - p.last_heartbeat for n, p in self._peers.items() if not p.lost}

    def _accept_loop(self) -> None:
        while (sock := wire.accept(self._sock, self._stop, "agent link")) is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                threading.Thread(target=self._serve, args=(sock,), daemon=True).start()
            except (OSError, RuntimeError) as exc:  # RuntimeError: no thread could be started
                # only this connection is lost (its agent retries); the acceptor goes on
                log.warning("link connection dropped before its hello", error=str(exc))
                sock.close()

    def _handshake(self, sock: socket.socket, peer_addr: str) -> tuple[socket.socket, tls.Peer | None] | None:
        """TLS on ``sock`` when configured: the wrapped socket and its verified certificate's peer, or
        None (logged, ``sock`` closed) when the handshake fails. Done on the connection's own thread:
        a slow or silent client must not hold up the accept loop."""
        if self._ssl is None:
            return sock, None
        sock.settimeout(HELLO_TIMEOUT_S)
        try:
            tsock = self._ssl.wrap_socket(sock, server_side=True)
            return tsock, self._tls.peer_of_socket(tsock) if self._tls is not None else None
        except (OSError, tls.Unauthorized) as exc:  # ssl.SSLError is an OSError
            log.warning("link TLS handshake refused; closing", peer=peer_addr, error=str(exc))
            with contextlib.suppress(OSError):
                sock.close()
            return None

    def _hello(self, conn: wire.LineSocket, peer_addr: str, cert: tls.Peer | None = None) -> link.LinkHello | None:
        """The connection's verified hello, or None (logged) when it must be closed."""
        try:
            line = conn.recv_line(deadline=time.monotonic() + HELLO_TIMEOUT_S)
            hello = link.parse(wire.decode(line)) if line is not None else None
        except (OSError, InvalidRecord) as exc:
            log.warning("link hello unreadable; closing", peer=peer_addr, error=str(exc))
            return None
        if not isinstance(hello, link.LinkHello):
            log.warning("link connection did not start with a hello; closing", peer=peer_addr,
                        got=type(hello).__name__ if hello is not None else "EOF")
            return None
        if cert is not None:
            try:
                tls.require(cert, tls.Role.NODE, "the agent link", hello.node)
            except tls.Unauthorized as exc:
                log.warning("link hello refused; closing", node=hello.node, peer=peer_addr, error=str(exc))
                return None
        if not self.accepting():
            # an agent that cannot read the leader key tries every coordinator it knows: only the
            # leader's welcome may count as contact with the control plane (agent.link.Coordinators)
            log.info("link hello refused: this coordinator does not lead; closing", node=hello.node, peer=peer_addr)
            return None
        if not self.verify(hello.node, hello.token):
            log.warning("link hello refused: its token is not the node's registration; closing",
                        node=hello.node, peer=peer_addr)
            return None
        conn.sock.settimeout(None)
        return hello

    def _serve(self, raw: socket.socket) -> None:
        try:
            peer_addr = "{}:{}".format(*raw.getpeername()[:2])
        except OSError:
            peer_addr = "?"
        secured = self._handshake(raw, peer_addr)
        if secured is None:
            return
        conn = wire.LineSocket(secured[0])
        hello = self._hello(conn, peer_addr, secured[1])
        if hello is None:
            conn.close()
            return
        peer = _Peer(hello.node, conn, time.monotonic(), cert=secured[1])
        with self._cond:
            old = self._peers.get(peer.node)
            self._peers[peer.node] = peer
            heapq.heappush(self._deadlines, (peer.last_heartbeat + self.timeout_s, next(self._seq), peer))
            self._cond.notify_all()  # the watchdog may sleep with no deadline at all
        if old is not None:
            old.lost = True  # replaced by the node's own reconnect: the old socket's close is not a loss
            self._close(old)
        log.info("link connected", node=peer.node, peer=peer_addr, replaced=old is not None)
        with contextlib.suppress(OSError):
            conn.send(link.Welcome().to_wire())
        if self.on_connected is not None:
            self.on_connected(peer.node, time.time())
        # What the hello's read took beyond its line (the agent waits for the welcome, so normally nothing):
        # read here, before the reader may see the peer. Read after its registration, it raced the reader
        # over ``peer.buf`` (a line read twice or cut; a heartbeat counted on this thread while the
        # reader's turn held the rest, and the peer lost once that turn ended: test_link failed on it).
        peer.buf += conn._buf
        conn._buf.clear()
        if peer.buf:
            self._lines(peer)
            if peer.lost:  # a goodbye, or a line too long: retired and closed already
                return
        try:
            conn.sock.setblocking(False)
            with self._sel_lock:
                if not peer.lost:
                    self._selector.register(conn.sock, selectors.EVENT_READ, peer)
        except (OSError, ValueError, KeyError):
            self._lose(peer, "connection closed")

    def _reader(self) -> None:
        while not self._stop.is_set():
            try:
                events = self._selector.select(timeout=0.5)
            except OSError:
                if self._stop.is_set():
                    return
                time.sleep(0.01)  # a socket closed under select(): try again
                continue
            for key, _ in events:
                peer = key.data
                peer.reading = True
                try:
                    self._readable(peer)
                finally:
                    peer.reading = False

    def _readable(self, peer: _Peer) -> None:
        """Read what ``peer``'s socket holds (all of it: TLS may buffer more than select() sees)."""
        try:
            while True:
                chunk = peer.conn.sock.recv(65536)
                if not chunk:
                    self._lose(peer, "connection closed")
                    return
                peer.buf += chunk
        except (BlockingIOError, ssl.SSLWantReadError):
            pass
        except OSError:
            self._lose(peer, "connection closed")
            return
        self._lines(peer)

    def _lines(self, peer: _Peer) -> None:
        if peer.cert is not None and self._tls is not None and not self._tls.still_admitted(peer.cert):
            # revoked while connected: what it sends is no heartbeat any more (its reconnect is refused)
            log.warning("link certificate revoked; closing", node=peer.node, serial=f"{peer.cert.serial:x}")
            self._lose(peer, "certificate revoked")
            return
        while not peer.lost:
            nl = peer.buf.find(b"\n")
            if nl < 0:
                if len(peer.buf) > wire.MAX_LINE:
                    log.warning("link line too long; closing", node=peer.node, limit=wire.MAX_LINE)
                    self._lose(peer, "connection closed")
                return
            line = bytes(peer.buf[:nl])
            del peer.buf[:nl + 1]
            self._message(peer, line)

    def _message(self, peer: _Peer, line: bytes) -> None:
        try:
            obj = wire.decode(line)
            if obj.get("type") == link.Heartbeat.TYPE and isinstance(obj.get("ts", 0.0), int | float):
                # the hot path (ten per node per second): no record is built for a heartbeat
                self._beat(peer)
                return
            msg = link.parse(obj)
        except InvalidRecord as exc:
            log.warning("link message dropped", node=peer.node, error=str(exc))
            return
        if isinstance(msg, link.Goodbye):
            self._goodbye(peer, msg.reason)
            return
        self._beat(peer)

    def _beat(self, peer: _Peer) -> None:
        now = time.monotonic()
        if self.on_heartbeat is not None:
            self.on_heartbeat(now - peer.last_heartbeat)
        peer.last_heartbeat = now

    def _close(self, peer: _Peer) -> None:
        with self._sel_lock:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._selector.unregister(peer.conn.sock)
            peer.conn.close()

    def _retire(self, peer: _Peer) -> bool:
        """Mark ``peer`` gone; False if it already was (lost, replaced, or said goodbye)."""
        with self._cond:
            if peer.lost:
                return False
            peer.lost = True
            if self._peers.get(peer.node) is peer:
                del self._peers[peer.node]
        return not self._stop.is_set()

    def _goodbye(self, peer: _Peer, reason: str) -> None:
        if self._retire(peer):
            log.info("node said goodbye", node=peer.node, reason=reason)
            if self.on_goodbye is not None:
                self.on_goodbye(peer.node, reason, time.time())
            else:
                self.on_lost(peer.node, f"stopped on purpose ({reason})", time.time())
        # Closed only now: the agent waits for this close, so its next steps (revoking its lease)
        # come after the coordinator has taken the goodbye.
        self._close(peer)

    def _lose(self, peer: _Peer, reason: str, silent_since: float | None = None) -> None:
        """``silent_since``: the peer's last heartbeat (monotonic), for a loss found by its silence."""
        if self._retire(peer):
            log.warning("node lost", node=peer.node, reason=reason)
            now = time.time()
            self.on_lost(peer.node, reason, now if silent_since is None else now - (time.monotonic() - silent_since))
        self._close(peer)

    def _due(self) -> list[_Peer]:
        """Pop the peers whose heartbeat deadline passed; re-push those that heartbeat since. Locked."""
        now = time.monotonic()
        expired = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, peer = heapq.heappop(self._deadlines)
            if peer.lost:
                continue
            if peer.last_heartbeat + self.timeout_s <= now and not self._behind(peer, now):
                expired.append(peer)
            else:
                # bytes waiting in the socket or in the reader's hands: the reader is behind (starved
                # while the decision loop placed a task over 500 nodes, every peer "timed out"), the
                # agent is not silent
                deadline = peer.last_heartbeat + self.timeout_s
                heapq.heappush(self._deadlines, (max(deadline, now + UNREAD_RECHECK_S), next(self._seq), peer))
        return expired

    def _behind(self, peer: _Peer, now: float) -> bool:
        """Whether the reader, not ``peer``, is late: bytes unread in its socket, or taken out of it and
        not yet counted (1,000 hollow nodes: a node was lost with 14 heartbeats read and uncounted while
        the decision loop wrote a task's placement over every node). In this order, each read after the
        last: the reader marks its turn before it drains the socket and counts the heartbeats before it
        unmarks it, so a heartbeat that left the socket after the first check is seen by the second or
        the third."""
        return _unread(peer) or peer.reading or peer.last_heartbeat + self.timeout_s > now

    def _watchdog(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                expired = self._due()
                if not expired:
                    wait = self._deadlines[0][0] - time.monotonic() if self._deadlines else None
                    self._cond.wait(timeout=max(0.001, wait) if wait is not None else None)
                    continue
            for p in expired:
                self._lose(p, "heartbeat timeout", silent_since=p.last_heartbeat)
