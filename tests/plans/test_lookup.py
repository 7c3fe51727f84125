"""Every lookup-table entry equals a fresh solve of its scenario."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from plans.lookup import LookupTable
from plans.planner import WafPlanner
from plans.table3 import case
from unicron.kernel.errors import InvalidRecord


@pytest.mark.parametrize("unit", ["gpu", "node"], ids=["gpu-units", "node-units"])
def test_every_entry_equals_a_fresh_solve(unit: str) -> None:
    cluster, tasks = case(4)
    planner = WafPlanner(unit=unit)  # type: ignore[arg-type]
    start = planner.plan(cluster, tasks)
    running = [replace(t, current_gpus=start.allocation[t.name]) for t in tasks]
    table = LookupTable(cluster, running, planner)

    smaller = replace(cluster, n_gpus=cluster.n_gpus - cluster.gpus_per_node)
    holders = [t.name for t in running if t.current_gpus > 0]
    assert {k for k, _ in table.entries()} == {None, *holders}
    for faulted in [None, *holders]:
        fresh = WafPlanner(unit=unit).plan(  # type: ignore[arg-type]
            smaller, [replace(t, faulted=t.name == faulted) for t in running]
        )
        entry = table.on_node_lost(faulted)
        assert entry.allocation == fresh.allocation
        assert entry.objective == fresh.objective
        assert entry.changed == fresh.changed
        if faulted is not None:
            assert entry.changed[faulted]  # Eq. 4: the faulted task always pays the transition
    bigger = replace(cluster, n_gpus=cluster.n_gpus + cluster.gpus_per_node)
    joined = WafPlanner(unit=unit).plan(bigger, running)  # type: ignore[arg-type]
    assert table.on_node_joined().allocation == joined.allocation
    assert table.on_node_joined().objective == joined.objective


def test_lookup_is_a_lookup() -> None:
    cluster, tasks = case(2)
    start = WafPlanner().plan(cluster, tasks)
    table = LookupTable(cluster, [replace(t, current_gpus=start.allocation[t.name]) for t in tasks])
    begin = time.perf_counter()
    for _ in range(1000):
        table.on_node_lost("task4")
        table.on_node_joined()
    assert (time.perf_counter() - begin) / 2000 < 1e-3
    with pytest.raises(InvalidRecord, match="holds no GPUs"):
        table.on_node_lost("nobody")


def test_answer_finds_exactly_the_tables_problems_and_lazy_equals_eager() -> None:
    cluster, tasks = case(4)
    start = WafPlanner().plan(cluster, tasks)
    running = [replace(t, current_gpus=start.allocation[t.name]) for t in tasks]
    eager = LookupTable(cluster, running)
    lazy = LookupTable(cluster, running, eager.planner, lazy=True)
    assert lazy.solve_s == 0.0  # nothing solved until asked
    holder = next(t.name for t in running if t.current_gpus > 0)
    smaller = replace(cluster, n_gpus=cluster.n_gpus - cluster.gpus_per_node)
    lost = [replace(t, faulted=t.name == holder) for t in running]
    for table in (eager, lazy):
        found = table.answer(smaller, lost)
        assert found is not None and found.allocation == eager.on_node_lost(holder).allocation
        joined = table.answer(replace(cluster, n_gpus=cluster.n_gpus + cluster.gpus_per_node), running)
        assert joined is not None and joined.allocation == eager.on_node_joined().allocation
        assert table.answer(cluster, running) is None  # the base state itself is not a one-step change
        assert table.answer(smaller, [replace(t, faulted=True) for t in running]) is None
    assert lazy.solve_s > 0.0
