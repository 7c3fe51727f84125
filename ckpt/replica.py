"""The peer tier: other ranks' snapshots held in this node's memory, served over TCP.

:class:`ReplicaMemory` holds snapshots under a byte budget: to make room it evicts the oldest
iteration first, but never the newest complete snapshot of a rank (a replacement that dies half-way
must not leave the rank with nothing), so a budget should be at least twice the bytes of the ranks
replicated here. :class:`ReplicaServer` puts it on a TCP port, embeddable in the agent or standalone
(``python -m ckpt.replica --listen HOST:PORT --budget-bytes N``); :class:`ReplicaClient` talks to it.

Protocol (see :mod:`ckpt.wire` for framing), one request per connection:

* ``put {info}`` -> ``{ok}`` (space reserved; or ``ok: false`` before any payload is sent)
  -> meta + data -> ``{ok}``
* ``get {job, rank, iteration}`` -> ``{ok, info}`` + meta + data, or ``{ok: false, missing: true}``
* ``list {job}`` -> ``{ok, items: [info, ...]}``;  ``drop {job, rank, iteration}`` -> ``{ok, dropped}``
* ``stat`` -> ``{ok, used, budget, count}``

The server trusts the cluster network (no authentication) and never verifies or recomputes
checksums: the restoring rank verifies against the checksums the source computed.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import mmap
import signal
import socket
import socketserver
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from ckpt import wire
from ckpt.api import (
    ReplicaRejected,
    ReplicaStore,
    ReplicaUnavailable,
    Snapshot,
    SnapshotInfo,
    StaleGeneration,
    check_name,
)
from unicron.kernel import log as ulog
from unicron.kernel import tls
from unicron.kernel.errors import ConfigError, InvalidRecord, UnicronError

log = ulog.get(__name__)

Key = tuple[str, int, int]
#: a client's limit for connecting and for the server's first answer, which a live server gives at once:
#: a frozen or cut-off one is found in seconds, not in the transfer's timeout
CONNECT_TIMEOUT_S = 5.0
#: a rank that pushed nothing for this long gives up its newest snapshot when the budget needs the room
#: (checkpoints come every few minutes while a job runs; a stopped job's is persisted remotely)
IDLE_RANK_S = 3600.0


@dataclass
class _Held:
    snap: Snapshot
    seq: int
    #: ``time.monotonic()`` of its commit
    at: float = 0.0


def transfer_timeout(base_s: float, nbytes: int) -> float:
    """A sendall's timeout covers the whole transfer: allow for a slow link (100 MB/s) on top."""
    return base_s + nbytes / 100e6


def _alloc(n: int) -> memoryview:
    # An anonymous mapping does not touch the pages (bytearray would zero them first), and needs no
    # torch: the agent hosts this server and must never import torch (it would starve its heartbeats).
    return memoryview(mmap.mmap(-1, n)) if n > 0 else memoryview(bytearray())


