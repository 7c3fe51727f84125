"""A node cut off from etcd and the coordinator kills its own ranks (agent/fence.py), on a namespace
cluster with a real partition (the node's link taken down). Root only: skipped otherwise.

Before the fence, a 20 s partition left the node's ranks running for all 20 s while the coordinator
had relaunched them elsewhere (bench/RESULTS.md, "Fence"). The veto side (a whole-etcd outage with
the link up fences nothing) is test_netns.py's 30 s outage, which asserts training went on.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.integration import test_detection as det
from tests.integration.hosts import require_netns
from tests.integration.test_metrics import scrape, value
from unicron.cluster.localcluster import LocalCluster
from unicron.kernel.procs import pid_alive

FENCE_S = 3.0


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
