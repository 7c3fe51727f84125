"""How many GPUs each task gets (paper §5): the interface the decision core asks, and a placeholder.

The real answer comes from the WAF planner in ``plans/`` (paper Eq. 3, solved by the DP of Eq. 5);
the lead adapts it to :class:`Allocator`. Until then :class:`EvenAllocator` stands in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Protocol

from coordinator.lookup import PlanLookup
from coordinator.tasks import TaskSpec
from plans.api import (
    Calibration,
    ClusterSpec,
    ModelSpec,
    PlanResult,
    ReliabilityModel,
    TaskDemand,
    WafPlanner,
    gpu_type,
    runs_nowhere,
)
from unicron.kernel import log as ulog

log = ulog.get(__name__)


class Allocator(Protocol):
    """Chooses worker counts per task; where the workers go is :func:`coordinator.placement.place`'s job."""

    def allocate(
        self,
        tasks: Sequence[TaskSpec],
        healthy_gpus: int,
        gpus_per_node: int,
        current: Mapping[str, int],
        faulted: set[str],
    ) -> dict[str, int]:
        """Return ``task name -> GPUs`` for every task in ``tasks``.

        Every count must be 0 (the task waits) or a count the task can run on
        (:meth:`TaskSpec.valid_count`), and they must sum to at most ``healthy_gpus``.
        ``current`` is what each task holds now (for the transition penalty of Eq. 3); ``faulted``
        names the tasks that lost a worker (Eq. 4: they pay the transition cost anyway).
        """
        ...


def _priority(task: TaskSpec, current: Mapping[str, int]) -> tuple[float, int, str]:
    # higher weight first; among equals a task already running keeps its place, then by name
    return (-task.weight, 0 if current.get(task.name, 0) > 0 else 1, task.name)


