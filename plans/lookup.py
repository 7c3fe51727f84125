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


class LookupTable:
    """Plans for every one-step change from (cluster, tasks), solved up front."""

    def __init__(self, cluster: ClusterSpec, tasks: Sequence[TaskDemand], planner: WafPlanner | None = None):
        check_names(tasks)
        self.cluster = cluster
        self.tasks = list(tasks)
        self.planner = planner or WafPlanner()
        self._lost: dict[str | None, PlanResult] = {}
        for faulted in [None, *(t.name for t in tasks if t.current_gpus > 0)]:
            self._lost[faulted] = self.planner.plan(*lost_scenario(cluster, tasks, faulted))
        self._joined = self.planner.plan(*joined_scenario(cluster, tasks))

    def on_node_lost(self, task: str | None = None) -> PlanResult:
        """The plan after losing one node that hosted a worker of ``task`` (None: an idle node)."""
        try:
            return self._lost[task]
        except KeyError:
            raise InvalidRecord(
                f"lookup: task {task!r} holds no GPUs in this table's state; known: "
                f"{[k for k in self._lost if k is not None]}"
            ) from None

    def on_node_joined(self) -> PlanResult:
        """The plan after one node joins."""
        return self._joined

    def entries(self) -> Iterator[tuple[str | None, PlanResult]]:
        """(faulted task or None, plan) for each node-lost entry; the join entry is ``on_node_joined``."""
        yield from self._lost.items()
