"""Newline-delimited JSON over stream sockets: the framing of every Unicron socket.

Used by the rank <-> agent Unix socket and the agent <-> coordinator TCP link. One message is one
JSON object on one line. Lines longer than ``MAX_LINE`` are rejected (a peer sending garbage must not
make a daemon buffer without bound).
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from typing import Any

from unicron.kernel import jsontext
from unicron.kernel import log as ulog
from unicron.kernel.errors import InvalidRecord

log = ulog.get(__name__)

MAX_LINE = 1 << 20
#: how long an acceptor waits after a failed accept() before it tries again
ACCEPT_RETRY_S = 0.1


def encode(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes) -> dict[str, Any]:
    # a peer's garbage is one InvalidRecord, which must not end the thread that reads it
    try:
        obj = jsontext.parse(line, "not a JSON line")
    except InvalidRecord as exc:  # the excerpt only on failure: every rank and link message comes here
        raise InvalidRecord(f"{exc} ({line[:80]!r})") from exc
    if not isinstance(obj, dict):
        raise InvalidRecord(f"expected a JSON object, got {type(obj).__name__}")
    return obj


class LineSocket:
    """A stream socket read line by line and written whole-message at a time (thread-safe sends)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = bytearray()
        #: the rest of a line refused as too long is dropped up to its newline, never read as a message
        self._skipping = False
        self._send_lock = threading.Lock()

    def send(self, obj: dict[str, Any]) -> None:
        data = encode(obj)
        with self._send_lock:
            self.sock.sendall(data)

    def try_send(self, obj: dict[str, Any]) -> bool:
        """Send unless another send holds the socket at this moment; then return False at once. For
        callers that must not wait, e.g. a garbage-collector callback in a thread that may itself be
        inside :meth:`send`."""
        data = encode(obj)
        if not self._send_lock.acquire(blocking=False):
            return False
        try:
            self.sock.sendall(data)
        finally:
            self._send_lock.release()
        return True

    def recv_line(self, deadline: float | None = None) -> bytes | None:
        """Next line without its newline, or None at EOF. Raises InvalidRecord for an over-long line,
        and TimeoutError once ``deadline`` passes (:func:`wait_until`)."""
        while True:
            nl = self._buf.find(b"\n")
            if self._skipping:
                del self._buf[: nl + 1 if nl >= 0 else len(self._buf)]
                self._skipping = nl < 0
                if nl >= 0:
                    continue
            elif nl >= 0:
                line = bytes(self._buf[:nl])
                del self._buf[: nl + 1]
                return line
            elif len(self._buf) > MAX_LINE:
                self._buf.clear()
                self._skipping = True
                raise InvalidRecord(f"line longer than {MAX_LINE} bytes")
            if deadline is not None:
                wait_until(self.sock, deadline, "a complete line")
            chunk = self.sock.recv(65536)
            if not chunk:
                return None
            self._buf += chunk

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def wait_until(sock: socket.socket, deadline: float, what: str) -> None:
    """Let ``sock``'s next operation wait until ``deadline`` (``time.monotonic()``) at most; raise
    TimeoutError once it has passed. A socket timeout bounds each operation only: a peer sending a
    byte now and then held a read of many operations open for ever."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"no {what} before the deadline")
    sock.settimeout(left)


def accept(listener: socket.socket, stop: threading.Event, what: str) -> socket.socket | None:
    """The next connection to ``listener``, or None once ``stop`` is set (:func:`stop_listening`).

    A failed ``accept()`` while not stopping (EMFILE/ENFILE: the descriptor table full for a moment,
    ECONNABORTED, ENOBUFS) is logged and tried again after ``ACCEPT_RETRY_S``: the acceptors returned on
    it, so one burst of reconnecting agents left the leader's link, or an agent's rank socket, deaf for
    good. The pending connection stays in the backlog meanwhile. A run of failures is logged once.
    """
    failures = 0
    while not stop.is_set():
        try:
            sock, _ = listener.accept()
        except OSError as exc:
            if stop.is_set():
                break
            if failures == 0:
                log.warning("accept failed; retrying", listener=what, error=str(exc))
            failures += 1
            stop.wait(ACCEPT_RETRY_S)
            continue
        if stop.is_set():
            sock.close()
            break
        if failures:
            log.info("accepting again", listener=what, failed_attempts=failures)
        return sock
    return None


def stop_listening(sock: socket.socket, acceptor: threading.Thread, timeout_s: float = 5.0) -> None:
    """Stop a listening socket served by ``acceptor`` (a thread looping on ``accept()``), and release
    its descriptor only once that thread is gone.

    ``close()`` alone does not wake a blocked ``accept()`` on Linux, and frees a descriptor number the
    next socket of this process may get: a stopped agent's rank-server thread, left in ``accept()``,
    later accepted a connection made to the next agent's rank server in the same process and dropped
    its messages as an unknown task's (seen in ``tests/agent/test_agent.py`` under load). ``shutdown``
    wakes it (``EINVAL``); the loop must then see its stop flag and return.
    """
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    if acceptor.is_alive() and acceptor is not threading.current_thread():
        acceptor.join(timeout_s)
    sock.close()