def _next_count(task: TaskSpec, count: int, limit: int) -> int | None:
    """The smallest valid count above ``count`` (and at least the minimum), if one is <= ``limit``."""
    start = max(count + task.unit, task.min_gpus)
    candidate = -(-start // task.unit) * task.unit
    while candidate <= limit:
        if task.valid_count(candidate):
            return candidate
        candidate += task.unit
    return None


class EvenAllocator:
    """PLACEHOLDER until ``plans.WafPlanner`` is adapted to :class:`Allocator` (the lead writes that adapter).

    It does not model throughput or transition cost. It (1) meets every task's minimum in priority
    order (weight, then already-running, then name); a task whose minimum does not fit gets 0 and stays
    pending - never fewer than its minimum; then (2) hands out the rest by water-filling: the task holding
    fewest GPUs steps up to its next valid count (a multiple of tp*pp whose data-parallel size divides
    the global batch), until no task can grow - so GPUs are spread evenly.
    """

    def allocate(
        self,
        tasks: Sequence[TaskSpec],
        healthy_gpus: int,
        gpus_per_node: int,
        current: Mapping[str, int],
        faulted: set[str],
    ) -> dict[str, int]:
        order = sorted(tasks, key=lambda t: _priority(t, current))
        counts = {t.name: 0 for t in tasks}
        free = healthy_gpus
        for task in order:
            first = _next_count(task, 0, free)
            if first is not None:
                counts[task.name] = first
                free -= first
        # water-filling: the task holding least grows by one step, until nobody can
        growing = [t for t in order if counts[t.name] > 0]
        rank = {t.name: i for i, t in enumerate(order)}
        while growing:
            task = min(growing, key=lambda t: (counts[t.name], rank[t.name]))
            nxt = _next_count(task, counts[task.name], counts[task.name] + free)
            if nxt is None:
                growing.remove(task)
                continue
            free -= nxt - counts[task.name]
            counts[task.name] = nxt
        return counts


def model_spec(task: TaskSpec) -> ModelSpec:
    assert task.model is not None
    m = task.model
    return ModelSpec(layers=m.num_layers, hidden=m.hidden_size, heads=m.num_attention_heads,
                     seq_len=m.seq_length, vocab=m.vocab_size, global_batch=m.global_batch_size, name=task.name)


def task_demand(
    task: TaskSpec,
    current: Mapping[str, int],
    faulted: set[str],
    transition_s: float | None = None,
    calibration: Calibration | None = None,
) -> TaskDemand:
    """``transition_s``: the task's measured D_transition (None: the planner's default);
    ``calibration``: its achieved FLOP/s (``coordinator.grounding``)."""
    assert task.model is not None
    # The task was launched with a fixed TP x PP and micro-batch: only its data-parallel size is elastic,
    # up to max_gpus (modelled, so the GPUs above a capped task's cap go to the others).
    demand = TaskDemand(name=task.name, model=model_spec(task), weight=task.weight, min_gpus=task.min_gpus,
                        current_gpus=current.get(task.name, 0), faulted=task.name in faulted,
                        tp=task.tp_size, pp=task.pp_size, micro_batch=task.model.micro_batch_size,
                        calibration=calibration, max_gpus=task.max_gpus)
    return demand if transition_s is None else replace(demand, transition_s=transition_s)


class WafAllocator:
    """The paper's plan generation: maximise sum_i G(t_i, x_i') (Eq. 3) with the planner's DP.

    ``gpu_type`` names the accelerator for the throughput model (``plans.hardware``). Counts the
    planner returns are runnable configurations of the pinned TP x PP; one that the task spec would
    not accept (it never happened in the tests) makes the whole answer fall back to EvenAllocator.
    """

    def __init__(
        self, gpu_type_name: str = "A800", planner: WafPlanner | None = None, lookup: PlanLookup | None = None
    ) -> None:
        self.gpu = gpu_type(gpu_type_name)
        self.planner = planner or WafPlanner()
        self.fallback = EvenAllocator()
        #: the table of one-step changes from the last plan (None: always solve)
        self.lookup = lookup
        #: the planner's answer to the last call (its modelled FLOP/s and WAF per task, for the
        #: daemon's metrics); None when that call fell back to EvenAllocator
        self.last_plan: PlanResult | None = None
        #: measured planner inputs per task (``ground``)
        self.transition_s: dict[str, float] = {}
        self.calibration: dict[str, Calibration] = {}
        self._last: tuple[list[TaskSpec], int, int, dict[str, int]] | None = None

    def ground(
        self,
        transition_s: Mapping[str, float] | None = None,
        calibration: Mapping[str, Calibration] | None = None,
        reliability: ReliabilityModel | None = None,
    ) -> bool:
        """Take measured inputs (``coordinator.grounding``) for the next plans; True if any changed (the
        lookup table is then rebuilt for them). Call it only with an adopted decision's measurements."""
        changed = False
        if transition_s is not None and dict(transition_s) != self.transition_s:
            self.transition_s, changed = dict(transition_s), True
        if calibration is not None and dict(calibration) != self.calibration:
            self.calibration, changed = dict(calibration), True
        if reliability is not None and reliability != self.planner.reliability:
            self.planner = WafPlanner(unit=self.planner.unit, reliability=reliability, cost=self.planner.cost)
            changed = True
        if changed:
            self._expect()
        return changed

    def _demands(self, tasks: Sequence[TaskSpec], current: Mapping[str, int], faulted: set[str]) -> list[TaskDemand]:
        return [task_demand(t, current, faulted, self.transition_s.get(t.name), self.calibration.get(t.name))
                for t in tasks]

    def _expect(self) -> None:
        """Ask for a lookup table of the one-step changes from the last plan's state."""
        if self.lookup is None or self._last is None:
            return
        tasks, healthy_gpus, gpus_per_node, counts = self._last
        cluster = ClusterSpec(gpu_type=self.gpu, n_gpus=healthy_gpus, gpus_per_node=gpus_per_node)
        self.lookup.expect(cluster, self._demands(tasks, counts, set()), self.planner)

    def allocate(
        self,
        tasks: Sequence[TaskSpec],
        healthy_gpus: int,
        gpus_per_node: int,
        current: Mapping[str, int],
        faulted: set[str],
    ) -> dict[str, int]:
        self.last_plan = None
        if not tasks:
            return {}
        if healthy_gpus == 0 or gpus_per_node < 1:
            # no usable node (none joined yet, or all lost): nothing to plan, and the planner's
            # ClusterSpec refuses a 0-GPU node, which made a valid submit fail (found by the fuzz)
            return {t.name: 0 for t in tasks}
        unmodelled = [t.name for t in tasks if t.model is None]
        if unmodelled:
            log.info("tasks without a model description: allocating evenly", tasks=unmodelled)
            return self.fallback.allocate(tasks, healthy_gpus, gpus_per_node, current, faulted)
        cluster = ClusterSpec(gpu_type=self.gpu, n_gpus=healthy_gpus, gpus_per_node=gpus_per_node)
        demands = self._demands(tasks, current, faulted)
        # A layout the throughput model finds no configuration of that fits in memory got 0 GPUs for
        # ever, on an empty cluster too (Megatron runs it with a distributed optimizer, which the model
        # ignores). Such a task gets what the plan of the others leaves idle, evenly: sending every
        # task to the even split for it shrank a weight-2 task to make room for a weight-0.5 one
        unfit = {dem.name for dem in demands if runs_nowhere(cluster, dem, self.planner.cost)}
        if unfit:
            log.info("tasks whose layout the throughput model finds no configuration of that fits in GPU "
                     "memory: they get the GPUs the plan leaves idle", tasks=sorted(unfit))
            modelled = [t for t in tasks if t.name not in unfit]
            counts = self.allocate(modelled, healthy_gpus, gpus_per_node, current, faulted) if modelled else {}
            left = healthy_gpus - sum(counts.values())
            rest = self.fallback.allocate([t for t in tasks if t.name in unfit], left, gpus_per_node, current, faulted)
            return {**counts, **rest}
        result = self.lookup.answer(cluster, demands, self.planner) if self.lookup is not None else None
        if result is None:
            result = self.planner.plan(cluster, demands)
        counts = {t.name: result.allocation.get(t.name, 0) for t in tasks}
        bad = [t.name for t in tasks if not t.valid_count(counts[t.name])]
        if bad or sum(counts.values()) > healthy_gpus:
            log.warning("planner answer not runnable: allocating evenly", tasks=bad, planned=counts, usable=healthy_gpus)
            return self.fallback.allocate(tasks, healthy_gpus, gpus_per_node, current, faulted)
        self.last_plan = result
        # the next event is most likely one node lost or joined from here: have its plan ready
        self._last = (list(tasks), healthy_gpus, gpus_per_node, counts)
        self._expect()
        return counts