class ReplicaMemory(ReplicaStore):
    """In-process replica holder with a byte budget (thread-safe)."""

    def __init__(self, budget_bytes: int, name: str = "memory", idle_s: float = IDLE_RANK_S) -> None:
        if budget_bytes <= 0:
            raise ConfigError(f"ReplicaMemory budget_bytes={budget_bytes}: must be positive")
        self.budget = budget_bytes
        self.name = name
        self.idle_s = idle_s
        self._held: dict[Key, _Held] = {}
        self._reserved = 0
        self._lock = threading.Lock()
        self._seq = itertools.count()

    def describe(self) -> str:
        return self.name

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used()

    def _used(self) -> int:
        return self._reserved + sum(h.snap.info.nbytes for h in self._held.values())

    def _newest(self) -> set[Key]:
        best: dict[tuple[str, int], Key] = {}
        for key in self._held:
            cur = best.get(key[:2])
            if cur is None or key[2] > cur[2]:
                best[key[:2]] = key
        return set(best.values())

    def reserve(self, info: SnapshotInfo) -> int:
        """Make room for ``info``'s bytes (evicting), or raise ReplicaRejected. Returns the bytes reserved."""
        n = info.nbytes
        with self._lock:
            if n > self.budget:
                raise ReplicaRejected(
                    f"{self.name}: a {n}-byte snapshot exceeds the whole budget of {self.budget}"
                )
            self._check_generation(info)
            keep = self._newest()
            victims = sorted((k for k in self._held if k not in keep), key=lambda k: (k[2], self._held[k].seq))
            victims += self._idle(keep - {k for k in keep if k[:2] == (info.job, info.rank)})
            # refused before anything is evicted: a push that cannot fit must not cost the older snapshots
            evictable = sum(self._held[k].snap.info.nbytes for k in victims)
            if self._used() - evictable + n > self.budget:
                raise ReplicaRejected(
                    f"{self.name}: over budget: need {n} bytes, {self._used()} of {self.budget} in use, "
                    f"and only {evictable} evictable (a rank's newest snapshot is evicted only when the rank "
                    f"pushed nothing for {self.idle_s:.0f} s)"
                )
            for victim in victims:
                if self._used() + n <= self.budget:
                    break
                del self._held[victim]
            self._reserved += n
        return n

    def _idle(self, newest: set[Key]) -> list[Key]:
        """Of ``newest`` (not the pushing rank's), the snapshots of ranks that pushed nothing for ``idle_s``, least recently pushed first: a
        job that ended, or ranks whose replicas moved to other nodes, pinned their newest snapshot here
        for good, and once those filled the budget every push of the node's current ranks was refused."""
        last: dict[tuple[str, int], float] = {}
        for k, h in self._held.items():
            last[k[:2]] = max(last.get(k[:2], 0.0), h.at)
        stale = time.monotonic() - self.idle_s
        return sorted((k for k in newest if last[k[:2]] < stale), key=lambda k: last[k[:2]])

    def release(self, reserved: int) -> None:
        with self._lock:
            self._reserved -= reserved

    def _check_generation(self, info: SnapshotInfo) -> None:
        newer = [h.snap.info.generation for k, h in self._held.items()
                 if k[:2] == (info.job, info.rank) and h.snap.info.generation > info.generation]
        if newer:
            raise StaleGeneration(
                f"{self.name}: a snapshot of generation {info.generation} for {info.job!r} rank {info.rank} "
                f"iteration {info.iteration}, and generation {max(newer)} already holds that rank")

    def commit(self, snap: Snapshot, reserved: int) -> None:
        key = (snap.info.job, snap.info.rank, snap.info.iteration)
        with self._lock:
            self._reserved -= reserved
            self._check_generation(snap.info)  # again: a newer generation may have pushed meanwhile
            self._held[key] = _Held(snap, next(self._seq), time.monotonic())
            # a rank's timeline is linear: anything newer than what it just pushed was abandoned
            for k in [k for k in self._held if k[:2] == key[:2] and k[2] > key[2]]:
                del self._held[k]

    def put(self, snapshot: Snapshot) -> None:
        reserved = self.reserve(snapshot.info)
        try:
            data = _alloc(len(snapshot.data))
            data[:] = snapshot.data
        except BaseException:
            self.release(reserved)
            raise
        self.commit(Snapshot(snapshot.info, bytes(snapshot.meta), data), reserved)

    def get(self, job: str, rank: int, iteration: int) -> Snapshot | None:
        with self._lock:
            held = self._held.get((job, rank, iteration))
        return None if held is None else held.snap

    def list(self, job: str | None = None) -> list[SnapshotInfo]:
        with self._lock:
            return [h.snap.info for k, h in sorted(self._held.items()) if job is None or k[0] == job]

    def drop(self, job: str, rank: int | None = None, iteration: int | None = None) -> int:
        with self._lock:
            gone = [
                k for k in self._held if k[0] == job and rank in (None, k[1]) and iteration in (None, k[2])
            ]
            for k in gone:
                del self._held[k]
        return len(gone)


# --------------------------------------------------------------------------------------------- server


def _int(h: dict[str, Any], name: str, optional: bool = False) -> Any:
    v = h.get(name)
    if v is None and optional:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise InvalidRecord(f"replica request: field {name!r} must be a non-negative integer, got {v!r}")
    return v


