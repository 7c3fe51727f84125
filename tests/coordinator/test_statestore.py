"""The decision state written as what changed (issue 16 item 4): a decision that changes one node
writes that node's entry and the clock, not 1,000 entries; what is stored reads back as the state."""

from __future__ import annotations

import dataclasses
import json

from coordinator import decision as d
from coordinator.decision.state import NodeEntry, NodeState, TaskEntry, TaskPhase
from coordinator.statestore import read_state, state_writes
from coordinator.tasks import parse_task_spec
from unicron.kernel.etcd import Store
from unicron.kernel.keyspace import Keyspace

KEYS = Keyspace("/st")


def _state(nodes: int = 200) -> d.CoreState:
    spec = parse_task_spec({"name": "wide", "command": ["python", "x.py"], "min_gpus": 1}, None)
    st = d.CoreState(now=5.0, counter=9)
    for i in range(nodes):
        st.nodes[f"n{i:03d}"] = NodeEntry(8)
    st.tasks["wide"] = TaskEntry(spec=spec, phase=TaskPhase.RUNNING, generation=2,
                                 placement={f"n{i:03d}": list(range(8 * i, 8 * i + 8)) for i in range(nodes)})
    return st


def test_a_decision_writes_only_the_entries_it_changed() -> None:
    old = _state()
    puts, deletes = state_writes(KEYS, None, old)
    assert len(puts) == 1 + 200 + 1 and deletes == []  # nothing known as written: everything
    new = dataclasses.replace(old, now=6.0, nodes=dict(old.nodes), tasks={}, retired_generation=2)
    new.nodes["n007"] = NodeEntry(8, NodeState.LOST, "agent connection closed")
    puts, deletes = state_writes(KEYS, old, new)
    assert sorted(puts) == [KEYS.state(), KEYS.state_node("n007")]
    assert deletes == [KEYS.state_task("wide")]  # retired
    assert json.loads(puts[KEYS.state()]) == {"now": 6.0, "counter": 9, "retired_generation": 2, "failures": 0,
                                              "gpu_hours": 0.0, "failure_gpu_hours": 0.0, "nodes": {}, "tasks": {}}


def test_what_is_written_reads_back_as_the_state(store: Store) -> None:
    old = _state()
    puts, _ = state_writes(KEYS, None, old)
    for k, v in puts.items():
        store.put(k, v)
    new = dataclasses.replace(old, now=7.0, counter=10, nodes=dict(old.nodes), retired_generation=4)
    new.nodes["n001"] = NodeEntry(8, NodeState.DRAINED, "operator")
    puts, deletes = state_writes(KEYS, old, new)
    for k, v in puts.items():
        store.put(k, v)
    for k in deletes:
        store.delete(k)
    loaded, split, unreadable = read_state(store, KEYS)
    assert split and loaded is not None and unreadable == []
    assert loaded.to_dict() == new.to_dict()


def test_a_state_written_whole_still_loads(store: Store) -> None:
    """An older coordinator wrote the state as one value: it loads, and is reported as not split (so
    the next write writes every entry)."""
    st = _state(3)
    store.put(KEYS.state(), json.dumps(st.to_dict()))
    loaded, split, unreadable = read_state(store, KEYS)
    assert not split and loaded is not None and loaded.to_dict() == st.to_dict() and unreadable == []


def test_an_entry_that_cannot_be_read_costs_only_itself_and_fields_of_a_newer_version_are_left_out(
        store: Store) -> None:
    """Before, one unreadable entry made read_state raise: the new leader started afresh and stopped
    every task. Now it is left out and reported; a task entry with fields this version does not know
    (a newer coordinator wrote it) loads without them."""
    st = _state(3)
    puts, _ = state_writes(KEYS, None, st)
    for k, v in puts.items():
        store.put(k, v)
    newer = json.loads(puts[KEYS.state_task("wide")])
    newer["spec"] = {**newer["spec"], "name": "newer", "priority_class": "high"}
    newer["preemptible"] = True
    store.put(KEYS.state_task("newer"), json.dumps(newer))
    store.put(KEYS.state_task("damaged"), '{"spec": 5}')
    store.put(KEYS.state_node("n9"), "not json")
    store.put(KEYS.state_task("nested"), "[" * 100_000 + "]" * 100_000)  # the parser's recursion runs out
    loaded, split, unreadable = read_state(store, KEYS)
    assert split and loaded is not None
    assert sorted(loaded.nodes) == ["n000", "n001", "n002"] and sorted(loaded.tasks) == ["newer", "wide"]
    assert loaded.tasks["newer"].spec == dataclasses.replace(st.tasks["wide"].spec, name="newer")
    assert loaded.tasks["wide"] == st.tasks["wide"]
    assert [u.key for u in unreadable] == [KEYS.state_node("n9"), KEYS.state_task("damaged"),
                                           KEYS.state_task("nested")]
    assert "nested too deep" in unreadable[2].error
    assert unreadable[1].value == '{"spec": 5}' and "tasks.damaged" in unreadable[1].error


def test_only_active_tasks_placements_get_a_stand_in_node(store: Store) -> None:
    """A node whose entry is unreadable stands in service only for an active task's placement: an ended
    task's (or a restart's relaunching, which may name a node already lost) would put a dead node
    back in service, and the next plan would give it ranks."""
    from tests.coordinator.test_decision import SEV2_KIND, Sim
    sim = Sim()
    sim.join("n0", 2)
    sim.join("n1", 2)
    [assign] = [a for a in sim.submit("old", min_gpus=4, max_gpus=4, recovery="restart") if isinstance(a, d.Assign)]
    sim.ok(assign)
    sim.incident("n1", SEV2_KIND, task="old", rank=2, generation=sim.state.tasks["old"].generation)
    sim.feed(d.TaskCancelled(ts=sim.ts(), task="old"))
    sim.feed(d.NodeLost(ts=sim.ts(), node="n1", reason="host died"))
    assert sim.state.tasks["old"].relaunching == {}  # the cancel ended the restart under way
    keys = Keyspace("/standin")
    puts, _ = state_writes(keys, None, sim.state)
    for k, v in puts.items():
        store.put(k, v)
    store.put(keys.state_node("n1"), "not json")
    loaded, _, unreadable = read_state(store, keys)
    assert loaded is not None and unreadable and "n1" not in loaded.nodes
    spec = parse_task_spec({"name": "new", "command": ["python", "x.py"], "min_gpus": 1, "max_gpus": 3}, None)
    new, _ = sim.core.handle(loaded, d.TaskSubmitted(ts=sim.ts(), spec=spec))
    assert "n1" not in new.tasks["new"].placement
