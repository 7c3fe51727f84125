"""Cut this process's TCP connections to one host, so that calls blocked on them fail at once.

A host cut off the network (its link down, a partition) answers nothing: no reset, no close. A
gloo collective or a store call waiting on it then waits out its timeout (30 s each, and a
regroup makes several such calls), while the coordinator has long declared the host lost and the
agent said where the task's store went (``StoreMoved``). Shutting the connections down from another
thread makes the blocked calls return with an error now, and the rank's recovery starts from it:
gloo's collective fails (release groups, regroup), the old store's call fails (move to the new one).

Linux only: the connections are found in ``/proc/self/net/tcp{,6}`` and matched to this process's
descriptors by socket inode; ``shutdown`` on a duplicate reaches the one socket both refer to.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
from pathlib import Path

from unicron.kernel import log as ulog

log = ulog.get(__name__)


def _proc_ip(field: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address part of a ``/proc/net/tcp{,6}`` endpoint (hex, each 32-bit word in host order)."""
    hexip = field.split(":")[0]
    try:
        raw = bytes.fromhex(hexip)
    except ValueError:
        return None
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4)) if sys.byteorder == "little" else raw
    if len(words) == 4:
        return ipaddress.IPv4Address(words)
    if len(words) == 16:
        v6 = ipaddress.IPv6Address(words)
        return v6.ipv4_mapped or v6
    return None


def _inodes_to(ips: set[ipaddress.IPv4Address | ipaddress.IPv6Address]) -> set[int]:
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


def resolve(host: str) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """Every address ``host`` names (empty if it cannot be resolved)."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return set()
    out: set[ipaddress.IPv4Address | ipaddress.IPv6Address] = set()
    for info in infos:
        ip = ipaddress.ip_address(str(info[4][0]).split("%")[0])
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            out.add(ip.ipv4_mapped)
        else:
            out.add(ip)
    return out


def sever(host: str) -> int:
    """Shut down every TCP connection of this process to ``host``; returns how many. A loopback
    address names no other host (every rank of a one-machine cluster is there): nothing is cut."""
    ips = {ip for ip in resolve(host) if not ip.is_loopback}
    if not ips:
        return 0
    inodes = _inodes_to(ips)
    try:
        descriptors = list(Path("/proc/self/fd").iterdir())
    except OSError:  # no /proc: nothing can be found to cut
        return 0
    cut = 0
    for fd_path in descriptors:
        try:
            target = os.readlink(fd_path)
        except OSError:
            continue
        if not target.startswith("socket:[") or int(target[8:-1]) not in inodes:
            continue
        try:
            dup = socket.socket(fileno=os.dup(int(fd_path.name)))
        except OSError:
            continue
        try:
            dup.shutdown(socket.SHUT_RDWR)
            cut += 1
        except OSError:
            pass  # not connected any more
        finally:
            dup.close()  # the duplicate only: the original descriptor stays open
    return cut