class _Handler(socketserver.BaseRequestHandler):
    server: _TCPServer

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(self.server.io_timeout_s)
        try:
            if self.server.ssl_context is not None and self.server.tls_config is not None:
                # handshake on the request's own thread: a silent client holds up no one else
                sock = self.server.ssl_context.wrap_socket(sock, server_side=True)
                # any node of the cluster may hold replicas here (an operator's certificate may not, nor
                # a revoked node's: model state is what it would take)
                tls.require(self.server.tls_config.peer_of_socket(sock), tls.Role.NODE,
                            "the checkpoint replica server")
            # a request's header in one timeout: a client trickling bytes held a handler thread for good
            h = wire.recv_header(sock, time.monotonic() + self.server.io_timeout_s)
            op = h.get("op")
            handler = {
                "put": self._put,
                "get": self._get,
                "list": self._list,
                "drop": self._drop,
                "stat": self._stat,
            }.get(str(op))
            if handler is None:
                raise InvalidRecord(f"replica request: unknown op {op!r}")
            handler(sock, h)
        except InvalidRecord as exc:
            self._reply(sock, {"ok": False, "error": str(exc)})
        except tls.Unauthorized as exc:
            log.warning("replica request refused", error=str(exc))
        except (OSError, UnicronError):
            pass  # the client went away mid-request (or failed the TLS handshake); nothing was committed

    @staticmethod
    def _reply(sock: socket.socket, header: dict[str, Any], payloads: tuple[Any, ...] = ()) -> None:
        with contextlib.suppress(OSError):
            wire.send(sock, header, payloads)

    def _put(self, sock: socket.socket, h: dict[str, Any]) -> None:
        mem = self.server.memory
        info = SnapshotInfo.from_dict(h.get("info"))
        try:
            reserved = mem.reserve(info)
        except (ReplicaRejected, StaleGeneration) as exc:
            self._reply(sock, {"ok": False, "error": str(exc)})
            return
        try:
            wire.send(sock, {"ok": True})
            # the reservation is held for the transfer's time at most, however the bytes trickle in
            deadline = time.monotonic() + transfer_timeout(self.server.io_timeout_s, info.nbytes)
            meta = _alloc(info.meta_len)
            wire.recv_into(sock, meta, deadline)
            data = _alloc(info.data_len)
            wire.recv_into(sock, data, deadline)
        except BaseException:
            mem.release(reserved)  # a partial transfer is never committed
            raise
        sock.settimeout(self.server.io_timeout_s)
        try:
            mem.commit(Snapshot(info, bytes(meta), data), reserved)
        except StaleGeneration as exc:  # a newer generation pushed while these bytes came in
            self._reply(sock, {"ok": False, "error": str(exc)})
            return
        self._reply(sock, {"ok": True})

    def _get(self, sock: socket.socket, h: dict[str, Any]) -> None:
        job = check_name(str(h.get("job")), "replica request job")
        snap = self.server.memory.get(job, _int(h, "rank"), _int(h, "iteration"))
        if snap is None:
            self._reply(sock, {"ok": False, "missing": True, "error": "not held"})
            return
        sock.settimeout(transfer_timeout(self.server.io_timeout_s, snap.info.nbytes))
        self._reply(sock, {"ok": True, "info": snap.info.to_dict()}, (snap.meta, snap.data))

    def _list(self, sock: socket.socket, h: dict[str, Any]) -> None:
        job = h.get("job")
        items = self.server.memory.list(None if job is None else str(job))
        self._reply(sock, {"ok": True, "items": [i.to_dict() for i in items]})

    def _drop(self, sock: socket.socket, h: dict[str, Any]) -> None:
        job = check_name(str(h.get("job")), "replica request job")
        n = self.server.memory.drop(job, _int(h, "rank", True), _int(h, "iteration", True))
        self._reply(sock, {"ok": True, "dropped": n})

    def _stat(self, sock: socket.socket, h: dict[str, Any]) -> None:
        mem = self.server.memory
        self._reply(
            sock, {"ok": True, "used": mem.used_bytes, "budget": mem.budget, "count": len(mem.list())}
        )


class _TCPServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    block_on_close = False

    def __init__(self, addr: tuple[str, int], memory: ReplicaMemory, io_timeout_s: float,
                 tls_config: tls.TLSConfig | None = None) -> None:
        self.memory = memory
        self.tls_config = tls_config
        self.ssl_context = tls_config.server_context() if tls_config is not None else None
        self.io_timeout_s = io_timeout_s
        self.address_family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
        super().__init__(addr, _Handler)


