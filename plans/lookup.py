"""Precomputed answers for every one-step change of the cluster (paper §5.2, "lookup table").

From the current state, the next event is one node lost (hosting a worker of some task, or idle) or
one node joined. Losing a node of task t means n' = n - gpus_per_node and t counts as faulted
(Eq. 4); which node of t it was does not change Eq. 3, so there is one entry per task holding GPUs,
one for an idle node, and one for a join. Each entry is a full solve made ahead of time, so the
decision when the event happens is a dictionary lookup.

A node whose GPUs are split between several tasks (possible in GPU units) is not precomputed; plan
that case with the planner directly.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import replace

from plans.planner import WafPlanner
from plans.problem import ClusterSpec, TaskDemand, check_names
from plans.result import PlanResult
from unicron.kernel.errors import InvalidRecord


def lost_scenario(
    cluster: ClusterSpec, tasks: Sequence[TaskDemand], faulted: str | None
) -> tuple[ClusterSpec, list[TaskDemand]]:
    """The problem after one node of ``faulted`` (None: an idle node) is lost."""
    after = replace(cluster, n_gpus=max(cluster.n_gpus - cluster.gpus_per_node, 0))
    return after, [replace(t, faulted=True) if t.name == faulted else t for t in tasks]


def joined_scenario(
    cluster: ClusterSpec, tasks: Sequence[TaskDemand]
) -> tuple[ClusterSpec, list[TaskDemand]]:
    """The problem after one node joins."""
    return replace(cluster, n_gpus=cluster.n_gpus + cluster.gpus_per_node), list(tasks)


#: a problem as the table keys it: the cluster and the tasks, in order
Problem = tuple[ClusterSpec, tuple[TaskDemand, ...]]


class LookupTable:
    """Plans for every one-step change from (cluster, tasks), solved up front.

    ``lazy=True`` solves an entry the first time it is asked for instead (the simulator: thousands of
    tables of which one entry is used each; a solve is pure, so the answer is the same plan).
    """

    def __init__(
        self,
        cluster: ClusterSpec,
        tasks: Sequence[TaskDemand],
        planner: WafPlanner | None = None,
        lazy: bool = False,
    ):
        check_names(tasks)
        self.cluster = cluster
        self.tasks = list(tasks)
        self.planner = planner or WafPlanner()
        self.solve_s = 0.0
        """Wall time spent solving entries (so far, when lazy)."""
        self._problems: dict[str | None, Problem] = {}
        for faulted in [None, *(t.name for t in tasks if t.current_gpus > 0)]:
            after, demands = lost_scenario(cluster, tasks, faulted)
            self._problems[faulted] = (after, tuple(demands))
        after, demands = joined_scenario(cluster, tasks)
        self._joined_problem: Problem = (after, tuple(demands))
        #: problem -> the key of its entry (a task name, None for an idle node, JOINED)
        self._index: dict[Problem, str | object | None] = {p: k for k, p in self._problems.items()}
        self._index.setdefault(self._joined_problem, _JOINED)
        self._plans: dict[str | object | None, PlanResult] = {}
        if not lazy:
            for key in [*self._problems, _JOINED]:
                self._plan(key)

    def _plan(self, key: str | object | None) -> PlanResult:
        found = self._plans.get(key)
        if found is None:
            problem = self._joined_problem if key is _JOINED else self._problems[key]  # type: ignore[index]
            started = time.perf_counter()
            found = self._plans[key] = self.planner.plan(*problem)
            self.solve_s += time.perf_counter() - started
        return found

    def on_node_lost(self, task: str | None = None) -> PlanResult:
        """The plan after losing one node that hosted a worker of ``task`` (None: an idle node)."""
        if task not in self._problems:
            raise InvalidRecord(
                f"lookup: task {task!r} holds no GPUs in this table's state; known: "
                f"{[k for k in self._problems if k is not None]}"
            )
        return self._plan(task)

    def on_node_joined(self) -> PlanResult:
        """The plan after one node joins."""
        return self._plan(_JOINED)

    def answer(self, cluster: ClusterSpec, tasks: Sequence[TaskDemand]) -> PlanResult | None:
        """The plan for exactly this problem if it is one of the table's one-step changes, else None
        (a miss: solve it). Planner settings are not compared: a table answers for its own planner."""
        key = self._index.get((cluster, tuple(tasks)), _MISS)
        return None if key is _MISS else self._plan(key)

    def entries(self) -> Iterator[tuple[str | None, PlanResult]]:
        """(faulted task or None, plan) for each node-lost entry; the join entry is ``on_node_joined``."""
        for key in self._problems:
            yield key, self._plan(key)


_JOINED = object()
_MISS = object()
