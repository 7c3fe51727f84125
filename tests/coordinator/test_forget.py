"""``unicron forget`` in the daemon (real etcd, a leading coordinator driven by the test): a node
retired for good loses its state entry, ``assign/``, ``results/`` and ``drain/`` records in one
fenced write, and the leader's memory of it. Before, they stayed for ever (review reproduction)."""

from __future__ import annotations

import time

import pytest

from coordinator import decision as d
from coordinator.api import NotFound
from coordinator.tasks import parse_task_spec
from tests.coordinator.test_isolated_registration import _isolate, _register
from tests.coordinator.test_takeover import _close, _leading_coordinator
from unicron.cluster.etcd_server import EtcdServer
from unicron.kernel.errors import PermanentError
from unicron.kernel.etcd import WatchEvent
from unicron.kernel.types import AssignmentResult


def test_forget_deletes_a_retired_nodes_records_in_one_write(etcd_server: EtcdServer) -> None:
    c, store = _leading_coordinator(etcd_server.endpoint, "/forget")
    keys = c.keys
    try:
        _register(c, "n0", 8, 100)
        _register(c, "n1", 8, 101)
        spec = parse_task_spec({"name": "job", "command": ["python", "x.py"], "min_gpus": 8, "max_gpus": 16}, None)
        c._decide(d.TaskSubmitted(ts=time.time(), spec=spec))
        assert set(c.state.tasks["job"].placement) == {"n0", "n1"}
        result = AssignmentResult(node="n1", revision=1, ok=True, detail="", tasks={})
        store.put(keys.result("n1"), result.to_json())
        c._on_result(WatchEvent("put", keys.result("n1"), result.to_json().encode(), 0), time.time())
        _isolate(c, "n1")
        assert "n1" not in c.state.tasks["job"].placement
        c._node_event("n1", d.NodeDrained(ts=time.time(), node="n1"))  # drain/n1 goes too
        for key in (keys.assignment("n1"), keys.result("n1"), keys.state_node("n1"), keys.drain("n1")):
            assert store.get(key) is not None, key

        # refused while the node is up, or its agent registered: one line saying what to do
        with pytest.raises(PermanentError, match=r"^node n0 is up; drain it and stop its agent first$"):
            c._forget("n0")
        with pytest.raises(PermanentError, match=r"^node n1 is isolated but its agent is still registered; "
                                                 r"stop its agent first$"):
            c._forget("n1")
        with pytest.raises(NotFound, match="no node 'n9'"):
            c._forget("n9")
        store.put(keys.node("n1"), "{}")  # registered in etcd, the watch not yet delivered: refused too
        c._on_node(WatchEvent("delete", keys.node("n1"), b"", 0), time.time())  # the old agent's lease
        with pytest.raises(PermanentError, match="still registered"):
            c._forget("n1")
        store.delete(keys.node("n1"))

        _, before = store.get_prefix(keys.nodes())
        c._forget("n1")
        _, after = store.get_prefix(keys.nodes())
        assert after == before + 1  # one transaction
        for key in (keys.assignment("n1"), keys.result("n1"), keys.state_node("n1"), keys.drain("n1")):
            assert store.get(key) is None, key
        assert "n1" not in c.state.nodes and "n1" not in c.executor.desired and "n1" not in c.executor.isolated
        assert all("n1" not in m for m in (c._nodes, c._link_tokens, c._lost_nodes, c._results, c._statuses))

        # no later decision writes its record back; the name registering again is a new node, in service
        c._decide(d.TaskCancelled(ts=time.time(), task="job"))
        assert store.get(keys.assignment("n1")) is None
        _register(c, "n1", 4, 300)
        assert (c.state.nodes["n1"].status, c.state.nodes["n1"].gpus, c.state.nodes["n1"].drained) == (
            d.NodeState.UP, 4, "")
    finally:
        _close(c)


def test_a_registration_landing_between_the_check_and_the_write_is_not_forgotten(
    etcd_server: EtcdServer, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``_forget`` read ``nodes/<node>`` and then wrote in another transaction: an agent registering in
    between had its node forgotten anyway (its records deleted, the name then taken as a new node's).
    The registration's absence is now a compare of the forget's own fenced write."""
    c, store = _leading_coordinator(etcd_server.endpoint, "/forget-race")
    keys = c.keys
    try:
        _register(c, "n1", 8, 101)
        _isolate(c, "n1")
        c._on_node(WatchEvent("delete", keys.node("n1"), b"", 0), time.time())  # its agent stopped
        clock = c.clock
        registered: list[int] = []

        def registering_clock() -> float:
            # the event's time is read after the check, before the write: the agent registers then
            if not registered:
                registered.append(store.put(keys.node("n1"), "{}"))
            return clock()

        monkeypatch.setattr(c, "clock", registering_clock)
        with pytest.raises(PermanentError, match=r"^node n1 is isolated but its agent is still registered; "
                                                 r"stop its agent first$"):
            c._forget("n1")
        assert registered, "the hook did not run between the check and the write"
        assert "n1" in c.state.nodes and store.get(keys.state_node("n1")) is not None
        assert c.leadership is not None and not c.leadership.deposed and c.leadership.token is not None

        # the refusal cost the leader nothing: once the agent is gone, the node is forgotten
        store.delete(keys.node("n1"))
        c._forget("n1")
        assert "n1" not in c.state.nodes and store.get(keys.state_node("n1")) is None
    finally:
        _close(c)
