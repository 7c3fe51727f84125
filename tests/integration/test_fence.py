"""A node cut off from etcd and the coordinator kills its own ranks (agent/fence.py): on a namespace
cluster with a real partition (the node's link taken down; root only, skipped otherwise), and on a
loopback cluster whose whole control plane goes down (every node fences, nobody declared one lost).

Before the fence, a 20 s partition left the node's ranks running for all 20 s while the coordinator
had relaunched them elsewhere (bench/RESULTS.md, "Fence"). The veto side (a whole-etcd outage with
the link up fences nothing) is test_netns.py's 30 s outage, which asserts training went on.
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

from tests.integration import test_detection as det
from tests.integration.hosts import require_netns
from tests.integration.test_metrics import scrape, value
from unicron.cli.main import main as cli
from unicron.cluster.localcluster import LocalCluster
from unicron.kernel.procs import pid_alive
from unicron.kernel.types import ErrorKind

FENCE_S = 3.0
WORKLOAD = [sys.executable, "-m", "unicron.runtime.workload", "--iter-time", "0.1"]


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    require_netns()
    c = LocalCluster(agents=2, gpus_per_agent=2, netns=True, metrics=True,
                     extra_env={"UNICRON_FENCE": str(FENCE_S), "UNICRON_STATUS_INTERVAL": "0.2",
                                "UNICRON_WARMUP_ITERATIONS": "3"})
    c.start()
    try:
        yield c
    finally:
        c.stop()


def _pids(cluster: LocalCluster, node: str) -> list[int]:
    return [int(r["pid"]) for r in (cluster.agent_status(node) or {}).get("ranks", []) if r.get("state") == "running"]


@pytest.mark.slow
def test_a_partitioned_node_kills_its_ranks_and_reapplies_its_assignment_when_healed(cluster: LocalCluster) -> None:
    node = "node1"
    det.run_workload(cluster, [node])
    pids = _pids(cluster, node)
    assert len(pids) == 2
    t0 = time.time()
    cluster.partition(node)
    try:
        # lease renewed at most 0.75 s before the cut; fence_s past it, two checks 0.25 s apart
        cluster.wait_for(lambda: not any(pid_alive(p) for p in pids), FENCE_S + 10.0,
                         "the cut-off node's ranks to die", poll_s=0.1)
        killed_after_s = time.time() - t0
        fenced = [r for r in cluster.agent_log(node, since=t0) if r.get("logger") == "agent.fence"]
        assert fenced and fenced[0]["event"].startswith("cut off from etcd and the coordinator")
        assert FENCE_S - 1.0 < float(fenced[0]["cut_off_s"]) < FENCE_S + 3.0, fenced[0]
        assert killed_after_s > FENCE_S - 1.0  # not before the fence: the veto held until both were gone
    finally:
        cluster.heal(node)
    # Contact back (a new lease: the old one expired in the partition): the node's assignment is read
    # and applied again. The coordinator isolated the lost node, so nothing is relaunched there.
    cluster.wait_for(lambda: any(r.get("event", "").startswith("contact with the control plane restored")
                                 for r in cluster.agent_log(node, since=t0)), 30.0, "the fence to lift")
    cluster.wait_for(lambda: cluster.node_state(node) == "isolated", 30.0, f"{node} isolated")
    cluster.wait_for(lambda: _pids(cluster, node) == [], 10.0, f"{node}'s status to list no running rank")
    assert value(scrape(cluster, node), "unicron_agent_fences_total") == 1.0
    assert value(scrape(cluster, "node0"), "unicron_agent_fences_total") == 0.0


@pytest.mark.slow
def test_a_control_plane_outage_fences_every_node_and_the_task_goes_on_as_a_new_generation(
        tmp_path: Path) -> None:
    """etcd and the only coordinator down together (killed; started again after the outage): every
    agent is cut off, so every node's fence kills its ranks, and nobody declared a node lost. Before,
    each agent relaunched its ranks into the old generation when contact returned: one into the store
    that died with the other node's fence, and the task stepped no more (until the hang timeout, 30 min
    by default). Now the agents report the fenced ranks and the coordinator relaunches the task as a
    new generation, on the same (healthy) nodes."""
    env = {"UNICRON_FENCE": str(FENCE_S), "UNICRON_STATUS_INTERVAL": "0.2"}
    with LocalCluster(agents=2, gpus_per_agent=1, extra_env=env) as c:
        os.environ["UNICRON_ETCD"] = c.etcd.endpoint
        try:
            spec = tmp_path / "job.json"
            spec.write_text(json.dumps({"name": "job", "command": WORKLOAD, "min_gpus": 2}))
            assert cli(["submit", str(spec)]) == 0
            c.wait_for(lambda: _stepping(c, 5), 90.0, "both ranks past step 5", poll_s=0.1)
            before = c.running_ranks("job")
            pids = [int(r["pid"]) for r in before.values()]
            leader = c.leader_pid()
            assert leader is not None
            t0 = time.time()
            os.kill(leader, signal.SIGKILL)
            c.etcd.kill()
            c.wait_for(lambda: not any(pid_alive(p) for p in pids), FENCE_S + 10.0, "every node's ranks fenced",
                       poll_s=0.1)
            c.etcd.start()
            c.restart_coordinator(0)
            step = max(int(r["step"]) for r in before.values())
            c.wait_for(lambda: _stepping(c, step + 5, than=before), 90.0, "the task stepping on as a new generation",
                       poll_s=0.2)
            fenced = [i for i in c.incidents() if i.kind is ErrorKind.FENCED and i.detected_ts >= t0]
            assert {i.node for i in fenced} <= set(c.node_names()) and fenced, fenced
            edges = [str(r.get("edge")) for r in c.coordinator_log(t0) if r.get("event") == "transition"]
            assert any("--stopped--> reconfiguring" in e for e in edges), edges
            assert all(c.node_state(n) == "up" for n in c.node_names())  # no healthy node taken out
        finally:
            os.environ.pop("UNICRON_ETCD", None)


def _stepping(c: LocalCluster, past: int, than: dict[int, dict[str, Any]] | None = None) -> bool:
    """Both ranks running past step ``past`` (in processes other than ``than``'s, at a later generation)."""
    now = c.running_ranks("job")
    if len(now) != 2 or not all(isinstance(r.get("step"), int) and r["step"] >= past for r in now.values()):
        return False
    return than is None or all(now[k]["pid"] != r["pid"] and now[k]["generation"] > r["generation"]
                               for k, r in than.items())
