"""The planning problem: a cluster, the tasks that want it, and the per-task quantities of Eq. 2-4."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from plans.hardware import GpuType
from plans.models import ModelSpec
from plans.throughput import Calibration, CostModel, ThroughputCurve, calibrate, model_curve
from unicron.kernel.errors import InvalidRecord

#: Default D_transition, seconds, until the coordinator has measured the task's own.
DEFAULT_TRANSITION_S = 300.0


#: the most GPUs a cluster may have, far above any real one: the planner's tables are sized by it, and
#: 10**100 GPUs was a numpy "dimension exceeded" traceback (a task's counts need no bound: the cluster's
#: size caps what it is planned)
MAX_CLUSTER_GPUS = 2**24


def _count(owner: str, field: str, value: object, minimum: int, maximum: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRecord(f"{owner}.{field}: expected an integer, got {value!r}")
    if value < minimum:
        raise InvalidRecord(f"{owner}.{field}: must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise InvalidRecord(f"{owner}.{field}: must be at most {maximum}, got {value}")


@dataclass(frozen=True)
class ClusterSpec:
    """The GPUs available after the reconfiguration (n' of Eq. 3)."""

    gpu_type: GpuType
    """Accelerator model of every GPU."""
    n_gpus: int
    """Healthy GPUs available to the tasks."""
    gpus_per_node: int = 8
    """GPUs per node: TP stays inside a node and node units are this many GPUs."""

    def __post_init__(self) -> None:
        _count("cluster", "n_gpus", self.n_gpus, 0, MAX_CLUSTER_GPUS)
        _count("cluster", "gpus_per_node", self.gpus_per_node, 1, MAX_CLUSTER_GPUS)


@dataclass(frozen=True)
class TaskDemand:
    """One training task as the planner sees it."""

    name: str
    """Unique task name."""
    model: ModelSpec
    """Model shape and global batch."""
    weight: float = 1.0
    """w(t), the task's priority; the paper recommends 0.5 to 2.0."""
    min_gpus: int = 1
    """T_necessary(t): the task only counts (F > 0) with at least this many GPUs."""
    current_gpus: int = 0
    """x_i, the GPUs the task holds now (0: not running)."""
    faulted: bool = False
    """A worker of the task has failed (Eq. 4: it pays the transition whatever it gets)."""
    transition_s: float = DEFAULT_TRANSITION_S
    """D_transition for this task, seconds (an estimate until measured)."""
    calibration: Calibration | None = None
    """Measured throughput, if the task has run."""
    tp: int | None = None
    """Pin tensor parallelism (a task launched with a fixed layout); None: searched."""
    pp: int | None = None
    """Pin pipeline parallelism; None: searched. With ``tp`` pinned too only DP is elastic."""
    micro_batch: int | None = None
    """Pin the micro-batch size; None: searched."""
    max_gpus: int | None = None
    """The most GPUs the task can use (T = 0 above it); None: no limit."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidRecord(f"task.name: expected a non-empty string, got {self.name!r}")
        owner = f"task[{self.name}]"
        if not isinstance(self.weight, int | float) or not math.isfinite(self.weight) or self.weight <= 0:
            raise InvalidRecord(f"{owner}.weight: must be a finite number > 0, got {self.weight!r}")
        _count(owner, "min_gpus", self.min_gpus, 0)
        _count(owner, "current_gpus", self.current_gpus, 0)
        for field in ("tp", "pp", "micro_batch"):
            if getattr(self, field) is not None:
                _count(owner, field, getattr(self, field), 1)
        if self.max_gpus is not None:
            _count(owner, "max_gpus", self.max_gpus, max(self.min_gpus, 1))
        if not isinstance(self.transition_s, int | float) or not 0 <= self.transition_s < math.inf:
            raise InvalidRecord(
                f"{owner}.transition_s: must be a finite number >= 0, got {self.transition_s!r}"
            )


def check_names(tasks: Sequence[TaskDemand]) -> None:
    seen: set[str] = set()
    for t in tasks:
        if t.name in seen:
            raise InvalidRecord(f"tasks: duplicate task name {t.name!r}")
        seen.add(t.name)


def task_curve(task: TaskDemand, cluster: ClusterSpec, cost: CostModel) -> ThroughputCurve:
    """T(t, ·) on this cluster's GPU type, calibrated by the task's measurements, up to ``max_gpus``."""
    curve = model_curve(
        task.model, cluster.gpu_type, cluster.gpus_per_node, cost, task.tp, task.pp, task.micro_batch
    )
    curve = calibrate(curve, task.calibration)
    if task.max_gpus is None or not curve.gpus or curve.gpus[-1] <= task.max_gpus:
        return curve
    # cut after calibrating: a measurement above the cap still scales the model's points below it
    n = sum(1 for x in curve.gpus if x <= task.max_gpus)
    return ThroughputCurve(curve.gpus[:n], curve.flops[:n], curve.configs[:n])


def waf_at(task: TaskDemand, curve: ThroughputCurve, gpus: int) -> float:
    """Eq. 2 at one allocation."""
    return task.weight * curve.at(gpus) if gpus >= task.min_gpus else 0.0


def smallest_runnable(task: TaskDemand, curve: ThroughputCurve, unit: int) -> int | None:
    """The fewest GPUs (a multiple of ``unit``) on which the task has F > 0, or None."""
    for x in curve.gpus:
        if x >= task.min_gpus and x % unit == 0:
            return x
    return None


def runs_nowhere(cluster: ClusterSpec, task: TaskDemand, cost: CostModel) -> bool:
    """Whether the model gives the task F = 0 at every GPU count: no configuration of its layout fits
    in memory (or its bounds leave none). The memory model has no distributed optimizer (§8), so a
    layout Megatron runs with one (a 7B model at TP1 x PP1) is among them."""
    return smallest_runnable(task, task_curve(task, cluster, cost), 1) is None


def unmet_minimums(
    cluster: ClusterSpec, tasks: Sequence[TaskDemand], cost: CostModel, unit: int = 1
) -> list[str]:
    """Why the tasks cannot all run at once on this cluster; empty when they can."""
    problems = []
    needs: dict[str, int] = {}
    for task in tasks:
        curve = task_curve(task, cluster, cost)
        first = smallest_runnable(task, curve, unit)
        what = f"task {task.name!r} ({task.model.label}, min_gpus={task.min_gpus})"
        if first is None:
            problems.append(
                f"{what}: no configuration fits in {cluster.gpu_type.name} memory on any GPU count"
            )
        elif first > cluster.n_gpus:
            problems.append(f"{what}: needs at least {first} GPUs to run; the cluster has {cluster.n_gpus}")
        else:
            needs[task.name] = first
    if not problems and sum(needs.values()) > cluster.n_gpus:
        parts = ", ".join(f"{name!r} needs {n}" for name, n in needs.items())
        problems.append(
            f"the minimums cannot all be met: {parts}: {sum(needs.values())} GPUs together, "
            f"the cluster has {cluster.n_gpus}"
        )
    return problems
