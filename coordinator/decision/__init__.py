"""The coordinator's decision core: paper §4.2 / Figure 7 as a pure, deterministic state machine.

Inputs are :data:`Event` values (classified incidents, node joined / lost / drained / undrained, task
submitted / finished / cancelled, action results, training progress, clock ticks); outputs are
:data:`Action` values for the daemon to carry out. Nothing here does I/O or reads a clock: time
arrives on events (``ts``), so the same code runs under the daemon and under a trace simulator.

Figure 7, per task, is the explicit table :data:`TRANSITIONS`: ``(phase, trigger) -> (phase, response)``.

* sev3 (①) -> reattempt in place; a failed reattempt -> sev2.
* sev2 (②) -> restart the affected ranks on the same node, same configuration; a failed restart -> sev1.
  So is the ``flap_faults``-th sev2 of one node within ``flap_window_s`` (each restart worked: a flapping
  node, ``NodeEntry.sev2_faults``): the node is isolated instead of restarted once more.
* sev1 (③) -> isolate the node and reconfigure every task that had ranks on it.
* node joined (④), task finished (⑤), task launched (⑥) -> reconfigure.

A reconfiguration asks the :class:`~coordinator.allocation.Allocator` for counts over *all* tasks
(the global optimum may move healthy tasks too), then :func:`~coordinator.placement.place` for nodes.
An incident no more severe than the recovery already under way is merged into it (a sev3 during a
restart is its consequence); a more severe one escalates. Budgets end loops: a reattempt is retried
at most ``max_reattempts`` times per incident, and a task that needs more than
``max_restarts_without_progress`` restarts (or restart-driven reconfigurations) without its step
advancing is marked failed. Every tracked action has a deadline; a missed deadline counts as failure.

Counters, following :class:`unicron.kernel.types.TaskAssignment`: ``generation`` grows on every assignment
(agents replace all the task's processes), ``restart_epoch`` on every sev2 restart (only the named
ranks are relaunched and rejoin), ``regroup_epoch`` on every sev3 reattempt (no process restarts).

Modules, one per concept: :mod:`~coordinator.decision.events` (inputs), :mod:`~coordinator.decision.actions`
(outputs), :mod:`~coordinator.decision.state` (the persisted state), :mod:`~coordinator.decision.table`
(Figure 7), :mod:`~coordinator.decision.settings` (budgets, deadlines), :mod:`~coordinator.decision.engine`
(:class:`DecisionCore`), :mod:`~coordinator.decision.codec` (JSON for events and actions). Everything a
caller needs is re-exported here: ``from coordinator import decision as d; d.DecisionCore(...)``.

Action results: the daemon turns agents' ``results/<node>`` into ActionSucceeded / ActionFailed
(:func:`coordinator.causes.outcomes`). A failed action escalates at once (failed reattempt -> sev2
restart; failed restart -> sev1, the node isolated; failed assignment -> the node it failed on isolated
and a re-plan, charged to the restart budget). With ``cause=FailureCause.TASK`` (the task's command
could not start) the task is failed with the reason and no node is isolated.
"""

from coordinator.decision.actions import (
    Action,
    ActionKind,
    Alert,
    Assign,
    IsolateNode,
    MarkTaskFailed,
    Reattempt,
    ResizeInPlace,
    RestartRanks,
    RestartTask,
    StopTask,
)
from coordinator.decision.codec import from_dict, to_dict
from coordinator.decision.engine import DecisionCore, Transition
from coordinator.decision.events import (
    ActionFailed,
    ActionSucceeded,
    Event,
    FailureCause,
    IncidentRaised,
    NodeDrained,
    NodeForgotten,
    NodeJoined,
    NodeLost,
    NodeUndrained,
    ProgressMade,
    TaskCancelled,
    TaskFinished,
    TaskStopped,
    TaskSubmitted,
    TaskUpdated,
    Tick,
)
from coordinator.decision.settings import DecisionSettings
from coordinator.decision.state import (
    ACTIVE_PHASES,
    CoreState,
    NodeEntry,
    NodeState,
    Outstanding,
    TaskEntry,
    TaskPhase,
    UpdateOutcome,
)
from coordinator.decision.table import BUDGETED, SEVERITY_TRIGGER, TRANSITIONS, Response, Trigger

__all__ = [
    "ACTIVE_PHASES",
    "BUDGETED",
    "SEVERITY_TRIGGER",
    "TRANSITIONS",
    "Action",
    "ActionFailed",
    "ActionKind",
    "ActionSucceeded",
    "Alert",
    "Assign",
    "CoreState",
    "DecisionCore",
    "DecisionSettings",
    "Event",
    "FailureCause",
    "IncidentRaised",
    "IsolateNode",
    "MarkTaskFailed",
    "NodeDrained",
    "NodeEntry",
    "NodeForgotten",
    "NodeJoined",
    "NodeLost",
    "NodeState",
    "NodeUndrained",
    "Outstanding",
    "ProgressMade",
    "Reattempt",
    "ResizeInPlace",
    "Response",
    "RestartRanks",
    "RestartTask",
    "StopTask",
    "TaskCancelled",
    "TaskEntry",
    "TaskFinished",
    "TaskPhase",
    "TaskStopped",
    "TaskSubmitted",
    "TaskUpdated",
    "Tick",
    "Transition",
    "Trigger",
    "UpdateOutcome",
    "from_dict",
    "to_dict",
]
