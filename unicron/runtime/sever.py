"""Cut this process's TCP connections to one host, so that calls blocked on them fail at once.

A host cut off the network (its link down, a partition) answers nothing: no reset, no close. A
gloo collective or a store call waiting on it then waits out its timeout (30 s each, and a
regroup makes several such calls), while the coordinator has long declared the host lost and the
agent said where the task's store went (``StoreMoved``). Shutting the connections down from another
thread makes the blocked calls return with an error now, and the rank's recovery starts from it:
gloo's collective fails (release groups, regroup), the old store's call fails (move to the new one).

Linux only: this process's descriptors are listed in ``/proc/self/fd``; each TCP socket's peer is
asked with ``getpeername`` on a duplicate, and ``shutdown`` on the duplicate reaches the one socket
both refer to. Not ``/proc/self/net/tcp``: reading it walks the kernel's whole TCP hash table, 8 ms
on an idle machine here for a two-line table (20-78 ms while the ranks trained, on the path of a
lost host's recovery), where listing and asking the descriptors takes about 0.2 ms.
"""

from __future__ import annotations

import ipaddress
import os
import socket

from unicron.kernel import log as ulog

log = ulog.get(__name__)


Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def _address(text: str) -> Address:
    """An address as the socket calls write it, an IPv4-mapped IPv6 one as IPv4 (a scope dropped)."""
    ip = ipaddress.ip_address(text.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _peer(sock: socket.socket) -> Address | None:
    """The address a connected TCP socket talks to; None for anything else."""
    if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    try:
        return _address(str(sock.getpeername()[0]))
    except OSError:  # listening, or not connected any more
        return None


def resolve(host: str) -> set[Address]:
    """Every address ``host`` names (empty if it cannot be resolved)."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return set()
    return {_address(str(info[4][0])) for info in infos}


def _duplicate(name: str) -> socket.socket | None:
    """A socket object on a duplicate of descriptor ``name`` when it is a socket (None if not, or gone)."""
    try:
        if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
            return None
        fd = os.dup(int(name))
    except OSError:  # closed meanwhile
        return None
    try:
        return socket.socket(fileno=fd)
    except OSError:
        os.close(fd)
        return None


def sever(host: str) -> int:
    """Shut down every TCP connection of this process to ``host``; returns how many. A loopback
    address names no other host (every rank of a one-machine cluster is there): nothing is cut."""
    ips = {ip for ip in resolve(host) if not ip.is_loopback}
    if not ips:
        return 0
    try:
        descriptors = os.listdir("/proc/self/fd")
    except OSError:  # no /proc: nothing can be found to cut
        return 0
    cut = 0
    for name in descriptors:
        dup = _duplicate(name)
        if dup is None:
            continue
        try:
            if _peer(dup) in ips:
                dup.shutdown(socket.SHUT_RDWR)
                cut += 1
        except OSError:
            pass  # not connected any more
        finally:
            dup.close()  # the duplicate only: the original descriptor stays open
    return cut
