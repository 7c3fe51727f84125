"""The coordinator's lookup table (coordinator.lookup): a node lost or joined after a plan is answered
from the table built for that plan, with the plan a fresh solve gives; anything else is solved."""

from __future__ import annotations

import time

from coordinator import decision as d
from coordinator.allocation import WafAllocator
from coordinator.lookup import PlanLookup
from sim.workload import case

SPECS = case(5).tasks  # six GPT tasks of Table 3's Case #5 (1.3B to 13B), with model descriptions
GPN = 8


def _allocators(lookup: PlanLookup) -> tuple[WafAllocator, WafAllocator]:
    return WafAllocator("A800", lookup=lookup), WafAllocator("A800")


def test_a_node_lost_or_joined_after_a_plan_is_a_hit_with_the_solved_answer() -> None:
    lookup = PlanLookup(background=False)
    alloc, fresh = _allocators(lookup)
    counts = alloc.allocate(SPECS, 96, GPN, {}, set())
    assert (lookup.hits, lookup.misses) == (0, 1)  # nothing built yet
    lookup.build_pending()
    holder = next(n for n, c in counts.items() if c > 0)
    lost = alloc.allocate(SPECS, 96 - GPN, GPN, counts, {holder})
    assert (lookup.hits, lookup.misses) == (1, 1)
    assert lost == fresh.allocate(SPECS, 96 - GPN, GPN, counts, {holder})
    assert alloc.last_plan is not None and alloc.last_plan.allocation == lost
    # a new plan asked for a new table; the join from *that* state is a hit too
    lookup.build_pending()
    joined = alloc.allocate(SPECS, 96, GPN, lost, set())
    assert (lookup.hits, lookup.misses) == (2, 1)
    assert joined == fresh.allocate(SPECS, 96, GPN, lost, set())


def test_problems_the_table_does_not_hold_are_solved() -> None:
    lookup = PlanLookup(background=False)
    alloc, fresh = _allocators(lookup)
    counts = alloc.allocate(SPECS, 96, GPN, {}, set())
    lookup.build_pending()
    two = sorted(n for n, c in counts.items() if c > 0)[:2]
    # a node shared by two tasks, and two nodes at once: not one-step changes
    assert alloc.allocate(SPECS, 96 - GPN, GPN, counts, set(two)) == fresh.allocate(SPECS, 96 - GPN, GPN, counts, set(two))
    lookup.build_pending()
    assert alloc.allocate(SPECS, 96 - 3 * GPN, GPN, counts, set()) == fresh.allocate(SPECS, 96 - 3 * GPN, GPN, counts, set())
    assert (lookup.hits, lookup.misses) == (0, 3)


def test_new_measurements_make_the_table_stale_and_rebuild_it() -> None:
    lookup = PlanLookup(background=False)
    alloc, fresh = _allocators(lookup)
    counts = alloc.allocate(SPECS, 96, GPN, {}, set())
    lookup.build_pending()
    assert alloc.ground(transition_s={SPECS[0].name: 5.0})
    assert not alloc.ground(transition_s={SPECS[0].name: 5.0})  # unchanged: nothing to rebuild
    fresh.ground(transition_s={SPECS[0].name: 5.0})
    holder = next(n for n, c in counts.items() if c > 0)
    before = lookup.hits
    lookup.build_pending()  # the rebuild ground() asked for, with the measured D_transition
    assert alloc.allocate(SPECS, 96 - GPN, GPN, counts, {holder}) == fresh.allocate(SPECS, 96 - GPN, GPN, counts, {holder})
    assert lookup.hits == before + 1


def test_the_background_builder_fills_the_table_without_the_caller_waiting() -> None:
    lookup = PlanLookup(background=True)
    lookup.start()
    try:
        alloc, fresh = _allocators(lookup)
        counts = alloc.allocate(SPECS, 96, GPN, {}, set())
        deadline = time.monotonic() + 30
        while lookup.builds == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert lookup.builds == 1
        holder = next(n for n, c in counts.items() if c > 0)
        assert alloc.allocate(SPECS, 96 - GPN, GPN, counts, {holder}) == fresh.allocate(SPECS, 96 - GPN, GPN, counts, {holder})
        assert lookup.hits == 1
    finally:
        lookup.stop()
    assert lookup._thread is None


def test_the_decision_core_answers_a_node_loss_from_the_table() -> None:
    """Through DecisionCore: the same actions as a core that always solves, and the loss is a hit."""
    lookup = PlanLookup(background=False)
    cores = [d.DecisionCore(allocator=WafAllocator("A800", lookup=lookup)), d.DecisionCore(allocator=WafAllocator("A800"))]
    states = [c.initial_state() for c in cores]
    nodes = [f"n{i}" for i in range(12)]
    events: list[d.Event] = [d.NodeJoined(ts=0.0, node=n, gpus=GPN) for n in nodes]
    events += [d.TaskSubmitted(ts=0.0, spec=s) for s in SPECS]
    for event in events:
        states = [c.handle(s, event)[0] for c, s in zip(cores, states, strict=True)]
        lookup.build_pending()
    for _, entry in sorted(states[0].tasks.items()):  # confirm every assignment
        if entry.outstanding is not None:
            ok = d.ActionSucceeded(ts=1.0, action_id=entry.outstanding.action_id)
            states = [c.handle(s, ok)[0] for c, s in zip(cores, states, strict=True)]
    lookup.build_pending()
    victim = next(n for n in nodes if any(e.placement.get(n) for e in states[0].tasks.values()))
    hits = lookup.hits
    out = [c.handle(s, d.NodeLost(ts=2.0, node=victim, reason="lease expired")) for c, s in zip(cores, states, strict=True)]
    assert lookup.hits == hits + 1
    assert [d.to_dict(a) for a in out[0][1]] == [d.to_dict(a) for a in out[1][1]]
    assert any(isinstance(a, (d.Assign, d.ResizeInPlace)) for a in out[0][1])  # the loss moved tasks
