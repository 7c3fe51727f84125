"""``NodeForgotten`` (``unicron forget``): a node retired for good leaves the decision state.

Before, a node lost or isolated for good (hardware swapped, renamed) kept its entry for ever: listed
by ``unicron nodes``, written by every full state write and walked by every decision.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from coordinator.decision import (
    Assign,
    CoreState,
    NodeDrained,
    NodeForgotten,
    NodeJoined,
    NodeLost,
    NodeState,
    from_dict,
    to_dict,
)
from tests.coordinator.test_decision import SEV1_KIND, Sim, one, running_cluster
from unicron.kernel.errors import PermanentError


def test_an_isolated_node_is_forgotten_and_its_name_joins_again_as_a_new_node() -> None:
    sim = running_cluster({"n0": 8, "n1": 8}, {"a": {"min_gpus": 8}})
    sim.progress("a", 5)
    sim.incident("n1", SEV1_KIND)
    assert sim.state.nodes["n1"].status is NodeState.ISOLATED and "n1" not in sim.state.tasks["a"].placement
    before = sim.state
    actions = sim.feed(NodeForgotten(ts=sim.ts(), node="n1"))
    assert actions == [] and "n1" not in sim.state.nodes
    assert "n1" in before.nodes  # the core's input is unchanged
    assert CoreState.from_dict(json.loads(json.dumps(sim.state.to_dict()))).nodes.keys() == {"n0"}
    # the name registering again is a new node, in service (an isolation would need an undrain)
    sim.join("n1", 4)
    assert (sim.state.nodes["n1"].status, sim.state.nodes["n1"].gpus) == (NodeState.UP, 4)


def test_a_lost_node_and_a_drained_one_are_forgotten() -> None:
    sim = running_cluster({"n0": 8, "n1": 8, "n2": 8}, {"a": {"min_gpus": 8}})
    sim.feed(NodeLost(ts=sim.ts(), node="n1", reason="agent lease expired"))
    sim.feed(NodeDrained(ts=sim.ts(), node="n2"))  # the daemon refuses it while its agent is registered
    for node in ("n1", "n2"):
        sim.feed(NodeForgotten(ts=sim.ts(), node=node))
    assert sim.state.nodes.keys() == {"n0"}


def test_an_up_node_is_refused() -> None:
    sim = running_cluster({"n0": 8, "n3": 8}, {"a": {"min_gpus": 8}})
    state = sim.state
    with pytest.raises(PermanentError, match=r"^node n3 is up; drain it and stop its agent first$"):
        sim.feed(NodeForgotten(ts=sim.ts(), node="n3"))
    assert sim.state is state and "n3" in sim.state.nodes


def test_a_node_a_task_still_names_is_refused() -> None:
    """The guard for a node out of service that a task still refers to (the core moves tasks off a
    lost node in the same decision, so the state is built here): forgotten, the task would keep
    ranks on a node no plan knows."""
    sim = running_cluster({"n0": 8, "n1": 8}, {"a": {"min_gpus": 16}})
    assert "n1" in sim.state.tasks["a"].placement
    lost = dataclasses.replace(sim.state.nodes["n1"], status=NodeState.LOST, reason="test")
    sim.state = dataclasses.replace(sim.state, nodes={**sim.state.nodes, "n1": lost})
    with pytest.raises(PermanentError, match=r"^node n1 still holds task\(s\) a; wait until"):
        sim.feed(NodeForgotten(ts=sim.ts(), node="n1"))
    assert "n1" in sim.state.nodes


def test_an_unknown_node_is_refused() -> None:
    sim = Sim()
    with pytest.raises(PermanentError, match="no node 'nx' to forget"):
        sim.feed(NodeForgotten(ts=sim.ts(), node="nx"))


def test_forgetting_does_not_replan_or_move_tasks() -> None:
    sim = running_cluster({"n0": 8, "n1": 8}, {"a": {"min_gpus": 8}, "b": {"min_gpus": 8}})
    sim.feed(NodeLost(ts=sim.ts(), node="n1", reason="power"))
    placement = {t: dict(e.placement) for t, e in sim.state.tasks.items()}
    assert sim.feed(NodeForgotten(ts=sim.ts(), node="n1")) == []
    assert {t: dict(e.placement) for t, e in sim.state.tasks.items()} == placement
    # a new node of the name is planned on as any join
    acts = sim.feed(NodeJoined(ts=sim.ts(), node="n1", gpus=8))
    assert one(acts, Assign).placement


def test_the_event_round_trips_as_json() -> None:
    event = NodeForgotten(ts=3.5, node="n7")
    assert from_dict(json.loads(json.dumps(to_dict(event)))) == event
