"""Real multi-process jobs for the runtime tests: ranks are forked from one warm spawner per session
(agent.prefork, the agent's) so that a 4-rank job costs about a second, not an import each."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from agent.prefork import Prefork, PreforkUnavailable
from unicron.cluster.launch import LocalJob, warm_spawner
from unicron.runtime.compare import load_params

#: a small GPT and batch shared by the tests (4 gradient buckets of float64)
MODEL = ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--vocab", "128"]
BATCH = ["--global-batch-size", "32", "--micro-batch-size", "4", "--bucket-elems", "32768"]
COMM = ["--collective-timeout", "20", "--regroup-timeout", "45", "--heartbeat-window", "5", "--join-timeout", "60"]


def train_args(iterations: int, dtype: str, deterministic: bool, *extra: str) -> list[str]:
    args = [*MODEL, *BATCH, *COMM, "--iterations", str(iterations), "--dtype", dtype, *extra]
    return [*args, "--deterministic"] if deterministic else args


@dataclass
class Finished:
    job: LocalJob
    codes: Mapping[int, int | None]

    def params(self, rank: int, incarnation: int | None = None) -> dict[str, torch.Tensor]:
        return load_params(self.job.params_path(rank, incarnation))

    def result(self, rank: int, incarnation: int | None = None) -> dict[str, Any]:
        return self.job.result(rank, incarnation)

    def events(self, rank: int, kind: str, incarnation: int | None = None) -> list[dict[str, Any]]:
        return [e["data"] for e in self.result(rank, incarnation)["events"] if e["kind"] == kind]


class Runner:
    def __init__(self, spawner: Prefork | None, root: Path) -> None:
        self.spawner = spawner
        self.root = root
        self._refs: dict[tuple[str, ...], Finished] = {}
        self._n = 0

    def run(
        self,
        world: int,
        args: Sequence[str],
        faults: Mapping[int, str] | None = None,
        restart: Mapping[int, float] | None = None,
        timeout: float = 120.0,
        while_running: Callable[[LocalJob], None] | None = None,
        env: Mapping[int, Mapping[str, str]] | None = None,
        script: str | None = None,
    ) -> Finished:
        self._n += 1
        rank_env = {r: dict(e) for r, e in (env or {}).items()}
        for r, spec in (faults or {}).items():
            rank_env.setdefault(r, {})["UNICRON_RUNTIME_FAULTS"] = spec
        job = LocalJob(world, list(args), str(self.root / f"job{self._n}"), rank_env=rank_env,
                       restart=dict(restart or {}), spawner=self.spawner, script=script)
        with job:
            if while_running is not None:
                while_running(job)
            codes = job.wait(timeout)
        if any(c is None for c in codes.values()):
            pytest.fail(f"job did not finish within {timeout}s: {codes}\n{job.logs()}")
        return Finished(job, codes)

    def reference(
        self, args: Sequence[str], world: int = 1, blocks: int = 4, rank: int = 0, script: str | None = None,
    ) -> dict[str, torch.Tensor]:
        """Parameters of ``rank`` after a failure-free run (cached per configuration); by default a
        single rank computes all B micro-batches with the same ``blocks`` as the 4-rank jobs."""
        key = (str(world), str(blocks), str(script), *args)
        if key not in self._refs:
            done = self.run(world, [*args, "--blocks", str(blocks)], script=script)
            assert all(c == 0 for c in done.codes.values()), done.job.logs()
            self._refs[key] = done
        return self._refs[key].params(rank)

    def reference_result(self, args: Sequence[str], world: int = 1, blocks: int = 4) -> dict[str, Any]:
        self.reference(args, world, blocks)
        return self._refs[(str(world), str(blocks), str(None), *args)].result(0)


@pytest.fixture(scope="session")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runner]:
    spawner: Prefork | None
    try:
        spawner = warm_spawner()
    except PreforkUnavailable:  # its imports started threads (seen with the GPU machine's torch): exec ranks
        spawner = None
    try:
        yield Runner(spawner, tmp_path_factory.mktemp("runtime"))
    finally:
        if spawner is not None:
            spawner.close()


def wait_for(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


os.environ.setdefault("OMP_NUM_THREADS", "1")
