"""The pruned max-plus programme (Eq. 5) against brute-force enumeration of Eq. 3."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plans import dp
from plans.hardware import gpu_type
from plans.models import GPT3
from plans.planner import WafPlanner
from plans.problem import ClusterSpec, TaskDemand, task_curve, waf_at
from plans.waf import all_choices, choices, gain_table, waf_table


@st.composite
def instances(draw: st.DrawFn) -> tuple[list[dp.Choices], list[np.ndarray], list[np.ndarray], int]:
    """Random Eq. 3 instances, built from raw throughput tables through Eq. 2-4.

    Small integer tables make exact ties common, which is where the tie-break is tested; "near"
    tables (integers plus multiples of 1e-4) catch pruning that drops almost-equal choices.
    """
    capacity = draw(st.integers(0, 9))
    m = draw(st.integers(1, 4))
    mode = draw(st.sampled_from(["int", "near", "float"]))
    integers = mode != "float"
    d_running = draw(st.sampled_from([1.0, 2.0, 10.0])) if integers else draw(st.floats(0.1, 100.0))
    pruned, gains, changes = [], [], []
    for _ in range(m):
        size = capacity + 1
        values: st.SearchStrategy[float] = st.integers(0, 6).map(float) if integers else st.floats(0.0, 1e3)
        raw = draw(st.lists(values, min_size=size, max_size=size))
        throughput = np.array(raw, dtype=np.float64)
        if mode == "near":
            throughput += 1e-4 * np.array(draw(st.lists(st.integers(0, 2), min_size=size, max_size=size)))
        throughput[0] = 0.0
        min_units = draw(st.integers(0, capacity + 1))
        weight = float(draw(st.sampled_from([0.5, 1.0, 2.0])))
        current = draw(st.integers(0, capacity + 2))
        faulted = draw(st.booleans())
        d_transition = float(draw(st.sampled_from([0.0, 1.0, 3.0, 50.0])))
        f = waf_table(throughput, weight, min_units)
        f_now = float(f[current]) if current <= capacity else weight * 3.0
        g, chg = gain_table(f, current, faulted, f_now, d_running, d_transition)
        pruned.append(choices(g, chg))
        gains.append(g)
        changes.append(chg)
    return pruned, gains, changes, capacity


def _assert_same(got: dp.Solution, want: dp.Solution, gains: list[np.ndarray], capacity: int) -> None:
    scale = sum(float(np.abs(g).max()) for g in gains) + 1.0
    assert got.value == pytest.approx(want.value, rel=1e-9, abs=1e-9 * scale)
    assert got.changes == want.changes
    assert sum(got.units) <= capacity
    # The reported value is the allocation's own sum of G.
    assert got.value == pytest.approx(sum(float(g[k]) for g, k in zip(gains, got.units, strict=True)))


@settings(max_examples=400, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances())
def test_pruned_programme_equals_brute_force(case: tuple) -> None:  # type: ignore[type-arg]
    pruned, gains, changes, capacity = case
    want = dp.brute_force(gains, changes, capacity)
    _assert_same(dp.solve(pruned, capacity), want, gains, capacity)
    _assert_same(
        dp.solve([all_choices(g, c) for g, c in zip(gains, changes, strict=True)], capacity),
        want,
        gains,
        capacity,
    )


def _eq3_tables(
    cluster: ClusterSpec, tasks: list[TaskDemand], unit: int
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """G(t, k) for every k, straight from the definitions of Eq. 2-4 (no shared table code)."""
    planner = WafPlanner()
    d_running = planner.reliability.d_running_s(cluster.n_gpus)
    gains, changes = [], []
    for t in tasks:
        curve = task_curve(t, cluster, planner.cost)
        g, c = [], []
        for k in range(cluster.n_gpus // unit + 1):
            moved = k * unit != t.current_gpus or t.faulted
            g.append(
                waf_at(t, curve, k * unit) * d_running
                - waf_at(t, curve, t.current_gpus) * t.transition_s * moved
            )
            c.append(int(moved))
        gains.append(np.array(g))
        changes.append(np.array(c))
    return gains, changes


@settings(max_examples=60, deadline=None, database=None)
@given(
    st.sampled_from(["gpu", "node"]),
    st.integers(0, 40),
    st.lists(
        st.tuples(
            st.sampled_from(["1.3B", "7B", "13B"]),
            st.sampled_from([0.5, 1.0, 1.7]),
            st.integers(0, 24),
            st.integers(0, 24),
            st.booleans(),
            st.sampled_from([0.0, 300.0, 1e6]),
        ),
        min_size=1,
        max_size=3,
    ),
)
def test_planner_equals_brute_force_on_gpt_tasks(unit: str, n: int, specs: list[tuple]) -> None:  # type: ignore[type-arg]
    cluster = ClusterSpec(gpu_type("A800"), n)
    tasks = [
        TaskDemand(f"t{i}", GPT3[size], weight=w, min_gpus=mn, current_gpus=cur, faulted=bad, transition_s=tr)
        for i, (size, w, mn, cur, bad, tr) in enumerate(specs)
    ]
    planner = WafPlanner(unit=unit)  # type: ignore[arg-type]
    size = planner.unit_size(cluster)
    gains, changes = _eq3_tables(cluster, tasks, size)
    want = dp.brute_force(gains, changes, n // size)
    for prune in (True, False):  # sparse choices, and every allocation (the dense programme)
        got = dp.solve(planner.problem(cluster, tasks, prune=prune), n // size)
        _assert_same(got, want, gains, n // size)
    result = planner.plan(cluster, tasks)
    assert result.objective == pytest.approx(want.value, rel=1e-9, abs=1.0)
    assert sum(result.changed.values()) == want.changes


def test_ties_prefer_fewer_changes_then_smaller_allocations() -> None:
    # Task 0 holds 2 units; moving it to 1 unit frees one for task 1 with exactly the same total.
    g0 = np.array([0.0, 5.0, 10.0])
    c0 = np.array([1, 1, 0])
    g1 = np.array([0.0, 5.0, 5.0])
    c1 = np.array([0, 1, 1])
    tasks = [choices(g0, c0), choices(g1, c1)]
    sol = dp.solve(tasks, 2)
    assert sol.units == (2, 0)
    assert sol.changes == 0
    assert sol == dp.brute_force([g0, g1], [c0, c1], 2)
