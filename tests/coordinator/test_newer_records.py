"""Rolling upgrade: records a newer agent writes, with a field this coordinator does not know, are read
and acted on (real etcd, a leading coordinator watching them). They were refused whole: the node's
registration ignored (it never joined), its status dropped (no progress seen), its report of a fault
deleted as garbage (the fault never handled)."""

from __future__ import annotations

import json
import time
from typing import Any

from coordinator import decision as d
from tests.coordinator.test_takeover import _close, _handle_queued, _leading_coordinator, _placed_on_two_nodes
from unicron.cluster.etcd_server import EtcdServer
from unicron.kernel.types import DetectionMethod, ErrorKind, NodeInfo, NodeStatus, RankStatus, Record, Report


def _newer(rec: Record, **added: Any) -> str:
    """``rec`` as a newer agent writes it: with fields this version does not know."""
    return json.dumps({**rec.to_dict(), **added})


def test_a_newer_agents_registration_status_and_report_are_acted_on(etcd_server: EtcdServer) -> None:
    prefix = "/newer"
    _placed_on_two_nodes(etcd_server.endpoint, prefix)
    c, store = _leading_coordinator(etcd_server.endpoint, prefix)
    try:
        for node in ("n0", "n1"):
            info = NodeInfo(node=node, host="127.0.0.1", gpus=2, gpu_backend="simulated", agent_pid=1, started_ts=1.0,
                            link_token=f"token-{node}")
            store.put(c.keys.node(node), _newer(info, numa_nodes=2))
        c._load_state()
        c._start_watches()
        _handle_queued(c)
        assert sorted(c._nodes) == ["n0", "n1"] and c._link_tokens["n0"] == "token-n0"

        entry = c.state.tasks["keep"]
        ranks = [{**RankStatus(task="keep", generation=entry.generation, rank=r, pid=1, state="running",
                               step=9).to_dict(), "cuda_graphs": True} for r in entry.ranks_on("n0")]
        status = NodeStatus(node="n0", ts=time.time(), generation=entry.generation, task="keep", ranks=[],
                            gpu_health=[])
        store.put(c.keys.status("n0"), _newer(status, ranks=ranks, nic_health=[]))
        _handle_queued(c)
        assert [r.step for r in c._statuses["n0"].ranks] == [9, 9]
        assert c.state.tasks["keep"].last_step == 9

        ts = time.time()
        report = Report(method=DetectionMethod.EXCEPTION_PROPAGATION, kind=ErrorKind.ECC_ERROR, node="n0",
                        message="ecc", source_ts=ts, agent_ts=ts)
        store.put(c.keys.report("n0", report.report_id), _newer(report, xid=48))
        _handle_queued(c)
        assert [i.report_id for i in c.recent_incidents] == [report.report_id]
        assert c.state.nodes["n0"].status is d.NodeState.ISOLATED
    finally:
        for w in c._watches:
            w.stop()
        _close(c)
