"""The end-to-end detection tests again, on a multi-host cluster: every node, coordinator and etcd
member in a network namespace of its own (its own IP on a bridge; :mod:`unicron.cluster.netns`),
etcd as a 3-member cluster. Addresses chosen on the wrong host or ``127.0.0.1`` assumptions fail
here, and a partition (a node's link taken down) can be tested. Root only: skipped otherwise.

Only a representative few of the loopback tests run here (CI time); they are the same functions.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.integration import test_detection as det
from unicron.cluster.localcluster import LocalCluster
from unicron.cluster.netns import unavailable_reason
from unicron.kernel.types import DetectionMethod, ErrorKind, Severity


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"namespace cluster unavailable: {reason}")
    c = LocalCluster(agents=3, gpus_per_agent=2, extra_env={"UNICRON_WARMUP_ITERATIONS": "3"}, netns=True,
                     etcd_members=3)
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
    leader = json.loads(cluster.store.get(cluster.keys.leader()).value)  # type: ignore[union-attr]
    assert leader["link"].startswith(cluster.host_ip("coord0") + ":")


CASES: list[Callable[[LocalCluster], None]] = [
    det.test_rank_killed_is_process_supervision_sev2,  # gloo ranks across two hosts
    det.test_killed_agent_is_lost_by_connection_close,
    det.test_agents_host_checkpoint_replica_servers,
]


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_detection_on_namespaces(cluster: LocalCluster, case: Callable[[LocalCluster], None]) -> None:
    case(cluster)


def test_snapshots_reach_the_ring_peer_on_another_host(cluster: LocalCluster, tmp_path: Path) -> None:
    det.test_in_memory_snapshots_are_replicated_to_the_ring_peer(cluster, tmp_path)


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
