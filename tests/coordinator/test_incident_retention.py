"""Incident retention (real etcd, a leading coordinator): the incidents that led to an action are kept
apart from the handled echoes. One FIFO over all records let a single crash of a W-rank job (the root's
sev2 plus W-1 survivors' handled sev3s) evict the whole actioned history, and with it the measured
transitions a new leader seeds the planner from (review reproduction, torchkill8)."""

from __future__ import annotations

import time

import pytest

from coordinator import daemon
from tests.coordinator.test_takeover import _close, _leading_coordinator, _placed_on_two_nodes
from unicron.cluster.etcd_server import EtcdServer
from unicron.kernel.types import DetectionMethod, ErrorKind, Incident, Report


def _kept(c: daemon.Coordinator) -> list[Incident]:
    assert c.store is not None
    kvs, _ = c.store.get_prefix(c.keys.incidents())
    return [Incident.from_json(kv.value) for kv in kvs]


def _echo(rank: int) -> Report:
    """A survivor's peer-gone error, already handled in place by the runtime: recorded, no action."""
    return Report(method=DetectionMethod.EXCEPTION_PROPAGATION, kind=ErrorKind.CONNECTION_REFUSED_RESET,
                  node="n1", task="keep", rank=rank, handled=True, source_ts=time.time())


def test_handled_incidents_do_not_evict_the_one_that_led_to_an_action(
        etcd_server: EtcdServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(daemon, "KEEP_INCIDENTS", 3)
    monkeypatch.setattr(daemon, "KEEP_QUIET_INCIDENTS", 2, raising=False)
    prefix = "/retention"
    _placed_on_two_nodes(etcd_server.endpoint, prefix)
    c, _ = _leading_coordinator(etcd_server.endpoint, prefix)
    try:
        c._load_state()
        entry = c.state.tasks["keep"]
        crash = Report(method=DetectionMethod.PROCESS_SUPERVISION, kind=ErrorKind.EXITED_ABNORMALLY, node="n0",
                       task="keep", rank=entry.ranks_on("n0")[0], generation=entry.generation, source_ts=time.time())
        c._record(crash, report_key=None)
        root = c.recent_incidents[-1]
        assert root.action == "restart", root
        for rank in range(10):
            c._record(_echo(rank), report_key=None)
        kept = _kept(c)
        assert root.incident_id in {i.incident_id for i in kept}
        assert root.incident_id in {i.incident_id for i in c.recent_incidents}
        assert sum(i.handled for i in kept) == 2  # the echoes have their own (smaller) bound
        assert len(c.recent_incidents) == len(kept) == 3
    finally:
        _close(c)
    # a new leader sorts the kept records into the same two FIFOs: more echoes still leave the root
    b, _ = _leading_coordinator(etcd_server.endpoint, prefix)
    try:
        b._load_state()
        assert root.incident_id in {i.incident_id for i in b.recent_incidents}
        for rank in range(5):
            b._record(_echo(rank), report_key=None)
        kept = _kept(b)
        assert root.incident_id in {i.incident_id for i in kept}
        assert len(kept) == 3
    finally:
        _close(b)
