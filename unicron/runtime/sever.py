"""Cut this process's TCP connections to one host, so that calls blocked on them fail at once.

A host cut off the network (its link down, a partition) answers nothing: no reset, no close. A
gloo collective or a store call waiting on it then waits out its timeout (30 s each, and a
regroup makes several such calls), while the coordinator has long declared the host lost and the
agent said where the task's store went (``StoreMoved``). Shutting the connections down from another
thread makes the blocked calls return with an error now, and the rank's recovery starts from it:
gloo's collective fails (release groups, regroup), the old store's call fails (move to the new one).

Linux only: this process's descriptors are listed in ``/proc/self/fd``; each TCP socket's peer is
asked with ``getpeername`` on a duplicate, and ``shutdown`` on the duplicate reaches the one socket
both refer to. Not ``/proc/self/net/tcp`` for every cut: reading it walks the kernel's whole TCP hash
table, 8 ms on an idle machine here for a two-line table (20-78 ms while the ranks trained, on the
path of a lost host's recovery), where listing and asking the descriptors takes about 0.5 ms. A
connection still being set up (SYN_SENT: a connect to the lost host) has no peer to ask; only when
there is one is the table read, to find where it is going.

The socket calls go through libc (``ctypes``), not a ``socket.socket`` wrapped around the duplicate:
under a process-wide default timeout (``socket.setdefaulttimeout``) that constructor sets
``O_NONBLOCK``, which belongs to the open file the duplicate shares with the original, and an
unrelated blocking socket of the training script would then fail with ``EAGAIN``.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import socket
import sys
from pathlib import Path

from unicron.kernel import log as ulog

log = ulog.get(__name__)

Address = ipaddress.IPv4Address | ipaddress.IPv6Address

_libc = ctypes.CDLL(None, use_errno=True)
_TCP_SYN_SENT = 2  # tcpi_state, include/net/tcp_states.h
_SOCKADDR_SIZE = 128  # sizeof(struct sockaddr_storage)


def _address(text: str) -> Address:
    """An address as the socket calls write it, an IPv4-mapped IPv6 one as IPv4 (a scope dropped)."""
    return _unmapped(ipaddress.ip_address(text.split("%")[0]))


def _unmapped(ip: Address) -> Address:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def resolve(host: str) -> set[Address]:
    """Every address ``host`` names (empty if it cannot be resolved)."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return set()
    return {_address(str(info[4][0])) for info in infos}


def _int_option(fd: int, level: int, option: int) -> int | None:
    value = ctypes.c_int(0)
    size = ctypes.c_uint32(ctypes.sizeof(value))
    if _libc.getsockopt(fd, level, option, ctypes.byref(value), ctypes.byref(size)) != 0:
        return None
    return value.value


def _is_tcp(fd: int) -> bool:
    return (_int_option(fd, socket.SOL_SOCKET, socket.SO_DOMAIN) in (socket.AF_INET, socket.AF_INET6)
            and _int_option(fd, socket.SOL_SOCKET, socket.SO_PROTOCOL) == socket.IPPROTO_TCP)


def _peer(fd: int) -> Address | None:
    """The address a connected TCP socket talks to; None when it has none (listening, connecting, closed)."""
    raw = ctypes.create_string_buffer(_SOCKADDR_SIZE)
    size = ctypes.c_uint32(_SOCKADDR_SIZE)
    if _libc.getpeername(fd, raw, ctypes.byref(size)) != 0:
        return None
    family = int.from_bytes(raw.raw[0:2], sys.byteorder)
    if family == socket.AF_INET:
        return ipaddress.IPv4Address(raw.raw[4:8])
    if family == socket.AF_INET6:
        return _unmapped(ipaddress.IPv6Address(raw.raw[8:24]))
    return None


def _connecting(fd: int) -> bool:
    """Whether a TCP socket is still sending its SYN (the first byte of ``struct tcp_info``)."""
    info = ctypes.create_string_buffer(8)
    size = ctypes.c_uint32(8)
    if _libc.getsockopt(fd, socket.IPPROTO_TCP, socket.TCP_INFO, info, ctypes.byref(size)) != 0:
        return False
    return info.raw[0] == _TCP_SYN_SENT


def _proc_ip(field: str) -> Address | None:
    """The address part of a ``/proc/net/tcp{,6}`` endpoint (hex, each 32-bit word in host order)."""
    try:
        raw = bytes.fromhex(field.split(":")[0])
    except ValueError:
        return None
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4)) if sys.byteorder == "little" else raw
    if len(words) == 4:
        return ipaddress.IPv4Address(words)
    if len(words) == 16:
        return _unmapped(ipaddress.IPv6Address(words))
    return None


def _inodes_to(ips: set[Address]) -> set[int]:
    """Inodes of this network namespace's TCP sockets whose remote address is one of ``ips``."""
    found: set[int] = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and _proc_ip(cols[2]) in ips:
                found.add(int(cols[9]))
    return found


def _duplicate(name: str) -> tuple[int, int] | None:
    """A duplicate of descriptor ``name`` and its socket inode when it is a TCP socket (None if not, or gone)."""
    try:
        target = os.readlink(f"/proc/self/fd/{name}")
        if not target.startswith("socket:["):
            return None
        fd = os.dup(int(name))
    except (OSError, ValueError):  # closed meanwhile
        return None
    if not _is_tcp(fd):
        os.close(fd)
        return None
    return fd, int(target[8:-1])


def _shut(fd: int) -> bool:
    return bool(_libc.shutdown(fd, socket.SHUT_RDWR) == 0)


def sever(host: str) -> int:
    """Shut down every TCP connection of this process to ``host``, and every connect to it still under
    way; returns how many. A loopback address names no other host (every rank of a one-machine cluster
    is there): nothing is cut."""
    ips = {ip for ip in resolve(host) if not ip.is_loopback}
    if not ips:
        return 0
    try:
        descriptors = os.listdir("/proc/self/fd")
    except OSError:  # no /proc: nothing can be found to cut
        return 0
    cut = 0
    connecting: list[tuple[int, int]] = []
    for name in descriptors:
        found = _duplicate(name)
        if found is None:
            continue
        fd, inode = found
        peer = _peer(fd)
        if peer is None and _connecting(fd):
            connecting.append(found)  # kept open: its destination is looked up below
            continue
        if peer in ips and _shut(fd):
            cut += 1
        os.close(fd)  # the duplicate only: the original descriptor stays open
    if connecting:
        towards = _inodes_to(ips)
        for fd, inode in connecting:
            if inode in towards and _shut(fd):
                cut += 1
            os.close(fd)
    return cut
