"""Fixtures for the checkpoint tests: real replica servers on free localhost ports, scripted fake ones,
per-test directories."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ckpt.manager import CheckpointConfig
from ckpt.replica import ReplicaServer
from tests.ckpt.helpers import FakePeer, Respond


@pytest.fixture
def replica_server() -> Iterator[ReplicaServer]:
    server = ReplicaServer("127.0.0.1:0", 64 << 20).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def fake_peer() -> Iterator[Callable[[Respond], FakePeer]]:
    """``fake_peer(respond)``: a :class:`FakePeer` serving on a free localhost port, closed after the test."""
    made: list[FakePeer] = []

    def make(respond: Respond) -> FakePeer:
        made.append(FakePeer(respond))
        return made[-1]

    yield make
    for p in made:
        p.close()


@pytest.fixture
def make_config(tmp_path: Path) -> Callable[..., CheckpointConfig]:
    """CheckpointConfig for a rank whose "node memory" is a directory under tmp_path (small chunks, so
    even small states span several checksummed chunks / remote shards)."""

    def make(rank: int = 0, node: str = "node-a", **kw: Any) -> CheckpointConfig:
        kw.setdefault("chunk_bytes", 4096)
        return CheckpointConfig(job="job-1", rank=rank, local_dir=str(tmp_path / node / f"rank-{rank}"), **kw)

    return make
