"""Small network helpers shared by the daemons and the local-cluster harness."""

from __future__ import annotations

import socket

import psutil

from unicron.kernel.address import is_host
from unicron.kernel.errors import ConfigError

#: listen addresses that mean "every interface": never an address to give a peer
WILDCARDS = ("", "0.0.0.0", "::", "[::]")

def check_host(host: str, flag: str) -> None:
    """ConfigError naming ``flag`` unless ``host`` is an IP address ([v6] too) or a host name: a value
    published for peers to dial (in the leader key, a node's registration) that nobody can dial broke
    them far from the flag, or was refused by every client reading it."""
    if not is_host(host):
        raise ConfigError(f"{flag}: {host!r} is neither an IP address nor a host name; give one peers can dial")


def family_of(host: str) -> socket.AddressFamily:
    """The address family of ``host``: IPv6 for a v6 literal, else IPv4 (a v4 literal or a host name)."""
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def route_address(host: str, port: int) -> str:
    """This host's own address on its route to ``host:port``: the source address the kernel picks to
    reach it, so a peer on that network can reach this host back at it. (A UDP ``connect`` only
    selects the route; no packet is sent.) Raises OSError when there is no route."""
    with socket.socket(family_of(host), socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return str(s.getsockname()[0])


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it; the caller binds it soon after).
    Of ``host``'s family: an IPv6 advertise host (route_address to a v6 etcd) is bound as one."""
    with socket.socket(family_of(host), socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def interface_of(address: str) -> str | None:
    """The name of this host's network interface that holds ``address`` (None if none does)."""
    family = family_of(address)
    for name, addrs in psutil.net_if_addrs().items():
        # a link-local v6 address is listed with its zone ("fe80::1%eth0")
        if any(a.family == family and a.address.split("%")[0] == address for a in addrs):
            return str(name)
    return None
