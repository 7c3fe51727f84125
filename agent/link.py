"""The agent's end of its persistent connection to the leading coordinator (paper §4.1, node health
monitoring): find the leader (:class:`Coordinators`), connect, say hello with the registration's token,
heartbeat; reconnect when it breaks; say goodbye when the agent stops on purpose. The server is
:mod:`coordinator.link`; the messages are :mod:`unicron.kernel.link`."""

from __future__ import annotations

import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence

from unicron.kernel import link, tls, wire
from unicron.kernel import log as ulog
from unicron.kernel.errors import InvalidRecord, StoreClosed, StoreRejected, StoreUnavailable

log = ulog.get(__name__)

CONNECT_TIMEOUT_S = 2.0
WELCOME_TIMEOUT_S = 5.0
#: how long a goodbye waits for the coordinator to take it (it closes the connection when it has)
GOODBYE_WAIT_S = 2.0
#: TCP_USER_TIMEOUT of the link: heartbeats unacknowledged this long break it. Without it a partition
#: left the link "connected" (heartbeats queue in the send buffer) for as long as TCP retransmits, and
#: the agent could not tell that the coordinator no longer heard it (its fence needs to know).
UNACKED_TIMEOUT_S = 2.0


class Coordinators:
    """Where the agent looks for the leading coordinator.

    While etcd answers: the leader key's address (none while nobody leads). While it does not: every
    coordinator that announced itself under ``coordinators/`` (:meth:`announced`, fed by a watch), the
    last leader first. A standby that took over just before etcd went down is then found without etcd
    (chaos seed 97: the agents' links broke with the killed leader, etcd went down 0.4 s after the
    standby's election, and every node fenced and relaunched its ranks although a leader was alive);
    a coordinator that does not lead refuses the hello, so only the leader's welcome counts as contact.
    """

    def __init__(self, read_leader: Callable[[], str | None]) -> None:
        #: the leader key's link address, None without a (well-formed) key; raises StoreUnavailable
        #: or StoreClosed when etcd cannot be read
        self._read_leader = read_leader
        self._lock = threading.Lock()
        self._announced: dict[str, str] = {}  # coordinators/ key -> link address
        self._last_leader: str | None = None  # the leader key's address as last read or watched

    def elected(self, address: str | None) -> None:
        """The leader key changed (fed by a watch): ``address`` leads now; None: nobody does (the
        last leader is kept: it is still the first to try while etcd is down)."""
        if address:
            with self._lock:
                self._last_leader = address

    def linked(self, address: str) -> None:
        """The coordinator at ``address`` welcomed the link: it leads (a standby refuses), also where
        etcd, down, could not say so (the key may still name a dead leader)."""
        self.elected(address)

    def superseded(self, address: str) -> bool:
        """Whether another coordinator was elected since the link to ``address`` was made: a leader
        that stopped without dying (SIGSTOP, a hung host) leaves the link up, since its kernel
        still acknowledges every heartbeat, and the agent would never link to its successor."""
        with self._lock:
            return self._last_leader is not None and self._last_leader != address

    def announced(self, key: str, address: str | None) -> None:
        """A coordinator's announcement appeared (``address``) or was withdrawn (None)."""
        with self._lock:
            if address is None:
                self._announced.pop(key, None)
            else:
                self._announced[key] = address

    def candidates(self) -> list[str]:
        """The addresses to try, in order."""
        try:
            leader = self._read_leader()
        except (StoreUnavailable, StoreRejected, StoreClosed) as exc:  # etcd named no leader: try the known ones
            if isinstance(exc, StoreRejected):  # not an outage (e.g. permission denied): worth a line
                log.warning("etcd refused the leader key's read", error=str(exc))
            with self._lock:
                last = self._last_leader
                return ([last] if last else []) + sorted(set(self._announced.values()) - {last})
        if leader:
            with self._lock:
                self._last_leader = leader
        return [leader] if leader else []


