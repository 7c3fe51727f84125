"""The planner interface and the WAF planner (paper §5: Eq. 3 solved by the dynamic programme of Eq. 5)."""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from typing import Literal

import numpy as np
import numpy.typing as npt

from plans import dp
from plans.problem import ClusterSpec, TaskDemand, check_names, task_curve, waf_at
from plans.result import PlanResult, evaluate
from plans.throughput import CostModel
from plans.waf import ReliabilityModel, all_choices, choices, gain_table, waf_table
from unicron.kernel.errors import InvalidRecord

Unit = Literal["gpu", "node"]


class Planner(abc.ABC):
    """Anything that turns a cluster and its tasks into an allocation."""

    name: str = "planner"

    def __init__(
        self, unit: Unit = "gpu", reliability: ReliabilityModel | None = None, cost: CostModel | None = None
    ) -> None:
        if unit not in ("gpu", "node"):
            raise InvalidRecord(f"unit: expected 'gpu' or 'node', got {unit!r}")
        self.unit: Unit = unit
        self.reliability = reliability or ReliabilityModel()
        self.cost = cost or CostModel()

    def unit_size(self, cluster: ClusterSpec) -> int:
        """GPUs per allocation unit."""
        return 1 if self.unit == "gpu" else cluster.gpus_per_node

    @abc.abstractmethod
    def plan(self, cluster: ClusterSpec, tasks: Sequence[TaskDemand]) -> PlanResult:
        """An allocation for ``tasks`` on ``cluster`` (tasks that cannot meet their minimum get 0)."""


class WafPlanner(Planner):
    """Maximises Eq. 3 exactly: each task's reward table is pruned to its useful allocations
    (``plans.waf.choices``) and combined by the max-plus recurrence of Eq. 5 (``plans.dp``)."""

    name = "unicron"

    # extreme inputs overflow to inf or NaN: refused below with one line, not warned about on the way
    @np.errstate(over="ignore", invalid="ignore")
    def problem(
        self, cluster: ClusterSpec, tasks: Sequence[TaskDemand], prune: bool = True
    ) -> list[dp.Choices]:
        """Each task's candidate allocations and rewards, in units, for ``dp.solve`` (``prune=False``:
        every allocation, the dense O(m·n²) programme)."""
        unit = self.unit_size(cluster)
        capacity = cluster.n_gpus // unit
        d_running = self.reliability.d_running_s(cluster.n_gpus)
        out = []
        for task in tasks:
            curve = task_curve(task, cluster, self.cost)
            current = task.current_gpus // unit if task.current_gpus % unit == 0 else None
            units: npt.NDArray[np.int64] | None = None
            if prune:
                # Only 0, the present allocation and the counts some configuration uses exactly:
                # everywhere else T = 0 and G(k) <= G(0) (docs/planner.md).
                points = {x // unit for x in curve.gpus if x % unit == 0 and x // unit <= capacity} | {0}
                if current is not None and current <= capacity:
                    points.add(current)
                units = np.array(sorted(points), dtype=np.int64)
                throughput = np.array([curve.at(int(k) * unit) for k in units])
            else:
                throughput = curve.dense(capacity, unit)
            f = waf_table(throughput, task.weight, -(-task.min_gpus // unit), units)
            waf_now = waf_at(task, curve, task.current_gpus)
            g, chg = gain_table(f, current, task.faulted, waf_now, d_running, task.transition_s, units)
            # the programme compares and sums rewards: one that overflowed would be NaN there
            if not np.isfinite(g).all():
                raise InvalidRecord(
                    f"task[{task.name}]: its reward G overflows a float (weight={task.weight:g}, "
                    f"transition_s={task.transition_s:g}, D_running={d_running:g} s); use realistic values"
                )
            out.append(choices(g, chg, units) if prune else all_choices(g, chg))
        if not math.isfinite(dp.epsilon([c.gains for c in out])):
            raise InvalidRecord("tasks: their rewards G together overflow a float; use realistic weights and rates")
        return out

    def plan(self, cluster: ClusterSpec, tasks: Sequence[TaskDemand]) -> PlanResult:
        check_names(tasks)
        unit = self.unit_size(cluster)
        solution = dp.solve(self.problem(cluster, tasks), cluster.n_gpus // unit)
        allocation = {t.name: k * unit for t, k in zip(tasks, solution.units, strict=True)}
        return evaluate(self.name, cluster, tasks, allocation, self.reliability, self.cost)
