"""Fixtures for the checkpoint tests: real replica servers on free localhost ports, per-test directories."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ckpt.manager import CheckpointConfig
from ckpt.replica import ReplicaServer


@pytest.fixture
def replica_server() -> Iterator[ReplicaServer]:
    server = ReplicaServer("127.0.0.1:0", 64 << 20).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def make_config(tmp_path: Path) -> Callable[..., CheckpointConfig]:
    """CheckpointConfig for a rank whose "node memory" is a directory under tmp_path (small chunks, so
    even small states span several checksummed chunks / remote shards)."""

    def make(rank: int = 0, node: str = "node-a", **kw: Any) -> CheckpointConfig:
        kw.setdefault("chunk_bytes", 4096)
        return CheckpointConfig(job="job-1", rank=rank, local_dir=str(tmp_path / node / f"rank-{rank}"), **kw)

    return make