class LinkClient:
    """The agent's end: connect to the leader, say hello, heartbeat; reconnect when it breaks."""

    def __init__(self, node: str, heartbeat_s: float, resolve: Callable[[], Sequence[str]], token: str,
                 tls_config: tls.TLSConfig | None = None, on_sent: Callable[[float], None] | None = None,
                 superseded: Callable[[str], bool] = lambda address: False,
                 on_linked: Callable[[str], None] = lambda address: None) -> None:
        self.node = node
        #: with TLS the agent presents its node certificate and checks the coordinator's against the CA
        self._tls = tls_config
        self._ssl = tls_config.client_context() if tls_config is not None else None
        self.heartbeat_s = heartbeat_s
        self.resolve = resolve  # the "host:port"s where the leader may be, in the order to try them
        #: superseded(address): whether another coordinator leads now; the link to ``address`` is
        #: then closed and made again (checked before each heartbeat)
        self.superseded = superseded
        #: on_linked(address): the coordinator there welcomed this link
        self.on_linked = on_linked
        self.token = token
        #: on_sent(seconds since the previous heartbeat on this connection), after each heartbeat (metrics)
        self.on_sent = on_sent
        self._stop = threading.Event()
        self._goodbye: str | None = None
        self.connected = threading.Event()  # set while the coordinator has welcomed this connection
        #: time.monotonic() since when the link has been down (not welcomed); None while it is up
        self.down_since: float | None = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="link-client", daemon=True)
        self.log = ulog.get(__name__, node=node)

    def start(self) -> LinkClient:
        self._thread.start()
        return self

    def stop(self, goodbye: str | None = None) -> None:
        """Close the link; with ``goodbye``, first tell the coordinator this node leaves on purpose
        and wait (at most ``GOODBYE_WAIT_S``) until it has taken that in."""
        self._goodbye = goodbye
        self._stop.set()
        self._thread.join(timeout=GOODBYE_WAIT_S + 0.5)

    def _connect(self) -> tuple[str, wire.LineSocket] | None:
        for addr in self.resolve():
            conn = self._connect_to(addr)
            if conn is not None:
                return addr, conn
        return None

    def _connect_to(self, addr: str) -> wire.LineSocket | None:
        host, _, port = addr.rpartition(":")
        try:
            sock = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S)
            if self._ssl is not None and self._tls is not None:
                try:
                    sock = self._ssl.wrap_socket(sock, server_hostname=host.strip("[]"))
                    # the CA and host name alone let any cluster certificate (another node's, an
                    # operator's) serve as the coordinator: taken for control-plane contact, and its
                    # address recorded as the leader's
                    tls.require(self._tls.peer_of_socket(sock), tls.Role.COORDINATOR, "the agent link's server")
                except (ssl.SSLError, tls.Unauthorized) as exc:
                    sock.close()
                    self.log.warning("link TLS handshake failed", address=addr, error=str(exc))
                    return None
        except (OSError, ValueError) as exc:
            self.log.info("cannot reach the coordinator", address=addr, error=str(exc))
            return None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(UNACKED_TIMEOUT_S * 1000))
        conn = wire.LineSocket(sock)
        try:
            conn.send(link.LinkHello(node=self.node, token=self.token).to_wire())
            sock.settimeout(WELCOME_TIMEOUT_S)
            line = conn.recv_line()
            reply = link.parse(wire.decode(line)) if line is not None else None
            sock.settimeout(None)
        except (OSError, InvalidRecord) as exc:
            self.log.warning("link hello failed", address=addr, error=str(exc))
            conn.close()
            return None
        if not isinstance(reply, link.Welcome):
            # The coordinator closes a hello it cannot match to this node's registration (it may not
            # have seen that registration yet, so this is retried), and every hello while it does not lead.
            self.log.warning("coordinator refused the link hello", address=addr)
            conn.close()
            return None
        return conn

    def _run(self) -> None:
        backoff = 0.05
        conn: wire.LineSocket | None = None
        while not self._stop.is_set():
            try:
                found = self._connect()
            except Exception:  # a bug of ours: logged with its traceback, and the node stays linkable
                self.log.exception("cannot look for the coordinator")
                found = None
            if found is None:
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 1.0)
                continue
            addr, conn = found
            self.on_linked(addr)
            backoff = 0.05
            self.connected.set()
            self.down_since = None
            try:
                self._heartbeat(addr, conn)
                if self._stop.is_set():
                    break
                self.log.warning("another coordinator leads now; linking to it", address=addr)
            except OSError as exc:
                self.log.warning("link to the coordinator broke; reconnecting", error=str(exc))
            self.connected.clear()
            self.down_since = time.monotonic()
            conn.close()
            conn = None
        if conn is not None:
            if self._goodbye is not None:
                self._say_goodbye(conn, self._goodbye)
            self.connected.clear()
            conn.close()
        elif self._goodbye is not None:
            self.log.warning("stopping with the link down: the coordinator will see this node as lost")

    def _heartbeat(self, addr: str, conn: wire.LineSocket) -> None:
        """Heartbeats until the agent stops or another coordinator leads; raises OSError if the link breaks."""
        last = time.monotonic()
        while not self._stop.wait(self.heartbeat_s):
            if self.superseded(addr):
                return
            conn.send(link.Heartbeat().to_wire())
            now = time.monotonic()
            if self.on_sent is not None:
                self.on_sent(now - last)
            last = now

    def _say_goodbye(self, conn: wire.LineSocket, reason: str) -> None:
        try:
            conn.send(link.Goodbye(reason=reason).to_wire())
            conn.sock.settimeout(GOODBYE_WAIT_S)
            while conn.recv_line() is not None:
                pass
        except (OSError, InvalidRecord) as exc:
            self.log.warning("goodbye not acknowledged by the coordinator", error=str(exc))
            return
        self.log.info("said goodbye to the coordinator", reason=reason)
