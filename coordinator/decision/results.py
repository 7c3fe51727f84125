"""From an agent's ``results/<node>`` record to :class:`ActionSucceeded` / :class:`ActionFailed`.

The core tracks one outstanding action per task (:class:`~coordinator.decision.state.Outstanding`);
the executor writes it into the ``assign/<node>`` record of every node in ``Outstanding.waiting``.
The daemon, which knows revisions, links the two halves:

1. after it wrote ``assign/<node>`` at revision R (fenced, state adopted), it remembers
   ``awaited(state, node)`` under (node, R): the actions that write carries;
2. when ``results/<node>`` arrives with ``revision >= R``, it feeds
   ``result_events(remembered, result, ts=..., cause=...)`` to the core, in order, and forgets them.

Both are pure. Feeding an event twice, or for a superseded action, changes nothing: the core ignores
results of actions it no longer waits for, and a multi-node action is confirmed once every node in
``waiting`` has sent its ActionSucceeded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from coordinator.decision.actions import ActionKind
from coordinator.decision.events import ActionFailed, ActionSucceeded, FailureCause
from coordinator.decision.state import CoreState
from unicron.kernel.types import AssignmentResult, TaskResult


@dataclass(frozen=True)
class Awaited:
    """A tracked action carried by one node's assignment record, with the counters that show it done."""

    task: str
    action_id: str
    kind: ActionKind
    generation: int
    restart_epoch: int
    regroup_epoch: int

    def carried_out_by(self, result: TaskResult) -> bool:
        """Whether the node's view of the task shows this action applied."""
        if result.generation != self.generation:
            return False  # an older run, or a newer assignment that superseded this one
        if self.kind is ActionKind.RESTART:
            return result.restart_epoch >= self.restart_epoch
        if self.kind is ActionKind.REATTEMPT:
            return result.regroup_epoch >= self.regroup_epoch
        return True


def awaited(state: CoreState, node: str) -> list[Awaited]:
    """The outstanding actions that wait for ``node``'s result, in task order."""
    out = []
    for name, entry in sorted(state.tasks.items()):
        o = entry.outstanding
        if o is not None and node in o.waiting:
            out.append(
                Awaited(name, o.action_id, o.kind, entry.generation, entry.restart_epoch, entry.regroup_epoch)
            )
    return out


def result_events(
    carried: Sequence[Awaited],
    result: AssignmentResult,
    *,
    ts: float,
    cause: FailureCause = FailureCause.NODE,
) -> list[ActionSucceeded | ActionFailed]:
    """The events that ``result`` (from the node whose write carried ``carried``) means for the core.

    A failed reconcile (``result.ok`` false) fails every carried action at once, with ``cause`` saying
    whose fault it was: pass :attr:`FailureCause.TASK` when the agent says the task's command could not
    start, so the task is failed and no node isolated. A successful one confirms each action the node's
    task counters show applied; the others wait (for a later result, progress or their deadline).
    """
    if not result.ok:
        reason = f"node {result.node}: {result.detail}"
        return [
            ActionFailed(ts=ts, action_id=a.action_id, reason=reason, node=result.node, cause=cause)
            for a in carried
        ]
    events: list[ActionSucceeded | ActionFailed] = []
    for a in carried:
        seen = result.tasks.get(a.task)
        if seen is not None and a.carried_out_by(seen):
            events.append(ActionSucceeded(ts=ts, action_id=a.action_id, node=result.node))
    return events
