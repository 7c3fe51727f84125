"""A node speaks only for itself: a report, a reconcile result or a status under one node's key that names
another node is refused (real etcd, a leading coordinator). etcd's auth lets a node write only its own keys, but
the coordinator took the node named inside the record: with TLS and per-node auth, node0 filed an ECC
error for node1 and node1 was isolated (review reproduction)."""

from __future__ import annotations

import time

from coordinator import daemon
from coordinator import decision as d
from tests.coordinator.test_takeover import (
    _close,
    _handle_queued,
    _leading_coordinator,
    _placed_on_two_nodes,
    _register,
)
from unicron.cluster.etcd_server import EtcdServer
from unicron.kernel.etcd import WatchEvent
from unicron.kernel.types import AssignmentResult, DetectionMethod, ErrorKind, NodeStatus, RankStatus, Report


def _ecc(on: str) -> Report:
    ts = time.time()
    return Report(method=DetectionMethod.EXCEPTION_PROPAGATION, kind=ErrorKind.ECC_ERROR, node=on,
                  message="forged", source_ts=ts, agent_ts=ts)


def test_a_report_naming_another_node_is_refused_and_its_own_is_taken(etcd_server: EtcdServer) -> None:
    prefix = "/forged"
    _placed_on_two_nodes(etcd_server.endpoint, prefix)
    c, store = _leading_coordinator(etcd_server.endpoint, prefix)
    try:
        for node in ("n0", "n1"):
            _register(c, store, node)
        c._load_state()
        c._start_watches()
        _handle_queued(c)
        forged = _ecc("n1")
        store.put(c.keys.report("n0", forged.report_id), forged.to_json())  # node n0 writes its own key
        _handle_queued(c)
        assert c.state.nodes["n1"].status is d.NodeState.UP
        assert not c.recent_incidents
        assert store.get(c.keys.report("n0", forged.report_id)) is None  # deleted as garbage
        own = _ecc("n0")  # control: the same report about itself isolates n0
        store.put(c.keys.report("n0", own.report_id), own.to_json())
        _handle_queued(c)
        assert c.state.nodes["n0"].status is d.NodeState.ISOLATED
    finally:
        for w in c._watches:
            w.stop()
        _close(c)


def test_a_result_naming_another_node_is_ignored(etcd_server: EtcdServer) -> None:
    prefix = "/forgedresult"
    _placed_on_two_nodes(etcd_server.endpoint, prefix)
    c, _ = _leading_coordinator(etcd_server.endpoint, prefix)
    try:
        c._load_state()
        forged = AssignmentResult(node="n1", revision=1, ok=False, detail="forged", tasks={})
        c._handle(daemon.ResultSeen(WatchEvent("put", c.keys.result("n0"), forged.to_json().encode(), 1),
                                    time.time()))
        assert "n1" not in c._results
    finally:
        _close(c)


def test_a_status_naming_another_node_is_ignored(etcd_server: EtcdServer) -> None:
    """``status/n0`` holding a status of n1 (with its ranks' steps): the statuses are what hang reports and
    task ends are judged by, per node, and its steps would be progress of n1's ranks."""
    prefix = "/forgedstatus"
    _placed_on_two_nodes(etcd_server.endpoint, prefix)
    c, _ = _leading_coordinator(etcd_server.endpoint, prefix)
    try:
        c._load_state()
        entry = c.state.tasks["keep"]
        ranks = [RankStatus(task="keep", generation=entry.generation, rank=r, pid=1, state="running", step=9)
                 for r in entry.ranks_on("n1")]
        forged = NodeStatus(node="n1", ts=time.time(), generation=None, task=None, ranks=ranks, gpu_health=[])
        c._handle(daemon.StatusChanged(WatchEvent("put", c.keys.status("n0"), forged.to_json().encode(), 1),
                                       time.time()))
        assert "n0" not in c._statuses and c.state.tasks["keep"].last_step is None
    finally:
        _close(c)
