"""torchrun compatibility: the environment of a rank, and an unmodified torchrun script under real agents."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent import errorfile
from agent.daemon import Agent
from agent.launchenv import rank_env, torchrun_env, visible_devices
from agent.sidecar import StoreSidecar
from tests.agent.test_agent import KEYS, assign, result, settings, status, wait_for
from unicron.cluster.etcd_server import EtcdServer
from unicron.kernel.etcd import Store
from unicron.kernel.types import RankSpec, StoreAddress, TaskAssignment

ROOT = Path(__file__).resolve().parents[2]
STOCK = [sys.executable, str(ROOT / "examples" / "stock_gloo.py")]
STORE = StoreAddress(task="t", generation=3, node="n0", host="10.0.0.5", port=29500)


def two_node_task(ranks: list[RankSpec], group_rank: int, argv: list[str] | None = None,
                  env: dict[str, str] | None = None) -> TaskAssignment:
    return TaskAssignment(task="t", generation=3, argv=argv or ["python", "train.py"], env=env or {}, world_size=4,
                          ranks=ranks, store_node="n0", restart_epoch=2, group_rank=group_rank, group_world_size=2,
                          max_restarts=3)


def test_every_torchrun_variable_with_torchs_conventions() -> None:
    # Node 1 of 2 runs global ranks 2 and 3 on its GPUs 5 and 6.
    a = two_node_task([RankSpec(rank=2, local_rank=0, gpu=5), RankSpec(rank=3, local_rank=1, gpu=6)], group_rank=1)
    env = torchrun_env(a, a.ranks[1], STORE, set_cuda=True)
    assert env == {
        "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2",
        "ROLE_NAME": "default", "ROLE_RANK": "3", "ROLE_WORLD_SIZE": "4",  # one role: role rank = global rank
        "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500",  # the agent's store sidecar
        "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RUN_ID": "t",
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # exactly str(True): torch/distributed/rendezvous.py compares so
        "CUDA_VISIBLE_DEVICES": "5,6", "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    }
    # torchrun's invariant: RANK = base of the node + LOCAL_RANK (homogeneous nodes).
    assert int(env["RANK"]) == int(env["GROUP_RANK"]) * int(env["LOCAL_WORLD_SIZE"]) + int(env["LOCAL_RANK"])
    # set_device(LOCAL_RANK) selects the rank's own GPU: device LOCAL_RANK of the visible list.
    assert env["CUDA_VISIBLE_DEVICES"].split(",")[int(env["LOCAL_RANK"])] == str(a.ranks[1].gpu)


def test_visible_devices_follow_local_rank_order_not_gpu_order() -> None:
    a = two_node_task([RankSpec(rank=1, local_rank=1, gpu=0), RankSpec(rank=0, local_rank=0, gpu=3)], group_rank=0)
    assert visible_devices(a) == "3,0"
    for spec in a.ranks:
        env = torchrun_env(a, spec, STORE, set_cuda=True)
        assert env["CUDA_VISIBLE_DEVICES"].split(",")[spec.local_rank] == str(spec.gpu)


def test_rank_env_layers_and_precedence() -> None:
    a = two_node_task([RankSpec(rank=0, local_rank=0, gpu=1)], group_rank=0,
                      env={"MY_FLAG": "1", "RANK": "7", "TORCHELASTIC_USE_AGENT_STORE": "False"})
    base = {"PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "0,1,2,3", "OMP_NUM_THREADS": "1"}
    env = rank_env(base, a, a.ranks[0], STORE, node="n0", socket_path="/run/u/n0.sock", set_cuda=True)
    assert env["PATH"] == "/usr/bin" and env["MY_FLAG"] == "1"
    assert env["RANK"] == "0" and env["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # the task cannot break them
    assert env["CUDA_VISIBLE_DEVICES"] == "1"  # the agent's own list never reaches a rank
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"  # torchrun's default
    # stdout is a pipe to the agent: unbuffered, progress lines arrive when printed (the task may say no)
    assert env["PYTHONUNBUFFERED"] == "1"
    quiet = two_node_task([RankSpec(rank=0, local_rank=0, gpu=1)], group_rank=0, env={"PYTHONUNBUFFERED": ""})
    assert rank_env(base, quiet, quiet.ranks[0], STORE, node="n0", socket_path="/s", set_cuda=True)[
        "PYTHONUNBUFFERED"] == ""
    assert (env["UNICRON_TASK"], env["UNICRON_GENERATION"], env["UNICRON_NODE"]) == ("t", "3", "n0")
    assert env["UNICRON_AGENT_SOCKET"] == "/run/u/n0.sock"
    # With simulated GPUs the machine's devices are not the task's: nothing is set.
    sim = rank_env(base, a, a.ranks[0], STORE, node="n0", socket_path="/s", set_cuda=False)
    assert "CUDA_VISIBLE_DEVICES" not in sim and "CUDA_DEVICE_ORDER" not in sim


def test_the_error_file_is_set_as_torch_sets_it_a_fresh_one_per_launch(tmp_path: Path) -> None:
    """Before, TORCHELASTIC_ERROR_FILE was never set: a ``@record``-decorated main wrote nothing."""
    a = two_node_task([RankSpec(rank=2, local_rank=0, gpu=5)], group_rank=1)
    path = errorfile.path_for(str(tmp_path / "logs" / "t"), a, 2)
    assert path == str(tmp_path / "logs" / "t" / "gen3" / "attempt_2" / "rank2" / "error.json")
    env = rank_env({"TORCHELASTIC_ERROR_FILE": "/agent/own"}, a, a.ranks[0], STORE, node="n0", socket_path="/s",
                   set_cuda=False, error_file=path)
    assert env["TORCHELASTIC_ERROR_FILE"] == path  # the rank's own, not the agent's
    # another attempt, generation or rank: another file
    others = {errorfile.path_for("/l", a, 3), errorfile.path_for("/l", dataclasses.replace(a, restart_epoch=3), 2),
              errorfile.path_for("/l", dataclasses.replace(a, generation=4), 2), errorfile.path_for("/l", a, 2)}
    assert len(others) == 4
    # a file already at the path (an earlier launch at the same epochs) is gone before the launch
    errorfile.prepare(path)
    Path(path).write_text('{"message": "stale"}')
    errorfile.prepare(path)
    assert not Path(path).exists() and Path(path).parent.is_dir()


def test_init_process_group_needs_the_agent_store_variable(tmp_path: Path) -> None:
    """Why TORCHELASTIC_USE_AGENT_STORE: the sidecar holds MASTER_PORT, and without the variable
    env:// makes rank 0 host a TCPStore there too."""
    sidecar = StoreSidecar.start("127.0.0.1", "t")
    try:
        base = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(sidecar.port), "OMP_NUM_THREADS": "1"}
        base.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        without = subprocess.run([*STOCK, "--steps", "1"], env=base, capture_output=True, text=True, timeout=60)
        assert without.returncode != 0
        assert re.search(r"EADDRINUSE|address already in use", without.stderr, re.IGNORECASE), without.stderr[-2000:]
        ok = subprocess.run([*STOCK, "--steps", "1"], env={**base, "TORCHELASTIC_USE_AGENT_STORE": "True"},
                            capture_output=True, text=True, timeout=60)
        assert ok.returncode == 0, ok.stderr[-2000:]
        assert "done rank 0" in ok.stdout
    finally:
        sidecar.stop()


