"""Recovery end to end (paper Figure 7): real etcd, a coordinator, three agents and real training
processes (`unicron train`, a small Megatron-core GPT on gloo), driven through the CLI/API, on the
multi-host namespace cluster (each node, the coordinator and etcd on a host of its own; root only).

One cluster and one task serve the module; each test injects a fault and checks the action taken
and that the task trains again.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.hosts import require_netns
from unicron.cli.main import main as cli
from unicron.cluster.localcluster import LocalCluster
from unicron.kernel.inject import Injection, request

MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32, "vocab_size": 128,
         "global_batch_size": 32, "micro_batch_size": 4}
TRAIN = [sys.executable, "-m", "unicron.runtime.train", "--iterations", "0", "--iter-sleep", "0.05",
         "--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--vocab", "128",
         "--global-batch-size", "32", "--micro-batch-size", "4"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    require_netns()
    env = {"UNICRON_RESTART_DEADLINE": "40", "UNICRON_REATTEMPT_DEADLINE": "15", "UNICRON_STATUS_INTERVAL": "0.2"}
    c = LocalCluster(agents=3, gpus_per_agent=2, extra_env=env, netns=True, prefork=["unicron.runtime.train"])
    c.start()
    os.environ["UNICRON_ETCD"] = c.etcd.endpoint
    spec = tmp_path_factory.mktemp("spec") / "job.json"
    spec.write_text(json.dumps({"name": "job", "command": TRAIN, "min_gpus": 2, "model": MODEL}))
    try:
        assert cli(["submit", str(spec)]) == 0
        yield c
    finally:
        os.environ.pop("UNICRON_ETCD", None)
        c.stop()


def ranks(c: LocalCluster, task: str = "job") -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for n in c.node_names():
        st = c.agent_status(n) or {}
        out += [r | {"node": n} for r in st.get("ranks", []) if r.get("task") == task and r.get("state") == "running"]
    return out


def top_step(c: LocalCluster) -> int:
    steps = [r["step"] for r in ranks(c) if isinstance(r.get("step"), int)]
    return max(steps, default=-1)


def trains_past(c: LocalCluster, step: int, timeout: float = 180.0) -> None:
    c.wait_for(lambda: top_step(c) > step + 2 and all(isinstance(r.get("step"), int) for r in ranks(c)), timeout,
               f"the task to train past step {step}", poll_s=0.2)


def actions_since(c: LocalCluster, t0: float) -> list[str]:
    return [str(a["action"]) for a in c.actions(t0)]


def test_task_is_placed_and_trains(cluster: LocalCluster) -> None:
    trains_past(cluster, 3, timeout=240.0)
    assert len(ranks(cluster)) in (2, 4)  # the planner gives runnable counts: DP divides 8 micro-batches


def test_sev3_is_handled_in_place_without_an_action(cluster: LocalCluster) -> None:
    trains_past(cluster, top_step(cluster))
    victim = ranks(cluster)[0]
    assert cluster.store is not None
    t0 = time.time()
    request(cluster.store, cluster.keys, victim["node"],
            Injection.from_dict({"fault": "raise", "kind": "connection_refused_reset", "task": "job", "rank": victim["rank"]}))
    inc = cluster.wait_incident(lambda i: i.kind.value == "connection_refused_reset", after=t0 - 1)
    assert inc.handled
    pids = {r["pid"] for r in ranks(cluster)}
    trains_past(cluster, top_step(cluster))
    assert {r["pid"] for r in ranks(cluster)} == pids  # no process was restarted
    assert "RestartRanks" not in actions_since(cluster, t0) and "Assign" not in actions_since(cluster, t0)


def test_sev2_restarts_only_the_failed_rank_which_rejoins(cluster: LocalCluster) -> None:
    trains_past(cluster, top_step(cluster))
    before = ranks(cluster)
    victim = before[-1]
    t0 = time.time()
    os.kill(int(victim["pid"]), signal.SIGKILL)
    cluster.wait_incident(lambda i: i.kind.value == "exited_abnormally" and i.rank == victim["rank"], after=t0 - 1)

    def rejoined() -> bool:
        now = {r["rank"]: r for r in ranks(cluster)}
        back = now.get(victim["rank"])
        return back is not None and back["pid"] != victim["pid"] and isinstance(back.get("step"), int)

    cluster.wait_for(rejoined, 180.0, "the restarted rank to rejoin", poll_s=0.2)
    survivors = {r["rank"]: r["pid"] for r in before if r["rank"] != victim["rank"]}
    assert {r["rank"]: r["pid"] for r in ranks(cluster) if r["rank"] in survivors} == survivors
    assert "RestartRanks" in actions_since(cluster, t0)
    # the agent's warm spawner had long finished importing: the new process was forked from it
    new_pid = {r["rank"]: r["pid"] for r in ranks(cluster)}[victim["rank"]]
    agent_log = Path(cluster.run_dir, f"agent-{victim['node']}.log").read_text(errors="replace")
    started = [json.loads(line) for line in agent_log.splitlines() if '"rank started"' in line]
    assert any(e["rank"] == victim["rank"] and e["pid"] == new_pid and e["how"] == "forked by the spawner"
               for e in started), started
    trains_past(cluster, top_step(cluster))


def test_sev1_isolates_the_node_and_reconfigures_then_the_undrained_node_rejoins(cluster: LocalCluster) -> None:
    trains_past(cluster, top_step(cluster))
    # rank 0's node, whose agent hosts the task's store: with a replica left on another host the task
    # shrinks in place and the store moves to that host; with none left it is a new generation
    before = ranks(cluster)
    node = next(r["node"] for r in before if r["rank"] == 0)
    elsewhere = {r["rank"]: r["pid"] for r in before if r["node"] != node}
    top = top_step(cluster)
    t0 = time.time()
    os.kill(cluster.agents[node].pid, signal.SIGKILL)
    inc = cluster.wait_incident(lambda i: i.kind.value == "lost_connection" and i.node == node, after=t0 - 1)
    assert inc.severity is not None and inc.severity.value == 1
    cluster.wait_for(lambda: ranks(cluster) and all(r["node"] != node for r in ranks(cluster)), 180.0,
                     "the task to run without the node")
    trains_past(cluster, top)
    acts = actions_since(cluster, t0)
    assert "IsolateNode" in acts, acts
    print(f"sev1 on the store's node: {'in place, survivors ' + str(sorted(elsewhere)) if elsewhere else 'new generation'}"
          f"; back to training {time.time() - t0:.1f} s after the kill")
    if elsewhere:
        assert "ResizeInPlace" in acts and "Assign" not in acts, acts
        now = {r["rank"]: r["pid"] for r in ranks(cluster)}
        assert {r: now.get(r) for r in elsewhere} == elsewhere, "a survivor was restarted"
    else:
        assert "Assign" in acts, acts
    cluster.agents[node].wait()
    t_join = time.time()
    cluster.start_agent(node)  # repaired; a node isolated by a sev1 stays so until an operator returns it
    cluster.wait_registered(node)
    cluster.wait_for(lambda: any(r.get("event") == "node registered" and r.get("node") == node
                                 for r in cluster.coordinator_log(t_join)), 30.0, "the coordinator to see the node")
    assert cluster.node_state(node) == "isolated"
    assert cli(["undrain", node]) == 0  # the operator returns it (④), a reconfiguration trigger
    cluster.wait_for(lambda: cluster.node_state(node) == "up", 30.0, "the node back in service")
    trains_past(cluster, top_step(cluster))
