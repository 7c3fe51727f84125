"""Eq. 2's threshold, Eq. 3-4's transition penalty, and D_running from the failure rate."""

from __future__ import annotations

import numpy as np
import pytest

from plans.hardware import gpu_type
from plans.models import GPT3
from plans.planner import WafPlanner
from plans.problem import ClusterSpec, TaskDemand, task_curve, waf_at
from plans.throughput import Calibration, CostModel
from plans.waf import ReliabilityModel, waf_table
from unicron.kernel.errors import InvalidRecord

A800 = gpu_type("A800")


def test_waf_is_zero_below_the_minimum_and_weighted_above() -> None:
    t = np.array([0.0, 1.0, 2.0, 3.0, 4.0])
    f = waf_table(t.copy(), weight=1.5, min_units=3)
    assert list(f) == [0.0, 0.0, 0.0, 4.5, 6.0]


def test_planner_never_gives_a_task_fewer_gpus_than_its_minimum() -> None:
    cluster = ClusterSpec(A800, 64)
    # Alone, the 7B task would run best on all 64; with min_gpus=64 for the other task it must
    # either get 64 (and the 7B nothing) or nothing at all.
    tasks = [
        TaskDemand("small", GPT3["7B"], weight=1.0),
        TaskDemand("big", GPT3["13B"], weight=1.0, min_gpus=64),
    ]
    result = WafPlanner().plan(cluster, tasks)
    curve = task_curve(tasks[1], cluster, CostModel())
    assert result.allocation["big"] in (0, 64)
    for x in (8, 16, 32, 40):
        assert curve.at(x) > 0  # runnable there, yet Eq. 2 counts it as nothing
        assert waf_at(tasks[1], curve, x) == 0.0
    assert waf_at(tasks[1], curve, 64) == curve.at(64)


def test_a_task_never_gets_more_than_its_max_gpus_and_the_rest_goes_to_the_others() -> None:
    tasks = [TaskDemand("capped", GPT3["7B"], max_gpus=8), TaskDemand("other", GPT3["7B"])]
    curve = task_curve(tasks[0], ClusterSpec(A800, 24), CostModel())
    assert curve.gpus and max(curve.gpus) == 8
    # uncapped the two would split 16 + 8
    assert WafPlanner().plan(ClusterSpec(A800, 24), tasks).allocation == {"capped": 8, "other": 16}
    with pytest.raises(InvalidRecord, match="max_gpus"):
        TaskDemand("bad", GPT3["7B"], min_gpus=8, max_gpus=4)


def _single(transition_s: float, gain: float, faulted: bool = False) -> dict[str, int]:
    """A 7B task running healthy on 16 GPUs when 16 more appear; calibrated so that 32 GPUs give
    exactly ``gain`` times more throughput than 16."""
    t16 = 2.0e15
    task = TaskDemand(
        "job",
        GPT3["7B"],
        current_gpus=16,
        faulted=faulted,
        transition_s=transition_s,
        calibration=Calibration({16: t16, 32: t16 * (1 + gain)}),
    )
    cluster = ClusterSpec(A800, 32)
    return WafPlanner().plan(cluster, [task]).allocation


def test_transition_penalty_keeps_a_healthy_task_for_a_small_gain() -> None:
    # D_running(32) = 3600 / (32 * rate) = 288 h ~ 1.04e6 s; the move pays F(16) * 300 s, so it is
    # worth it only above a gain of about 300 / 1.04e6 = 2.9e-4.
    assert _single(300.0, gain=1e-4) == {"job": 16}
    assert _single(300.0, gain=1e-2) == {"job": 32}
    assert _single(3e6, gain=1e-2) == {"job": 16}  # a slow transition makes even 1 % not worth it


def test_a_faulted_task_pays_the_transition_anyway_and_takes_the_gain() -> None:
    assert _single(300.0, gain=1e-4, faulted=True) == {"job": 32}


def test_a_long_transition_keeps_healthy_tasks_in_place_when_another_loses_a_node() -> None:
    cluster = ClusterSpec(A800, 128)
    tasks = [TaskDemand(f"t{i}", GPT3[s]) for i, s in enumerate(["1.3B", "7B", "7B", "13B"])]
    first = WafPlanner().plan(cluster, tasks)

    def after_losing_a_node_of_t3(transition_s: float) -> tuple[set[str], float]:
        running = [
            TaskDemand(
                t.name,
                t.model,
                current_gpus=first.allocation[t.name],
                faulted=t.name == "t3",
                transition_s=transition_s,
            )
            for t in tasks
        ]
        plan = WafPlanner().plan(ClusterSpec(A800, 120), running)
        return {name for name, changed in plan.changed.items() if changed}, plan.total_waf

    free_moved, free_waf = after_losing_a_node_of_t3(0.0)
    slow_moved, slow_waf = after_losing_a_node_of_t3(10 * 3600.0)
    assert slow_moved == {"t3"}  # only the faulted task is reconfigured
    assert free_moved > slow_moved  # free moves reshuffle a healthy task too ...
    assert free_waf > slow_waf  # ... because that gives more WAF


def test_d_running_falls_with_cluster_size_and_learns_from_incidents() -> None:
    r = ReliabilityModel(gpu_failure_rate_per_hour=1e-4)
    assert r.d_running_s(128) == pytest.approx(3600 / (128 * 1e-4))
    assert r.d_running_s(256) == pytest.approx(r.d_running_s(128) / 2)
    worse = r.observe(incidents=10, gpu_hours=1000.0)
    assert worse.gpu_failure_rate_per_hour > r.gpu_failure_rate_per_hour
    better = r.observe(incidents=0, gpu_hours=1e6)
    assert better.gpu_failure_rate_per_hour < r.gpu_failure_rate_per_hour
    with pytest.raises(InvalidRecord, match="gpu_failure_rate_per_hour"):
        ReliabilityModel(gpu_failure_rate_per_hour=0.0)
