"""Parsing of network addresses: pure (no socket), so that records (``types``) and the decision core
may check the addresses they carry."""

from __future__ import annotations

import ipaddress
import re

_HOST_NAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]{0,251}[A-Za-z0-9_.])?")


def ip_literal(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP address ``host`` writes (``[v6]`` too); None for a host name (or anything else)."""
    try:
        return ipaddress.ip_address(host[1:-1] if host.startswith("[") and host.endswith("]") else host)
    except ValueError:
        return None


def is_host(host: str) -> bool:
    """Whether ``host`` is an IP address ([v6] too) or a host name."""
    return ip_literal(host) is not None or bool(_HOST_NAME.fullmatch(host))


def host_port(address: str) -> tuple[str, int] | None:
    """``host:port`` (``[v6]:port`` too, brackets kept) -> (host, port) with a port in 1-65535; None for
    anything else. gRPC would dial a port over 65535 modulo 65536: another port, maybe another server's."""
    host, sep, port = address.rpartition(":")
    # isascii: int() refuses some characters isdigit() accepts ("²"); 5 digits: no 4300-digit int()
    if not sep or not host or not (port.isascii() and port.isdigit() and len(port) <= 5) or not 0 < int(port) < 65536:
        return None
    return host, int(port)


def dialable(address: str) -> bool:
    """Whether ``address`` is ``host:port`` a peer can dial: an IP address ([v6] too) or a host name, and
    a port in 1-65535; nothing else (no comma or whitespace: it may travel in a comma-separated list)."""
    parsed = host_port(address)
    if parsed is None or any(c == "," or c.isspace() for c in address):  # a v6 zone ("%eth0") takes any text
        return False
    return is_host(parsed[0])
