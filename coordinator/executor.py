"""Turns the decision core's actions into each node's desired assignment (``assign/<node>``).

Execution is level-triggered: the coordinator only ever writes the whole desired state of a node,
with a revision that only grows; agents reconcile their processes to it and ignore stale
revisions. The executor keeps the desired state in memory (loaded from etcd when a coordinator
becomes leader) and returns the node records to write; the daemon writes them fenced.

It is pure: no ports, no hostnames, no guesses. A task's rendezvous store is named by the node
whose agent hosts it (``store_node``); that agent picks the port on its own node and publishes the
address (``stores/<task>``). A node's GPU count comes from its registration (``node_gpus``).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, Sequence

from coordinator import decision as d
from coordinator.decision.resize import launch_store_node, successor_store_node
from coordinator.tasks import Recovery, TaskSpec
from unicron.kernel.errors import InvalidRecord, PermanentError
from unicron.kernel.keyspace import Keyspace
from unicron.kernel.types import NodeAssignment, RankSet, RankSpec, TaskAssignment

#: the nodes a rank's RankSpec names as where it ran before (``previous_nodes``): the newest, and the
#: one before in case the rank was relaunched and lost again before it pushed a snapshot from there
PREVIOUS_NODES_KEPT = 2


class Executor:
    def __init__(self, keys: Keyspace, specs: Callable[[str], TaskSpec | None],
                 node_gpus: Callable[[str], int], max_restarts: int = 0, spare_stores: bool = False) -> None:
        self.keys = keys
        self.specs = specs
        self.node_gpus = node_gpus
        self.max_restarts = max_restarts  # only passed on to ranks (TORCHELASTIC_MAX_RESTARTS)
        #: name each in-place task's successor store node (TaskAssignment.spare_store_node)
        self.spare_stores = spare_stores
        self.desired: dict[str, dict[str, TaskAssignment]] = {}
        self.isolated: set[str] = set()  # nodes whose records say so (NodeAssignment.isolated)
        self.revision = 0

    def draft(self) -> Executor:
        """A copy to apply one decision to, adopted only once its write lands (this one unchanged)."""
        out = copy.copy(self)
        # Two levels copied, the records shared: a TaskAssignment (frozen) is replaced, never changed
        # in place. A deep copy cost 0.4 s per decision at 1,000 nodes x 8 GPUs.
        out.desired = {node: dict(tasks) for node, tasks in self.desired.items()}
        out.isolated = set(self.isolated)
        return out

    def load(self, records: Mapping[str, bytes]) -> None:
        """Adopt the assignments a previous leader wrote (key -> value), in place of what this executor
        held (a leader re-elected after another led must not keep an isolation since lifted)."""
        self.desired.clear()
        self.isolated.clear()
        for value in records.values():
            try:
                na = NodeAssignment.from_json(value)
                self.desired[na.node] = {t.task: t for t in na.task_assignments()}
                if na.isolated:
                    self.isolated.add(na.node)
                self.revision = max(self.revision, na.revision)
            except InvalidRecord:
                continue

    def apply_all(self, actions: Sequence[d.Action]) -> set[str]:
        """Update the desired state for one decision's actions; returns the nodes whose record changed.

        The core's actions are not ordered by the GPUs they free: one task may take GPUs that a later
        Assign or in-place resize of another gives up, and a task can shrink on one node while growing
        on another, so no order is right for all. Hence two phases: every Assign's task leaves its nodes
        and every resize's leaving and lost ranks go, then the actions are applied in order, each
        checking free GPUs against the decision's final occupancy. Meant for a draft: a refused action
        may leave it half changed."""
        changed: set[str] = set()
        # where each reassigned task's ranks ran, read before they leave the records (an isolation in
        # the same decision clears its node's too)
        before = {a.task: self._previous_nodes(a) for a in actions if isinstance(a, d.Assign)}
        for action in actions:
            if isinstance(action, d.Assign):
                changed |= self._remove_task(action.task)
            elif isinstance(action, d.ResizeInPlace):
                changed |= self._drop_leavers(action)
        for action in actions:
            if isinstance(action, d.ResizeInPlace):
                changed |= self._resize(action)
            elif isinstance(action, d.Assign):
                changed |= self._assign(action, before[action.task])
            else:
                changed |= self.apply(action)
        return changed

    def apply(self, action: d.Action) -> set[str]:
        """Update the desired state for ``action``; returns the nodes whose record changed."""
        match action:
            case d.Assign():
                return self._assign(action, self._previous_nodes(action))
            case d.ResizeInPlace():
                return self._drop_leavers(action) | self._resize(action)
            case d.StopTask():
                return self._remove_task(action.task)
            case d.RestartRanks():
                return self._update(action.task, [action.node], restart_epoch=action.restart_epoch,
                                    restart_ranks=list(action.ranks))
            case d.RestartTask():
                changed = set()
                for node, ranks in sorted(action.placement.items()):
                    changed |= self._update(action.task, [node], restart_epoch=action.restart_epoch,
                                            restart_ranks=list(ranks), restart_delay_s=float(action.delay_s))
                return changed
            case d.Reattempt():
                nodes = [n for n, tasks in self.desired.items() if action.task in tasks]
                return self._update(action.task, nodes, regroup_epoch=action.regroup_epoch,
                                    regroup_members=RankSet.of(action.members), regroup_failed=list(action.failed_ranks))
            case d.IsolateNode():
                changed = {action.node} if self.desired.get(action.node) else set()
                self.desired[action.node] = {}
                self.isolated.add(action.node)
                return changed
        return set()

    def forget(self, node: str) -> None:
        """Drop ``node``'s record: a node forgotten for good (``unicron forget``) has its
        ``assign/<node>`` deleted, and no later decision may write it back."""
        self.desired.pop(node, None)
        self.isolated.discard(node)

    def record(self, node: str) -> tuple[str, str]:
        """The (key, JSON) to write for ``node``'s desired state, at a fresh revision."""
        self.revision += 1
        tasks = [t for _, t in sorted(self.desired.get(node, {}).items())]
        na = NodeAssignment(node=node, revision=self.revision, tasks=tasks, isolated=node in self.isolated)
        return self.keys.assignment(node), na.to_json()

    def _remove_task(self, task: str) -> set[str]:
        changed = set()
        for node, tasks in self.desired.items():
            if tasks.pop(task, None) is not None:
                changed.add(node)
        return changed

    def _free_gpus(self, node: str, task: str) -> list[int]:
        """GPUs of ``node`` (as registered) that no other task's desired assignment uses."""
        used = {r.gpu for name, t in self.desired.get(node, {}).items() if name != task for r in t.ranks}
        return [g for g in range(self.node_gpus(node)) if g not in used]

    def _previous_nodes(self, action: d.Assign) -> dict[int, list[str]]:
        """rank -> the nodes it ran on (``RankSpec.previous_nodes`` of its next placement): its node in
        the current records, then the ones its spec names, then its node in the task's last placement
        as the core kept it (``Assign.previous_placement``: the task was stopped in an earlier decision,
        which took it off the records), at most ``PREVIOUS_NODES_KEPT``."""
        out: dict[int, list[str]] = {}
        for node, tasks in self.desired.items():
            record = tasks.get(action.task)
            for spec in record.ranks if record is not None else ():
                out[spec.rank] = [node, *spec.previous_nodes]
        for node, ranks in action.previous_placement.items():
            for rank in ranks:
                out.setdefault(rank, []).append(node)
        return {rank: list(dict.fromkeys(nodes))[:PREVIOUS_NODES_KEPT] for rank, nodes in out.items()}

    def _assign(self, action: d.Assign, previous: Mapping[int, list[str]]) -> set[str]:
        """``previous``: where each rank ran before (:meth:`_previous_nodes`, read before the task left
        the records): its replicas are on those nodes' ring successors, which its restore asks."""
        spec = self.specs(action.task)
        if spec is None:
            return set()
        placement = {n: sorted(r) for n, r in action.placement.items() if r}
        # Checked before anything changes: a refused action leaves the desired state as it was.
        free = {node: self._free_gpus(node, action.task) for node in placement}
        for node, ranks in placement.items():
            if len(free[node]) < len(ranks):
                raise PermanentError(
                    f"planner placed {len(ranks)} rank(s) of task {action.task} on node {node}, which has "
                    f"{len(free[node])} free GPU(s) of {self.node_gpus(node)} registered"
                )
        changed = self._remove_task(action.task)
        if not placement:
            return changed
        # The rendezvous store is the agent's sidecar, never rank 0 (which may die).
        store_node = launch_store_node(placement)
        recovery = spec.recovery or Recovery.INPROCESS
        spare = self._spare_store_node(recovery.value, placement, store_node)
        # torchrun numbers nodes (GROUP_RANK) so that lower ranks sit on lower-numbered nodes.
        nodes = sorted(placement, key=lambda n: placement[n][0])
        for node, ranks in sorted(placement.items()):
            specs = [RankSpec(rank=r, local_rank=i, gpu=free[node][i], previous_nodes=previous.get(r, []))
                     for i, r in enumerate(ranks)]
            self.isolated.discard(node)  # placed on again: back in service
            self.desired.setdefault(node, {})[action.task] = TaskAssignment(
                task=action.task, generation=action.generation, argv=list(spec.command),
                env={**spec.env, "UNICRON_EXTERNAL_STORE": "1"},
                world_size=action.world_size, ranks=specs, store_node=store_node,
                group_rank=nodes.index(node), group_world_size=len(nodes), max_restarts=self.max_restarts,
                recovery=recovery.value, restart_epoch=action.restart_epoch, spare_store_node=spare,
            )
            changed.add(node)
        return changed

    def _records(self, action: d.ResizeInPlace) -> dict[str, TaskAssignment]:
        """The resized task's records by node. None is a core and executor out of step (the resize's
        survivors run nowhere): refused, as silence left the core waiting out the resize's deadline."""
        current = {n: tasks[action.task] for n, tasks in self.desired.items() if action.task in tasks}
        if not current:
            raise PermanentError(f"in-place resize of task {action.task}, which has no ranks assigned anywhere")
        return current

    def _drop_leavers(self, action: d.ResizeInPlace) -> set[str]:
        """A resize's first half: its leaving and lost ranks give up their GPUs. A node whose ranks all
        leave keeps the task with no ranks (its agent asks them to leave at an iteration boundary rather
        than stop them); a lost node's record loses it (its processes went with the node)."""
        lost = set(action.lost)
        joiners = set(action.joiners)
        changed = set()
        for node, record in self._records(action).items():
            ranks = set(action.placement.get(node, ()))
            if not ranks and all(s.rank in lost for s in record.ranks):
                del self.desired[node][action.task]
                changed.add(node)
                continue
            kept = [s for s in record.ranks if s.rank in ranks and s.rank not in joiners]
            if kept != record.ranks:
                self.desired[node][action.task] = dataclasses.replace(record, ranks=kept)
                changed.add(node)
        return changed

    def _resize(self, action: d.ResizeInPlace) -> set[str]:
        """A resize's second half, after :meth:`_drop_leavers`: the task's records at its new
        membership; survivors keep their RankSpec (GPU, local rank), joiners get free GPUs."""
        current = self._records(action)
        template = next(iter(current.values()))
        placement = {n: sorted(r) for n, r in action.placement.items() if r}
        specs: dict[str, list[RankSpec]] = {}
        for node, ranks in placement.items():
            kept = current[node].ranks if node in current else []
            free = [g for g in self._free_gpus(node, action.task) if g not in {s.gpu for s in kept}]
            locals_ = [i for i in range(self.node_gpus(node)) if i not in {s.local_rank for s in kept}]
            new = [r for r in ranks if r not in {s.rank for s in kept}]
            if len(free) < len(new):  # checked before this half changes anything
                raise PermanentError(
                    f"in-place resize of task {action.task} places {len(new)} joiner(s) on node {node}, which "
                    f"has {len(free)} free GPU(s) of {self.node_gpus(node)} registered"
                )
            specs[node] = sorted(kept + [RankSpec(rank=r, local_rank=locals_[i], gpu=free[i])
                                         for i, r in enumerate(new)], key=lambda s: s.rank)
        nodes = sorted(placement, key=lambda n: placement[n][0])
        # A store moved to another node (its node is gone), or a fresh one (its sidecar died), starts at
        # this membership epoch: that node's agent starts a sidecar and publishes it, every agent hands
        # the address to its ranks.
        moved = bool(action.store_node) and (action.store_node != template.store_node or action.fresh_store)
        store_node, store_epoch = ((action.store_node, action.membership_epoch) if moved
                                   else (template.store_node, template.store_epoch))
        spare = self._spare_store_node(template.recovery, placement, store_node)
        members = RankSet.of(action.members)  # once: a sort of every rank per node was O(nodes^2)
        changed = set()
        for node in sorted(set(current) | set(placement)):
            base = current.get(node, template)
            if specs.get(node):
                self.isolated.discard(node)  # placed on again: back in service
            self.desired.setdefault(node, {})[action.task] = dataclasses.replace(
                base, ranks=specs.get(node, []), membership_epoch=action.membership_epoch,
                members=members, joiners=list(action.joiners), lost=list(action.lost),
                group_rank=nodes.index(node) if node in nodes else 0, group_world_size=len(nodes),
                store_node=store_node, store_epoch=store_epoch, spare_store_node=spare,
            )
            changed.add(node)
        return changed

    def _spare_store_node(self, recovery: str, placement: dict[str, list[int]], store_node: str) -> str:
        """Where an in-place task keeps a spare store (a ``restart`` task keeps its own on its store's
        node: a whole-task restart replaces the store there)."""
        if not self.spare_stores or recovery != Recovery.INPROCESS.value:
            return ""
        return successor_store_node(placement, store_node)

    def _update(self, task: str, nodes: list[str], **fields: object) -> set[str]:
        changed = set()
        for node in nodes:
            current = self.desired.get(node, {}).get(task)
            if current is None:
                continue
            self.desired[node][task] = dataclasses.replace(current, **fields)  # type: ignore[arg-type]
            changed.add(node)
        return changed
