"""Turns the decision core's actions into each node's desired assignment (``assign/<node>``).

Execution is level-triggered: the coordinator only ever writes the whole desired state of a node,
with a revision that only grows; agents reconcile their processes to it and ignore stale
revisions. The executor keeps the desired state in memory (loaded from etcd when a coordinator
becomes leader) and returns the node records to write; the daemon writes them fenced.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping

from coordinator import decision as d
from coordinator.tasks import TaskSpec
from unicron.kernel.errors import InvalidRecord
from unicron.kernel.keyspace import Keyspace
from unicron.kernel.net import free_port
from unicron.kernel.types import NodeAssignment, RankSpec, TaskAssignment


class Executor:
    def __init__(self, keys: Keyspace, specs: Callable[[str], TaskSpec | None],
                 node_host: Callable[[str], str]) -> None:
        self.keys = keys
        self.specs = specs
        self.node_host = node_host
        self.desired: dict[str, dict[str, TaskAssignment]] = {}
        self.revision = 0

    def load(self, records: Mapping[str, bytes]) -> None:
        """Adopt the assignments a previous leader wrote (key -> value)."""
        for value in records.values():
            try:
                na = NodeAssignment.from_dict(json.loads(value))
                self.desired[na.node] = {t.task: t for t in na.task_assignments()}
                self.revision = max(self.revision, na.revision)
            except (InvalidRecord, ValueError):
                continue

    def apply(self, action: d.Action) -> set[str]:
        """Update the desired state for ``action``; returns the nodes whose record changed."""
        match action:
            case d.Assign():
                return self._assign(action)
            case d.StopTask():
                return self._remove_task(action.task)
            case d.RestartRanks():
                return self._update(action.task, [action.node], restart_epoch=action.restart_epoch,
                                    restart_ranks=list(action.ranks))
            case d.Reattempt():
                nodes = [n for n, tasks in self.desired.items() if action.task in tasks]
                return self._update(action.task, nodes, regroup_epoch=action.regroup_epoch,
                                    regroup_members=list(action.members), regroup_failed=list(action.failed_ranks))
            case d.IsolateNode():
                changed = {action.node} if self.desired.get(action.node) else set()
                self.desired[action.node] = {}
                return changed
        return set()

    def record(self, node: str) -> tuple[str, str]:
        """The (key, JSON) to write for ``node``'s desired state, at a fresh revision."""
        self.revision += 1
        tasks = [t for _, t in sorted(self.desired.get(node, {}).items())]
        na = NodeAssignment(node=node, revision=self.revision, tasks=tasks)
        return self.keys.assignment(node), json.dumps(na.to_dict())

    def _remove_task(self, task: str) -> set[str]:
        changed = set()
        for node, tasks in self.desired.items():
            if tasks.pop(task, None) is not None:
                changed.add(node)
        return changed

    def _free_gpus(self, node: str, task: str, gpus: int) -> list[int]:
        used = {r.gpu for name, t in self.desired.get(node, {}).items() if name != task for r in t.ranks}
        return [g for g in range(gpus) if g not in used]

    def _assign(self, action: d.Assign) -> set[str]:
        spec = self.specs(action.task)
        if spec is None:
            return set()
        changed = self._remove_task(action.task)
        placement = {n: sorted(r) for n, r in action.placement.items() if r}
        if not placement:
            return changed
        store_node = min(placement, key=lambda n: placement[n][0])
        port = free_port()
        for node, ranks in sorted(placement.items()):
            free = self._free_gpus(node, action.task, gpus=max(len(ranks), 64))
            specs = [RankSpec(rank=r, local_rank=i, gpu=free[i]) for i, r in enumerate(ranks)]
            self.desired.setdefault(node, {})[action.task] = TaskAssignment(
                task=action.task, generation=action.generation, argv=list(spec.command),
                # The rendezvous store is the agent's sidecar, never rank 0 (which may die).
                env={**spec.env, "UNICRON_EXTERNAL_STORE": "1"},
                world_size=action.world_size, ranks=specs, master_addr=self.node_host(store_node),
                master_port=port, host_store=node == store_node,
            )
            changed.add(node)
        return changed

    def _update(self, task: str, nodes: list[str], **fields: object) -> set[str]:
        changed = set()
        for node in nodes:
            current = self.desired.get(node, {}).get(task)
            if current is None:
                continue
            self.desired[node][task] = dataclasses.replace(current, **fields)  # type: ignore[arg-type]
            changed.add(node)
        return changed
