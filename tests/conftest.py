"""Shared fixtures: a real etcd per test (never a mock), torn down whatever happens."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from unicron.cluster.etcd_server import EtcdServer
from unicron.kernel.etcd import Store


def _has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none on this machine")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture
def etcd_server() -> Iterator[EtcdServer]:
    server = EtcdServer().start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def store(etcd_server: EtcdServer) -> Iterator[Store]:
    s = Store(etcd_server.endpoint)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def prefix() -> str:
    return f"/unicron-test-{os.getpid()}"
