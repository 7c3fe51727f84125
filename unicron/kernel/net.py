"""Small network helpers shared by the daemons and the local-cluster harness."""

from __future__ import annotations

import socket

import psutil


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it; the caller binds it soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def interface_of(address: str) -> str | None:
    """The name of this host's network interface that holds ``address`` (None if none does)."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addrs):
            return str(name)
    return None
