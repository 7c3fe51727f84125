"""The Figure 10(c) baselines and the planner on the paper's Table 3 cases."""

from __future__ import annotations

import pytest

from plans.baselines import BASELINES, EquallyPlanner, SizedPlanner, WeightedPlanner
from plans.planner import WafPlanner
from plans.problem import task_curve
from plans.table3 import CASES, case


@pytest.mark.parametrize("name", list(BASELINES))
@pytest.mark.parametrize("number", list(CASES))
def test_baselines_give_runnable_allocations_within_the_cluster(name: str, number: int) -> None:
    cluster, tasks = case(number)
    planner = BASELINES[name]()
    result = planner.plan(cluster, tasks)
    assert result.used_gpus <= cluster.n_gpus
    for t in tasks:
        x = result.allocation[t.name]
        assert x == 0 or task_curve(t, cluster, planner.cost).at(x) > 0
    # Rounding leaves less than the smallest step any task could still take.
    assert cluster.n_gpus - result.used_gpus < 32


def test_each_baseline_follows_its_own_share() -> None:
    cluster, tasks = case(4)  # sizes 1.3B x3, 7B x2, 13B; weights rising 0.5 .. 2.0
    equal = EquallyPlanner().plan(cluster, tasks).allocation
    weighted = WeightedPlanner().plan(cluster, tasks).allocation
    sized = SizedPlanner().plan(cluster, tasks).allocation
    assert weighted["task6"] > weighted["task1"]
    assert sized["task6"] > sized["task1"]
    assert max(equal.values()) - min(equal.values()) <= 8


@pytest.mark.parametrize("number", list(CASES))
def test_planner_waf_is_at_least_every_baselines_on_table_3(number: int) -> None:
    cluster, tasks = case(number)
    ours = WafPlanner().plan(cluster, tasks)
    for name, cls in BASELINES.items():
        theirs = cls().plan(cluster, tasks)
        assert ours.total_waf >= theirs.total_waf * (1 - 1e-12), name
