"""The end-to-end detection tests again, on a multi-host cluster: every node, coordinator and etcd
member in a network namespace of its own (its own IP on a bridge; :mod:`unicron.cluster.netns`),
etcd as a 3-member cluster. Addresses chosen on the wrong host or ``127.0.0.1`` assumptions fail
here, and a partition (a node's link taken down) can be tested. Root only: skipped otherwise.

The detection cases whose path crosses hosts run here only (test_detection.py keeps them as plain
functions); the end-to-end recovery tests (test_recovery, test_restart_job, test_escalation) run on
namespace clusters of their own.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.integration import test_detection as det
from tests.integration.hosts import require_netns
from unicron.cluster.etcd_server import EtcdCluster
from unicron.cluster.localcluster import LocalCluster
from unicron.kernel.types import DetectionMethod, ErrorKind, Severity


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    require_netns()
    # statuses every 0.2 s: the cases wait on them (the default 1 s only adds latency to each wait)
    c = LocalCluster(agents=3, gpus_per_agent=2, netns=True, etcd_members=3,
                     extra_env={"UNICRON_WARMUP_ITERATIONS": "3", "UNICRON_STATUS_INTERVAL": "0.2"})
    c.start()
    try:
        yield c
    finally:
        c.stop()


def test_every_daemon_is_on_a_host_of_its_own(cluster: LocalCluster) -> None:
    assert cluster.store is not None and cluster.net is not None
    hosts = {cluster.host_ip(n) for n in cluster.node_names()}
    assert len(hosts) == 3 and "127.0.0.1" not in hosts
    for node in cluster.node_names():
        info = json.loads(cluster.store.get(cluster.keys.node(node)).value)  # type: ignore[union-attr]
        assert info["host"] == cluster.host_ip(node)
        assert info["replica_addr"].startswith(cluster.host_ip(node) + ":")
    # The coordinator listens on 0.0.0.0 and advertises its own address (its route to etcd), which
    # the agents dialled: none of them would be up otherwise.
    leader = json.loads(cluster.store.get(cluster.keys.leader()).value)  # type: ignore[union-attr]
    assert leader["link"].startswith(cluster.host_ip("coord0") + ":")
    assert leader["api"].startswith(cluster.host_ip("coord0") + ":")


CASES: list[Callable[[LocalCluster], None]] = [
    det.exception_propagation_each_severity,  # gloo ranks across two hosts
    det.rank_killed_is_process_supervision_sev2,
    det.killed_agent_is_lost_by_connection_close,
    det.agents_host_checkpoint_replica_servers,
]


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_detection_on_namespaces(cluster: LocalCluster, case: Callable[[LocalCluster], None]) -> None:
    case(cluster)


def test_snapshots_reach_the_ring_peer_on_another_host(cluster: LocalCluster, tmp_path: Path) -> None:
    det.in_memory_snapshots_are_replicated_to_the_ring_peer(cluster, tmp_path)


def training(cluster: LocalCluster, nodes: list[str]) -> dict[int, tuple[int, int]]:
    """rank -> (pid, step) of the running workload ranks on ``nodes``, read from the nodes' status."""
    out: dict[int, tuple[int, int]] = {}
    for n in nodes:
        st = cluster.agent_status(n) or {}
        for r in st.get("ranks", []):
            if st.get("generation") == det._generation[0] and r.get("state") == "running":
                out[int(r["rank"])] = (int(r["pid"]), int(r.get("step") or 0))
    return out


SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


def etcd_fault_keeps_training(cluster: LocalCluster, fault: Callable[[], object], recover: Callable[[], object],
                              outage_s: float) -> None:
    """Inject ``fault`` on etcd while a workload trains on node0 and node1; its ranks must train on
    through it undisturbed, a rank of another task (node2) killed meanwhile must still be reported,
    and no node may be taken for lost."""
    nodes = ["node0", "node1"]
    det.run_workload(cluster, nodes)
    cluster.assign_task("victim", SLEEPER, ["node2"], ranks_per_node=1, generation=det._generation[0])
    victim_pid = cluster.wait_for(lambda: next((int(r["pid"]) for r in (cluster.agent_status("node2") or {})
                                                .get("ranks", []) if r.get("task") == "victim"
                                                and r.get("state") == "running"), None), 30.0, "the victim rank")
    before = training(cluster, nodes)
    t0 = time.time()
    fault()
    time.sleep(outage_s / 2)
    os.kill(victim_pid, signal.SIGKILL)  # while etcd is degraded or down: the report must not be lost
    t_kill = time.time()
    time.sleep(outage_s / 2)
    recover()
    inc = cluster.wait_incident(lambda i: i.kind is ErrorKind.EXITED_ABNORMALLY and i.task == "victim",
                                timeout_s=30.0, after=t_kill - 1)
    assert abs(inc.source_ts - t_kill) < 1.0, inc  # stamped where it happened, delivered late
    # The workload trained on through the fault: the same processes, further along by at least a
    # third of the iterations the fault lasted (0.05 s each).
    after = cluster.wait_for(lambda: (a := training(cluster, nodes)) and
                             all(a.get(r, (0, 0))[1] > s + outage_s / 0.05 / 3 for r, (_, s) in before.items())
                             and a, 30.0, "statuses after the fault")
    assert {r: pid for r, (pid, _) in after.items()} == {r: pid for r, (pid, _) in before.items()}
    time.sleep(4.0)  # past the agents' lease TTL (3 s): a false node loss would show by now
    lost = [i for i in cluster.incidents() if i.kind is ErrorKind.LOST_CONNECTION and i.detected_ts >= t0]
    assert lost == [], lost
    assert all(p.poll() is None for p in cluster.agents.values())


@pytest.mark.parametrize("victim", ["member", "leader"])
def test_an_etcd_member_killed_disturbs_nothing(cluster: LocalCluster, victim: str) -> None:
    assert isinstance(cluster.etcd, EtcdCluster)
    etcd = cluster.etcd
    dead = etcd.leader() if victim == "leader" else next(m for m in etcd.members if m is not etcd.leader())
    etcd_fault_keeps_training(cluster, dead.kill, dead.start, outage_s=3.0)


@pytest.mark.slow
def test_the_whole_etcd_cluster_down_for_30_s_disturbs_nothing(cluster: LocalCluster) -> None:
    etcd = cluster.etcd
    assert isinstance(etcd, EtcdCluster)
    etcd_fault_keeps_training(cluster, etcd.kill, etcd.start, outage_s=30.0)


def test_a_partitioned_node_is_lost_and_relinks_when_healed(cluster: LocalCluster) -> None:
    node = "node1"  # node2 is isolated by the killed-agent case already
    t0 = time.time()
    cluster.partition(node)
    try:
        inc = det.expect(cluster, t0, ErrorKind.LOST_CONNECTION, Severity.SEV1, DetectionMethod.NODE_HEALTH)
        assert inc.node == node and "heartbeat" in inc.message and inc.detected_ts - t0 < 3.0
    finally:
        t_heal = time.time()
        cluster.heal(node)
    # The same agent process (it ran on, cut off) registers again and links to the coordinator again.
    assert cluster.agents[node].poll() is None
    cluster.wait_registered(node)
    cluster.wait_for(lambda: any(r.get("event") == "link connected" and r.get("node") == node
                                 for r in cluster.coordinator_log(since=t_heal)), 30.0, f"{node} to link again")
    # Lost by a partition, the node is isolated like any sev1 node: never silently back in the pool.
    assert cluster.node_state(node) == "isolated"
