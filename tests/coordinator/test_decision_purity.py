"""The decision core builds its new state copy-on-write: random event walks check that it never
modifies a state it was given (nor one it returned earlier), and that a state sharing entries with its
predecessors decides exactly what an independent copy of it decides."""

from __future__ import annotations

import json
import random

import pytest

from coordinator.causes import classify
from coordinator.decision import (
    ActionFailed,
    ActionSucceeded,
    CoreState,
    DecisionCore,
    Event,
    IncidentRaised,
    NodeDrained,
    NodeJoined,
    NodeLost,
    NodeUndrained,
    ProgressMade,
    TaskCancelled,
    TaskFinished,
    TaskSubmitted,
    Tick,
    to_dict,
)
from tests.coordinator.test_decision import SEV1_KIND, SEV2_KIND, SEV3_KIND, spec
from unicron.kernel.types import Report

NODES = ["n1", "n2", "n3", "n4"]
TASKS = ["a", "b", "c"]


def _incident(rng: random.Random, state: CoreState, ts: float, n: int) -> IncidentRaised:
    node = rng.choice(NODES)
    method, kind = rng.choice([SEV1_KIND, SEV2_KIND, SEV3_KIND])
    on = [t for t, e in state.tasks.items() if e.placement.get(node)]
    task = rng.choice(on) if on else None
    rank = rng.choice(state.tasks[task].placement[node]) if task else None
    report = Report(method=method, kind=kind, node=node, task=task, rank=rank, source_ts=ts, agent_ts=ts)
    generation = state.tasks[task].generation if task else None
    return IncidentRaised(ts=ts, incident=classify(report, ts, f"i{n}"), generation=generation)


def _event(rng: random.Random, state: CoreState, ts: float, n: int) -> Event:
    """One random event that the state makes meaningful more often than not."""
    outstanding = [(t, e.outstanding) for t, e in sorted(state.tasks.items()) if e.outstanding is not None]
    roll = rng.random()
    node, task = rng.choice(NODES), rng.choice(TASKS)
    if outstanding and roll < 0.35:
        _, o = rng.choice(outstanding)
        if rng.random() < 0.8:
            where = rng.choice(o.waiting) if o.waiting and rng.random() < 0.7 else None
            return ActionSucceeded(ts=ts, action_id=o.action_id, node=where)
        return ActionFailed(ts=ts, action_id=o.action_id, reason="agent said no", node=o.node)
    if roll < 0.5:
        return _incident(rng, state, ts, n)
    if roll < 0.6 and task in state.tasks:
        return ProgressMade(ts=ts, task=task, step=n, generation=state.tasks[task].generation)
    choices: list[Event] = [
        NodeJoined(ts=ts, node=node, gpus=rng.choice([4, 8])),
        NodeLost(ts=ts, node=node, reason="lease expired"),
        NodeDrained(ts=ts, node=node),
        NodeUndrained(ts=ts, node=node),
        TaskSubmitted(ts=ts, spec=spec(task, min_gpus=rng.choice([1, 4]))),
        TaskFinished(ts=ts, task=task),
        TaskCancelled(ts=ts, task=task),
        Tick(ts=ts + rng.choice([0.0, 1000.0])),  # sometimes past every deadline
    ]
    return rng.choice(choices)


@pytest.mark.parametrize("seed", range(12))
def test_handle_never_modifies_its_input_and_decides_as_an_independent_copy(seed: int) -> None:
    rng = random.Random(seed)
    core = DecisionCore()
    state = core.initial_state()
    for node in NODES[:3]:
        state, _ = core.handle(state, NodeJoined(ts=0.0, node=node, gpus=8))
    history: list[tuple[CoreState, str]] = []
    acted = 0
    for n in range(150):
        event = _event(rng, state, float(n + 1), n)
        before = json.dumps(state.to_dict(), sort_keys=True)
        new, actions = core.handle(state, event)
        # the given state is unchanged ...
        assert json.dumps(state.to_dict(), sort_keys=True) == before, f"step {n}: {event} modified its input"
        # ... and a copy sharing nothing with it decides the same
        twin, twin_actions = core.handle(CoreState.from_dict(json.loads(before)), event)
        assert twin.to_dict() == new.to_dict(), f"step {n}: {event}"
        assert [to_dict(a) for a in twin_actions] == [to_dict(a) for a in actions]
        history.append((state, before))
        acted += bool(actions)
        state = new
    # no later decision reached back into an earlier state through a shared entry
    for i, (old, text) in enumerate(history):
        assert json.dumps(old.to_dict(), sort_keys=True) == text, f"state {i} changed after it was replaced"
    assert acted >= 10  # the walk exercised decisions, not only no-ops
