"""Fixtures of the cluster harness tests."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port someone else took between free_port() and etcd's bind (a plain listener)."""
    s = socket.create_server(("127.0.0.1", 0))
    try:
        yield int(s.getsockname()[1])
    finally:
        s.close()