@pytest.fixture
def agents(etcd_server: EtcdServer, tmp_path: Path) -> Iterator[dict[str, Agent]]:
    started: dict[str, tuple[Agent, threading.Thread]] = {}
    try:
        for node in ("a0", "a1"):
            agent = Agent(settings(etcd_server, node, tmp_path))
            th = threading.Thread(target=agent.run, daemon=True)
            th.start()
            assert agent.ready.wait(30)
            started[node] = (agent, th)
        yield {n: a for n, (a, _) in started.items()}
    finally:
        for agent, _ in started.values():
            agent.stop()
        for _, th in started.values():
            th.join(30)


def test_an_unmodified_torchrun_script_trains_under_two_agents(agents: dict[str, Agent], store: Store,
                                                               tmp_path: Path) -> None:
    # Ranks 0 and 1 on a0, rank 2 on a1; the store is a1's, so rank 0 is not on the store's node (in
    # production another machine; here the same address, where a rank-0 store would collide with it).
    steps = 4
    argv = [*STOCK, "--steps", str(steps)]
    base = dict(argv=argv, env={}, world_size=3, store_node="a1", group_world_size=2)
    t0 = TaskAssignment(task="stock", generation=1, ranks=[RankSpec(rank=0, local_rank=0, gpu=0),
                                                           RankSpec(rank=1, local_rank=1, gpu=1)],
                        group_rank=0, **base)  # type: ignore[arg-type]
    t1 = TaskAssignment(task="stock", generation=1, ranks=[RankSpec(rank=2, local_rank=0, gpu=0)],
                        group_rank=1, **base)  # type: ignore[arg-type]
    revs = {"a0": assign(store, "a0", t0), "a1": assign(store, "a1", t1)}
    for node, rev in revs.items():
        assert wait_for(lambda n=node, r=rev: result(store, n, r), 60, f"{node}'s result").ok  # type: ignore[misc]

    def exited() -> list[tuple[str, int, int | None]] | None:
        sts = [status(store, n) for n in ("a0", "a1")]
        ranks = sorted((s.node, r.rank, r.returncode) for s in sts if s for r in s.ranks if r.task == "stock")
        failed = any(rc not in (None, 0) for _, _, rc in ranks)  # e.g. rank 0's EADDRINUSE: no need to wait
        return ranks if failed or (len(ranks) == 3 and all(rc is not None for _, _, rc in ranks)) else None

    assert wait_for(exited, 90, "every rank to exit") == [("a0", 0, 0), ("a0", 1, 0), ("a1", 2, 0)], (
        (tmp_path / "logs" / "stock" / "rank0.log").read_text())
    logs = {r: (tmp_path / "logs" / "stock" / f"rank{r}.log").read_text() for r in range(3)}
    digests = set()
    for r, text in logs.items():
        lines = [ln for ln in text.splitlines() if ln.startswith("step ")]
        local = 0 if r in (0, 2) else 1
        assert lines == [ln for ln in lines if f"rank {r}/3 local_rank {local} " in ln] and len(lines) == steps, text
        digests.add(re.search(r"done rank \d+ weights (\w+)", text).group(1))  # type: ignore[union-attr]
    assert len(digests) == 1  # the replicas averaged the same gradients: identical weights
    assert store.get(KEYS.store("stock")) is not None
