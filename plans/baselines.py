"""The paper's multi-task baselines (Figure 10(c)): split the GPUs equally, by weight, or by model size.

A share is rarely a GPU count the task can use exactly (Megatron needs TP·PP·DP GPUs with PP dividing
the layers and DP dividing the batch), so each baseline rounds the same way:

1. every task gets the largest GPU count it can run on (F > 0; a multiple of the unit) that does not
   exceed its share — or nothing;
2. the GPUs left over go, in order of the largest remainder (share minus what was granted), to tasks
   that can step up to their next runnable count within what is left; one step per task.

Step 2 keeps the baselines from wasting whole nodes to rounding, which would flatter the planner.
"""

from __future__ import annotations

from collections.abc import Sequence

from plans.planner import Planner
from plans.problem import ClusterSpec, TaskDemand, check_names, task_curve
from plans.result import PlanResult, evaluate


class ShareBaseline(Planner):
    """Allocates in proportion to ``share(task)``, rounded as the module docstring says."""

    def share(self, task: TaskDemand) -> float:
        raise NotImplementedError

    def plan(self, cluster: ClusterSpec, tasks: Sequence[TaskDemand]) -> PlanResult:
        check_names(tasks)
        unit = self.unit_size(cluster)
        n = cluster.n_gpus
        total = sum(self.share(t) for t in tasks) or 1.0
        runnable = {
            t.name: [
                x
                for x in task_curve(t, cluster, self.cost).gpus
                if x >= t.min_gpus and x % unit == 0 and x <= n
            ]
            for t in tasks
        }
        target = {t.name: n * self.share(t) / total for t in tasks}
        grant = {name: max((x for x in runnable[name] if x <= target[name]), default=0) for name in target}
        left = n - sum(grant.values())
        for name in sorted(target, key=lambda k: (grant[k] - target[k], k)):
            step = next((x for x in runnable[name] if x > grant[name]), None)
            if step is not None and step - grant[name] <= left:
                left -= step - grant[name]
                grant[name] = step
        return evaluate(self.name, cluster, tasks, grant, self.reliability, self.cost)


class EquallyPlanner(ShareBaseline):
    """The "equally" baseline: the same share for every task."""

    name = "equally"

    def share(self, task: TaskDemand) -> float:
        return 1.0


class WeightedPlanner(ShareBaseline):
    """The "weighted" baseline: shares proportional to w(t)."""

    name = "weighted"

    def share(self, task: TaskDemand) -> float:
        return task.weight


class SizedPlanner(ShareBaseline):
    """The "sized" baseline: shares proportional to the model's parameter count."""

    name = "sized"

    def share(self, task: TaskDemand) -> float:
        return task.model.params


BASELINES: dict[str, type[ShareBaseline]] = {
    c.name: c for c in (EquallyPlanner, WeightedPlanner, SizedPlanner)
}