class ReplicaServer:
    """Agent side: ``ReplicaServer("0.0.0.0:7070", budget_bytes).start()`` ... ``.stop()``.

    ``memory`` is the held set; the agent can also ``memory.drop(job)`` directly when a job ends.
    """

    def __init__(self, addr: str, budget_bytes: int, io_timeout_s: float = 60.0,
                 tls_config: tls.TLSConfig | None = None, idle_s: float = IDLE_RANK_S) -> None:
        """With ``tls_config`` clients need a ``node`` certificate of the cluster CA (mutual TLS)."""
        self._bind = wire.parse_addr(addr, "ReplicaServer addr")
        self._tls = tls_config
        self.memory = ReplicaMemory(budget_bytes, name=f"replica-server {addr}", idle_s=idle_s)
        self.io_timeout_s = io_timeout_s
        self._server: _TCPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        if self._server is None:
            raise RuntimeError("ReplicaServer is not started")
        host, port = str(self._server.server_address[0]), int(self._server.server_address[1])
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def start(self) -> ReplicaServer:
        """Bind (port 0 picks a free one; see ``address``) and serve in a daemon thread."""
        try:
            self._server = _TCPServer(self._bind, self.memory, self.io_timeout_s, self._tls)
        except OSError as exc:
            raise ConfigError(f"ReplicaServer: cannot listen on {self._bind}: {exc}") from exc
        self.memory.name = f"replica-server {self.address}"
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.2},
            name="ckpt-replica-server",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join()
            self._thread = None


# --------------------------------------------------------------------------------------------- client


class _Call:
    """One request in flight, as :meth:`ReplicaClient.abort` sees it."""

    __slots__ = ("aborted", "sending", "sock")

    def __init__(self) -> None:
        self.sock: socket.socket | None = None
        self.aborted = False
        #: sending a snapshot's bytes (the caller's buffer)
        self.sending = False


