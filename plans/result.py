"""What a planner returns, and how any allocation is scored with Eq. 2-4 (so baselines are scored alike)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from plans.problem import ClusterSpec, TaskDemand, task_curve, waf_at
from plans.throughput import CostModel, ParallelConfig
from plans.waf import ReliabilityModel


@dataclass(frozen=True)
class PlanResult:
    """An allocation of GPUs to tasks with each task's configuration and Eq. 2-4 terms."""

    planner: str
    """Which planner produced it."""
    n_gpus: int
    """n', the GPUs the plan was made for."""
    allocation: dict[str, int]
    """GPUs per task (0: not scheduled)."""
    configs: dict[str, ParallelConfig | None]
    """Megatron configuration per task (None when not scheduled, or only measured)."""
    throughput: dict[str, float]
    """T(t, x'), achieved aggregate FLOP/s."""
    waf: dict[str, float]
    """F(t, x'), Eq. 2."""
    gain: dict[str, float]
    """G(t, x'), Eq. 3, FLOP (WAF x seconds)."""
    changed: dict[str, bool]
    """Eq. 4's indicator: the task is reconfigured or restarted."""
    objective: float
    """Σ G, the value of Eq. 3."""
    d_running_s: float
    """D_running(n') used, seconds."""

    @property
    def total_waf(self) -> float:
        return sum(self.waf.values())

    @property
    def used_gpus(self) -> int:
        return sum(self.allocation.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "planner": self.planner,
            "n_gpus": self.n_gpus,
            "used_gpus": self.used_gpus,
            "objective": self.objective,
            "total_waf": self.total_waf,
            "d_running_s": self.d_running_s,
            "tasks": {
                name: {
                    "gpus": self.allocation[name],
                    "config": None if self.configs[name] is None else asdict(self.configs[name]),  # type: ignore[arg-type]
                    "throughput_flops": self.throughput[name],
                    "waf": self.waf[name],
                    "gain": self.gain[name],
                    "changed": self.changed[name],
                }
                for name in self.allocation
            },
        }


def evaluate(
    planner: str,
    cluster: ClusterSpec,
    tasks: Sequence[TaskDemand],
    allocation: Mapping[str, int],
    reliability: ReliabilityModel,
    cost: CostModel,
) -> PlanResult:
    """Score an allocation (GPUs per task) with Eq. 2-4 on this cluster."""
    d_running = reliability.d_running_s(cluster.n_gpus)
    alloc, configs, thr, waf, gain, changed = {}, {}, {}, {}, {}, {}
    for task in tasks:
        curve = task_curve(task, cluster, cost)
        x = int(allocation[task.name])
        f = waf_at(task, curve, x)
        is_change = x != task.current_gpus or task.faulted
        alloc[task.name] = x
        configs[task.name] = curve.config_at(x) if f > 0 else None
        thr[task.name] = curve.at(x)
        waf[task.name] = f
        gain[task.name] = (
            f * d_running - waf_at(task, curve, task.current_gpus) * task.transition_s * is_change
        )
        changed[task.name] = is_change
    return PlanResult(
        planner, cluster.n_gpus, alloc, configs, thr, waf, gain, changed, sum(gain.values()), d_running
    )
