"""Framing of the replica protocol: a JSON header, then raw payload bytes whose lengths the header gives.

``MAGIC | u32 header length | header JSON`` followed by the payloads. Tensor bytes never pass through
JSON or protobuf: they go from the sender's buffer (a shared-memory slot) to the socket with
``sendall`` and land with ``recv_into`` directly in the receiver's buffer.
"""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Sequence
from typing import Any

from ckpt.api import Buffer
from unicron.kernel import jsontext
from unicron.kernel import wire as kernel_wire
from unicron.kernel.errors import InvalidRecord

MAGIC = b"UCR1"
_HEAD = struct.Struct("!4sI")
MAX_HEADER = 16 << 20


class ConnectionLost(OSError):
    """The peer closed the connection before a whole frame arrived."""


def send(sock: socket.socket, header: dict[str, Any], payloads: Sequence[Buffer] = ()) -> None:
    body = json.dumps(header, separators=(",", ":")).encode()
    sock.sendall(_HEAD.pack(MAGIC, len(body)) + body)
    for p in payloads:
        if len(p):
            sock.sendall(p)


def recv_into(sock: socket.socket, out: memoryview, deadline: float | None = None) -> None:
    """Fill ``out``; ``deadline`` bounds the whole of it (:func:`unicron.kernel.wire.wait_until`)."""
    view = out.cast("B") if out.format != "B" else out
    got = 0
    while got < len(view):
        if deadline is not None:
            kernel_wire.wait_until(sock, deadline, f"whole transfer ({got} of {len(view)} bytes came)")
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionLost(f"connection closed after {got} of {len(view)} bytes")
        got += n


def recv_header(sock: socket.socket, deadline: float | None = None) -> dict[str, Any]:
    """One frame's header; ``deadline`` bounds the whole of it (a peer trickling a byte inside every
    socket timeout held the reader for as long as it liked)."""
    head = bytearray(_HEAD.size)
    recv_into(sock, memoryview(head), deadline)
    magic, n = _HEAD.unpack(head)
    if magic != MAGIC or n > MAX_HEADER:
        raise InvalidRecord(f"replica protocol: bad frame (magic {bytes(magic)!r}, header length {n})")
    body = bytearray(n)
    recv_into(sock, memoryview(body), deadline)
    obj = jsontext.parse(body, "replica protocol: header")
    if not isinstance(obj, dict):
        raise InvalidRecord("replica protocol: header is not a JSON object")
    return obj


def parse_addr(addr: str, what: str = "address") -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) -> (host, port)."""
    host, sep, port = addr.rpartition(":")
    # isascii: int() refuses some characters isdigit() accepts ("²"); 5 digits: no 4300-digit int()
    if not sep or not host or not (port.isascii() and port.isdigit() and len(port) <= 5) or not 0 <= int(port) < 65536:
        raise InvalidRecord(f"{what}: {addr!r} is not host:port")
    return host.strip("[]"), int(port)