class ReplicaClient(ReplicaStore):
    """Training side's handle on one peer's :class:`ReplicaServer` (a connection per request).

    ``connect_timeout_s`` bounds connecting (TLS handshake included) and the server's first answer;
    ``timeout_s`` every later reply, plus 100 MB/s for a transfer (:func:`transfer_timeout`)."""

    def __init__(self, addr: str, timeout_s: float = 60.0, tls_config: tls.TLSConfig | None = None,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        self.addr = addr
        self._target = wire.parse_addr(addr, "ReplicaClient addr")
        self.timeout_s = timeout_s
        self.connect_timeout_s = min(connect_timeout_s, timeout_s)
        self._ssl = tls_config.client_context() if tls_config is not None else None
        self._calls: set[_Call] = set()
        self._calls_cv = threading.Condition()

    def describe(self) -> str:
        return self.addr

    def abort(self) -> bool:
        """Cut short every call in flight: each fails with ReplicaUnavailable, and once this returns
        none sends its snapshot's bytes any more (their buffer may be reused). One still connecting
        gives up within ``connect_timeout_s`` without sending them."""
        with self._calls_cv:
            for c in self._calls:
                c.aborted = True
                if c.sock is not None:
                    with contextlib.suppress(OSError):
                        c.sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked sendall/recv at once
            while any(c.sending for c in self._calls):
                self._calls_cv.wait()
        return True

    def _track(self, call: _Call, sock: socket.socket | None, sending: bool = False) -> None:
        with self._calls_cv:
            if call.aborted:
                raise ConnectionAbortedError("aborted")
            call.sock, call.sending = sock, sending

    def _call(self, header: dict[str, Any], body: Any = None) -> Any:
        call = _Call()
        with self._calls_cv:
            self._calls.add(call)
        try:
            with socket.create_connection(self._target, timeout=self.connect_timeout_s) as raw:
                self._track(call, raw)
                raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock = (self._ssl.wrap_socket(raw, server_hostname=self._target[0]) if self._ssl is not None
                        else raw)
                self._track(call, sock)  # the TLS socket took over the descriptor
                sock.settimeout(self.timeout_s)
                wire.send(sock, header)
                # a live server answers a request at once: a frozen one (SIGSTOP, a cut-off host, whose
                # kernel may still accept the connection) held a push's slot for the whole timeout
                reply = wire.recv_header(sock, time.monotonic() + self.connect_timeout_s)
                return body(sock, reply, call) if body is not None else reply
        except (OSError, InvalidRecord) as exc:
            raise ReplicaUnavailable(f"replica server {self.addr}: {exc}") from exc
        finally:
            with self._calls_cv:
                self._calls.discard(call)
                call.sending = False
                self._calls_cv.notify_all()

    def put(self, snapshot: Snapshot) -> None:
        def body(sock: socket.socket, reply: dict[str, Any], call: _Call) -> dict[str, Any]:
            if not reply.get("ok"):
                return reply
            sock.settimeout(transfer_timeout(self.timeout_s, snapshot.info.nbytes))
            self._track(call, sock, sending=True)
            try:
                sock.sendall(snapshot.meta)
                if len(snapshot.data):
                    sock.sendall(snapshot.data)
            finally:
                with self._calls_cv:
                    call.sending = False
                    self._calls_cv.notify_all()
            return wire.recv_header(sock, time.monotonic() + self.timeout_s)

        reply = self._call({"op": "put", "info": snapshot.info.to_dict()}, body)
        if not reply.get("ok"):
            raise ReplicaRejected(f"replica server {self.addr}: {reply.get('error')}")

    def get(self, job: str, rank: int, iteration: int) -> Snapshot | None:
        def body(sock: socket.socket, reply: dict[str, Any], call: _Call) -> Snapshot | None:
            if not reply.get("ok"):
                if reply.get("missing"):
                    return None
                raise ReplicaRejected(f"replica server {self.addr}: {reply.get('error')}")
            info = SnapshotInfo.from_dict(reply.get("info"))
            # sized by the peer's word: only pages the bytes that come fill are committed (an
            # impossible size fails the mapping: OSError, the peer skipped)
            # the whole transfer in its time: a peer trickling a byte inside every socket timeout
            # stalled the restore (and the nearer-first fallback to the other peers and storage)
            deadline = time.monotonic() + transfer_timeout(self.timeout_s, info.nbytes)
            meta = _alloc(info.meta_len)
            wire.recv_into(sock, meta, deadline)
            data = _alloc(info.data_len)
            wire.recv_into(sock, data, deadline)
            return Snapshot(info, bytes(meta), data)

        result: Snapshot | None = self._call(
            {"op": "get", "job": job, "rank": rank, "iteration": iteration}, body
        )
        return result

    def list(self, job: str | None = None) -> list[SnapshotInfo]:
        reply = self._call({"op": "list", "job": job})
        try:
            return [SnapshotInfo.from_dict(i) for i in reply["items"]]
        except (KeyError, TypeError) as exc:
            raise ReplicaUnavailable(f"replica server {self.addr}: malformed list reply") from exc

    def drop(self, job: str, rank: int | None = None, iteration: int | None = None) -> int:
        reply = self._call({"op": "drop", "job": job, "rank": rank, "iteration": iteration})
        if not reply.get("ok"):
            raise ReplicaRejected(f"replica server {self.addr}: {reply.get('error')}")
        return int(reply["dropped"])

    def stat(self) -> dict[str, Any]:
        reply: dict[str, Any] = self._call({"op": "stat"})
        return reply


# --------------------------------------------------------------------------------------------- standalone


def parse_bytes(text: str) -> int:
    """``"512M"``, ``"4G"``, ``"1048576"`` -> bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = units.get(t[-1:], 1)
    try:
        n = int(float(t[:-1] if mult != 1 else t) * mult)
    except ValueError as exc:
        raise ConfigError(f"--budget-bytes: {text!r} is not a size like 4G, 512M or 1048576") from exc
    if n <= 0:
        raise ConfigError(f"--budget-bytes: {text!r} must be positive")
    return n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ckpt.replica", description="Serve peers' snapshots from memory."
    )
    parser.add_argument(
        "--listen", default="127.0.0.1:0", help="HOST:PORT to listen on (port 0: any free port)"
    )
    parser.add_argument("--budget-bytes", default="1G", help="memory for replicas, e.g. 64G")
    args = parser.parse_args(argv)
    try:
        server = ReplicaServer(args.listen, parse_bytes(args.budget_bytes)).start()
    except UnicronError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"listening on {server.address}", flush=True)
    stop.wait()
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
