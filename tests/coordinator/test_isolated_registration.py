"""What an isolated node's agent registers while the node is out of service (real etcd, a leading
coordinator driven by the test). The registration does not bring the node back (``causes.rejoin``), so
its GPU count never reached the core: back in service, the node was planned with the count from before
its isolation, the executor handed out GPU indices it no longer has, the launch crashed and the node
was isolated again (review reproduction)."""

from __future__ import annotations

import time

from coordinator import decision as d
from coordinator.causes import classify
from coordinator.daemon import Coordinator
from coordinator.tasks import parse_task_spec
from tests.coordinator.test_takeover import (
    _close,
    _crash_and_fail_restart,
    _leading_coordinator,
    _run_job_on_eight_gpus,
)
from unicron.cluster.etcd_server import EtcdServer
from unicron.kernel.etcd import WatchEvent
from unicron.kernel.types import DetectionMethod, ErrorKind, NodeInfo, Report


def _register(c: Coordinator, node: str, gpus: int, pid: int) -> None:
    """The agent's registration as the watch delivers it (a new pid: a new agent)."""
    info = NodeInfo(node=node, host="127.0.0.1", gpus=gpus, gpu_backend="simulated", agent_pid=pid,
                    started_ts=float(pid))
    c._on_node(WatchEvent("put", c.keys.node(node), info.to_json().encode(), 0), time.time())


def _isolate(c: Coordinator, node: str) -> None:
    ts = time.time()
    report = Report(method=DetectionMethod.EXCEPTION_PROPAGATION, kind=ErrorKind.ECC_ERROR, node=node,
                    source_ts=ts, agent_ts=ts)
    c._decide(d.IncidentRaised(ts=ts, incident=classify(report, ts, f"ecc-{node}")))
    assert c.state.nodes[node].status is d.NodeState.ISOLATED


def test_a_node_undrained_after_its_isolation_has_the_gpus_it_registered_meanwhile(
        etcd_server: EtcdServer) -> None:
    c, _ = _leading_coordinator(etcd_server.endpoint, "/isolatedgpus")
    try:
        _register(c, "n0", 8, 100)
        _register(c, "n1", 8, 101)
        _isolate(c, "n1")
        _register(c, "n1", 4, 202)  # repaired and rebooted: one GPU board gone for good
        assert c.state.nodes["n1"].status is d.NodeState.ISOLATED  # a registration is no repair
        c._node_event("n1", d.NodeUndrained(ts=time.time(), node="n1"))
        assert (c.state.nodes["n1"].status, c.state.nodes["n1"].gpus) == (d.NodeState.UP, 4)
        spec = parse_task_spec({"name": "job", "command": ["python", "x.py"], "min_gpus": 12, "max_gpus": 12},
                               None)
        c._decide(d.TaskSubmitted(ts=time.time(), spec=spec))
        assert len(c.state.tasks["job"].ranks_on("n1")) == 4
        assert {r.gpu for r in c.executor.desired["n1"]["job"].ranks} == {0, 1, 2, 3}
    finally:
        _close(c)


def test_a_suspected_node_released_when_the_fault_followed_the_task_has_its_new_count(
        etcd_server: EtcdServer) -> None:
    """The other way back: a failed restart isolated the node on suspicion, and the task's next failed
    restart elsewhere releases it (drained here: an operator drained it meanwhile, and an undrain later
    returns it with the count it has then)."""
    c, _ = _leading_coordinator(etcd_server.endpoint, "/releasedgpus")
    try:
        for i, n in enumerate(("n0", "n1", "n2")):
            _register(c, n, 8, 100 + i)
        first = _run_job_on_eight_gpus(c)
        _crash_and_fail_restart(c, first, "i1")
        assert c.state.nodes[first].suspected_by == "job"
        _register(c, first, 4, 200)
        c._node_event(first, d.NodeDrained(ts=time.time(), node=first, reason="maintenance"))
        _crash_and_fail_restart(c, min(c.state.tasks["job"].placement), "i2")
        assert (c.state.nodes[first].status, c.state.nodes[first].gpus) == (d.NodeState.DRAINED, 4)
    finally:
        _close(c)
