"""The coordinator's decision core: paper §4.2 / Figure 7 as a pure, deterministic state machine.

Inputs are :data:`Event` values (classified incidents, node joined / lost / drained / undrained, task
submitted / finished / cancelled, action results, training progress, clock ticks); outputs are
:data:`Action` values for the daemon to carry out. Nothing here does I/O or reads a clock: time
arrives on events (``ts``), so the same code runs under the daemon and under a trace simulator.

Figure 7, per task, is the explicit table :data:`TRANSITIONS`: ``(phase, trigger) -> (phase, response)``.

* sev3 (①) -> reattempt in place; a failed reattempt -> sev2.
* sev2 (②) -> restart the affected ranks on the same node, same configuration; a failed restart -> sev1.
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
"""

from __future__ import annotations

import copy
import enum
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

from coordinator.allocation import Allocator, EvenAllocator
from coordinator.placement import place
from coordinator.tasks import TaskSpec, parse_task_spec
from unicron.kernel.errors import ConfigError, InvalidRecord, PermanentError
from unicron.kernel.types import Incident, Severity

# ---------------------------------------------------------------------------------------------------
# settings


@dataclass(frozen=True)
class DecisionSettings:
    """Budgets and deadlines of the decision core."""

    max_reattempts: int = 1
    """Reattempts in place per incident before it is escalated to sev2 (paper: one)."""
    max_restarts_without_progress: int = 3
    """Restarts (and restart-driven reconfigurations) a task may take while its step does not advance;
    the next fault marks it failed instead of restarting it again."""
    reattempt_deadline_s: float = 30.0
    """Seconds for a reattempt to be confirmed before it counts as failed."""
    restart_deadline_s: float = 120.0
    """Seconds for a restart to be confirmed before it counts as failed."""
    reconfigure_deadline_s: float = 300.0
    """Seconds for an assignment (launch or reconfiguration) to be confirmed before it counts as failed."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.startswith("max_"):
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ConfigError(f"decision.{f.name}: expected an integer >= 0, got {value!r}")
            elif not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"decision.{f.name}: expected a number of seconds > 0, got {value!r}")

    def deadline_s(self, kind: ActionKind) -> float:
        return {
            ActionKind.REATTEMPT: self.reattempt_deadline_s,
            ActionKind.RESTART: self.restart_deadline_s,
            ActionKind.ASSIGN: self.reconfigure_deadline_s,
        }[kind]


# ---------------------------------------------------------------------------------------------------
# events (inputs)


@dataclass(frozen=True, kw_only=True)
class IncidentRaised:
    """A classified incident (``coordinator.classify``)."""

    ts: float
    incident: Incident
    generation: int | None = None
    """The task generation the reporting process ran under (``Report.generation``); an incident from an
    older generation than the task's current one is a leftover of a replaced configuration and ignored."""


@dataclass(frozen=True, kw_only=True)
class NodeJoined:
    """An agent registered (new node, or a lost/isolated node back): reconfigure ④."""

    ts: float
    node: str
    gpus: int


@dataclass(frozen=True, kw_only=True)
class NodeLost:
    """The node's agent is gone (lease expired / link dropped): a sev1 on that node."""

    ts: float
    node: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class NodeDrained:
    """An operator takes the node out of service, or its agent stops on purpose (said goodbye on the
    link); its tasks move without counting as a fault."""

    ts: float
    node: str
    reason: str = "drained by an operator"


@dataclass(frozen=True, kw_only=True)
class NodeUndrained:
    """An operator returns a drained or isolated node to service."""

    ts: float
    node: str


@dataclass(frozen=True, kw_only=True)
class TaskSubmitted:
    """A task joins the task set: reconfigure ⑥ (it stays pending if its minimum does not fit)."""

    ts: float
    spec: TaskSpec


@dataclass(frozen=True, kw_only=True)
class TaskFinished:
    """The task's training completed: its GPUs go to the others (reconfigure ⑤)."""

    ts: float
    task: str


@dataclass(frozen=True, kw_only=True)
class TaskCancelled:
    """A user withdrew the task: stop it and give its GPUs to the others."""

    ts: float
    task: str


@dataclass(frozen=True, kw_only=True)
class ActionSucceeded:
    """A tracked action (Reattempt, RestartRanks, Assign) was carried out and the ranks run."""

    ts: float
    action_id: str


@dataclass(frozen=True, kw_only=True)
class ActionFailed:
    """A tracked action could not be carried out; ``node``: where it failed, if known."""

    ts: float
    action_id: str
    reason: str
    node: str | None = None


@dataclass(frozen=True, kw_only=True)
class ProgressMade:
    """A task reported a completed step. With the current ``generation`` it also confirms a recovery."""

    ts: float
    task: str
    step: int
    generation: int | None = None


@dataclass(frozen=True, kw_only=True)
class Tick:
    """Nothing happened but time passed: lets action deadlines expire."""

    ts: float


Event = (
    IncidentRaised
    | NodeJoined
    | NodeLost
    | NodeDrained
    | NodeUndrained
    | TaskSubmitted
    | TaskFinished
    | TaskCancelled
    | ActionSucceeded
    | ActionFailed
    | ProgressMade
    | Tick
)

# ---------------------------------------------------------------------------------------------------
# actions (outputs)


@dataclass(frozen=True, kw_only=True)
class Reattempt:
    """sev3 ①: running ranks regroup and retry the failed operation in place; no process restarts."""

    action_id: str
    task: str
    generation: int
    regroup_epoch: int
    node: str
    members: tuple[int, ...]
    """Every rank of the task (they all re-form their communicators)."""
    failed_ranks: tuple[int, ...]
    """The ranks the incident named."""


@dataclass(frozen=True, kw_only=True)
class RestartRanks:
    """sev2 ②: relaunch these ranks on ``node`` with the same configuration; the others rejoin them."""

    action_id: str
    task: str
    generation: int
    restart_epoch: int
    node: str
    ranks: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class IsolateNode:
    """sev1 ③: take the node out of every plan until it is undrained or re-joins."""

    action_id: str
    node: str
    reason: str
    task: None = None


@dataclass(frozen=True, kw_only=True)
class Assign:
    """Run ``task`` as ``generation`` with these global ranks per node (launch or reconfiguration).

    Ranks on a node are consecutive and each node holds whole tensor-parallel groups.
    """

    action_id: str
    task: str
    generation: int
    placement: Mapping[str, tuple[int, ...]]
    world_size: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class StopTask:
    """Stop every process of the task (preempted, cancelled or failed). Returned before any Assign."""

    action_id: str
    task: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class MarkTaskFailed:
    """Record the task as failed, with the reason, for the user."""

    action_id: str
    task: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class Alert:
    """Something an operator should see (a node isolated or lost, a task failed)."""

    action_id: str
    message: str
    task: str | None = None
    node: str | None = None


Action = Reattempt | RestartRanks | IsolateNode | Assign | StopTask | MarkTaskFailed | Alert

# ---------------------------------------------------------------------------------------------------
# the transition table


class TaskPhase(enum.StrEnum):
    PENDING = "pending"  # in the task set, no GPUs (its minimum does not fit)
    RECONFIGURING = "reconfiguring"  # an Assign is out, not yet confirmed
    RUNNING = "running"
    REATTEMPTING = "reattempting"  # a Reattempt is out
    RESTARTING = "restarting"  # a RestartRanks is out
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"


ACTIVE_PHASES = frozenset(
    {
        TaskPhase.PENDING,
        TaskPhase.RECONFIGURING,
        TaskPhase.RUNNING,
        TaskPhase.REATTEMPTING,
        TaskPhase.RESTARTING,
    }
)


class Trigger(enum.StrEnum):
    SEV3 = "sev3"  # a sev3 incident names one of the task's ranks / nodes
    SEV2 = "sev2"
    SEV1 = "sev1"  # a node the task has ranks on was isolated or lost
    ACTION_OK = "action_ok"  # the task's outstanding action was confirmed
    ACTION_FAILED = "action_failed"  # ... failed, or missed its deadline
    PROGRESS = "progress"  # the task advanced under its current configuration: the recovery worked
    REATTEMPTS_SPENT = "reattempts_spent"  # a reattempt was due but the incident's reattempts are spent
    NO_PROGRESS = "no_progress"  # a restart was due but the restart budget is spent
    RESIZED = "resized"  # a reconfiguration gave the task a different placement (or a fresh one)
    UNPLACED = "unplaced"  # a reconfiguration gave the task no GPUs
    FINISHED = "finished"
    CANCELLED = "cancelled"


class Response(enum.StrEnum):
    MERGE = "merge"  # nothing: the incident is a consequence of the recovery under way
    REATTEMPT = "reattempt"  # emit Reattempt
    RESTART = "restart"  # emit RestartRanks on the faulty node
    RECONFIGURE = "reconfigure"  # the node is isolated already: re-plan with this task forced to move
    ESCALATE = "escalate"  # failed restart -> sev1: isolate the restart's node, re-plan
    REASSIGN = "reassign"  # failed assignment: isolate the node it failed on (if known), re-plan
    ASSIGN = "assign"  # emit Assign with the new placement
    STOP = "stop"  # emit StopTask; the task waits for GPUs
    RECOVERED = "recovered"  # clear the outstanding action
    FAIL = "fail"  # emit StopTask + MarkTaskFailed + Alert; its GPUs go to the others
    RELEASE = "release"  # finished: its GPUs go to the others
    STOP_RELEASE = "stop_release"  # cancelled while holding GPUs: emit StopTask, GPUs go to the others
    WITHDRAW = "withdraw"  # cancelled while pending: nothing to stop


class ActionKind(enum.StrEnum):
    """The tracked actions (with a deadline and a result)."""

    REATTEMPT = "reattempt"
    RESTART = "restart"
    ASSIGN = "assign"


_P = TaskPhase
_T = Trigger
_R = Response

#: Figure 7 per task. A (phase, trigger) pair not listed is ignored (e.g. anything in a final phase).
TRANSITIONS: Mapping[tuple[TaskPhase, Trigger], tuple[TaskPhase, Response]] = MappingProxyType(
    {
        # pending
        (_P.PENDING, _T.RESIZED): (_P.RECONFIGURING, _R.ASSIGN),  # ⑥ launched
        (_P.PENDING, _T.CANCELLED): (_P.CANCELLED, _R.WITHDRAW),
        # running
        (_P.RUNNING, _T.SEV3): (_P.REATTEMPTING, _R.REATTEMPT),  # ①
        (_P.RUNNING, _T.SEV2): (_P.RESTARTING, _R.RESTART),  # ②
        (_P.RUNNING, _T.SEV1): (_P.RECONFIGURING, _R.RECONFIGURE),  # ③
        (_P.RUNNING, _T.REATTEMPTS_SPENT): (_P.RESTARTING, _R.RESTART),  # no reattempts allowed: sev2
        (_P.RUNNING, _T.NO_PROGRESS): (_P.FAILED, _R.FAIL),
        (_P.RUNNING, _T.RESIZED): (_P.RECONFIGURING, _R.ASSIGN),  # ④ join / ⑤ finish / ⑥ launch elsewhere
        (_P.RUNNING, _T.UNPLACED): (_P.PENDING, _R.STOP),
        (_P.RUNNING, _T.FINISHED): (_P.FINISHED, _R.RELEASE),
        (_P.RUNNING, _T.CANCELLED): (_P.CANCELLED, _R.STOP_RELEASE),
        # reattempting
        (_P.REATTEMPTING, _T.SEV3): (_P.REATTEMPTING, _R.MERGE),
        (_P.REATTEMPTING, _T.SEV2): (_P.RESTARTING, _R.RESTART),
        (_P.REATTEMPTING, _T.SEV1): (_P.RECONFIGURING, _R.RECONFIGURE),
        (_P.REATTEMPTING, _T.ACTION_OK): (_P.RUNNING, _R.RECOVERED),
        (_P.REATTEMPTING, _T.PROGRESS): (_P.RUNNING, _R.RECOVERED),
        (_P.REATTEMPTING, _T.ACTION_FAILED): (_P.REATTEMPTING, _R.REATTEMPT),  # again, while reattempts last
        (_P.REATTEMPTING, _T.REATTEMPTS_SPENT): (_P.RESTARTING, _R.RESTART),  # upgraded to sev2
        (_P.REATTEMPTING, _T.NO_PROGRESS): (_P.FAILED, _R.FAIL),
        (_P.REATTEMPTING, _T.RESIZED): (_P.RECONFIGURING, _R.ASSIGN),
        (_P.REATTEMPTING, _T.UNPLACED): (_P.PENDING, _R.STOP),
        (_P.REATTEMPTING, _T.FINISHED): (_P.FINISHED, _R.RELEASE),
        (_P.REATTEMPTING, _T.CANCELLED): (_P.CANCELLED, _R.STOP_RELEASE),
        # restarting
        (_P.RESTARTING, _T.SEV3): (_P.RESTARTING, _R.MERGE),
        (_P.RESTARTING, _T.SEV2): (_P.RESTARTING, _R.MERGE),
        (_P.RESTARTING, _T.SEV1): (_P.RECONFIGURING, _R.RECONFIGURE),
        (_P.RESTARTING, _T.ACTION_OK): (_P.RUNNING, _R.RECOVERED),
        (_P.RESTARTING, _T.PROGRESS): (_P.RUNNING, _R.RECOVERED),
        (_P.RESTARTING, _T.ACTION_FAILED): (_P.RECONFIGURING, _R.ESCALATE),  # upgraded to sev1
        (_P.RESTARTING, _T.NO_PROGRESS): (_P.FAILED, _R.FAIL),
        (_P.RESTARTING, _T.RESIZED): (_P.RECONFIGURING, _R.ASSIGN),
        (_P.RESTARTING, _T.UNPLACED): (_P.PENDING, _R.STOP),
        (_P.RESTARTING, _T.FINISHED): (_P.FINISHED, _R.RELEASE),
        (_P.RESTARTING, _T.CANCELLED): (_P.CANCELLED, _R.STOP_RELEASE),
        # reconfiguring
        (_P.RECONFIGURING, _T.SEV3): (_P.RECONFIGURING, _R.MERGE),
        (_P.RECONFIGURING, _T.SEV2): (_P.RECONFIGURING, _R.MERGE),
        (_P.RECONFIGURING, _T.SEV1): (_P.RECONFIGURING, _R.RECONFIGURE),
        (_P.RECONFIGURING, _T.ACTION_OK): (_P.RUNNING, _R.RECOVERED),
        (_P.RECONFIGURING, _T.PROGRESS): (_P.RUNNING, _R.RECOVERED),
        (_P.RECONFIGURING, _T.ACTION_FAILED): (_P.RECONFIGURING, _R.REASSIGN),
        (_P.RECONFIGURING, _T.NO_PROGRESS): (_P.FAILED, _R.FAIL),
        (_P.RECONFIGURING, _T.RESIZED): (_P.RECONFIGURING, _R.ASSIGN),
        (_P.RECONFIGURING, _T.UNPLACED): (_P.PENDING, _R.STOP),
        (_P.RECONFIGURING, _T.FINISHED): (_P.FINISHED, _R.RELEASE),
        (_P.RECONFIGURING, _T.CANCELLED): (_P.CANCELLED, _R.STOP_RELEASE),
    }
)

#: A response that spends a budget, and the trigger that replaces it once the budget is spent
#: (looked up again from the same phase).
BUDGETED: Mapping[Response, Trigger] = MappingProxyType(
    {
        _R.REATTEMPT: _T.REATTEMPTS_SPENT,
        _R.RESTART: _T.NO_PROGRESS,
        _R.ESCALATE: _T.NO_PROGRESS,
        _R.REASSIGN: _T.NO_PROGRESS,
    }
)

_SEVERITY_TRIGGER = {Severity.SEV1: _T.SEV1, Severity.SEV2: _T.SEV2, Severity.SEV3: _T.SEV3}

# ---------------------------------------------------------------------------------------------------
# state (JSON-serialisable; the daemon persists it so that a new leader resumes)


class NodeState(enum.StrEnum):
    UP = "up"
    DRAINED = "drained"  # by an operator; back only by NodeUndrained
    ISOLATED = "isolated"  # sev1; back by NodeUndrained or NodeJoined
    LOST = "lost"  # agent gone; back by NodeJoined


@dataclass
class NodeEntry:
    gpus: int
    status: NodeState = NodeState.UP
    reason: str = ""


@dataclass
class Outstanding:
    """The one tracked action a task waits for."""

    action_id: str
    kind: ActionKind
    deadline: float
    node: str | None = None


@dataclass
class TaskEntry:
    spec: TaskSpec
    phase: TaskPhase = TaskPhase.PENDING
    generation: int = 0
    restart_epoch: int = 0
    regroup_epoch: int = 0
    placement: dict[str, list[int]] = field(default_factory=dict)  # node -> global ranks
    last_step: int | None = None
    outstanding: Outstanding | None = None
    reattempts: int = 0  # for the incident being handled
    fault_node: str | None = None
    failed_ranks: list[int] = field(default_factory=list)
    recovery_step: int | None = None  # last step known when the current recovery began
    restarts: int = 0  # restarts without progress
    no_progress_since: int | None = None  # last step known at the first of those restarts
    reason: str = ""  # why pending / failed / what the last recovery was for

    def ranks_on(self, node: str) -> list[int]:
        return self.placement.get(node, [])

    def all_ranks(self) -> tuple[int, ...]:
        return tuple(sorted(r for ranks in self.placement.values() for r in ranks))


@dataclass
class CoreState:
    now: float = 0.0
    counter: int = 0  # source of action ids
    nodes: dict[str, NodeEntry] = field(default_factory=dict)
    tasks: dict[str, TaskEntry] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "now": self.now,
            "counter": self.counter,
            "nodes": {
                n: {"gpus": e.gpus, "status": e.status.value, "reason": e.reason}
                for n, e in self.nodes.items()
            },
            "tasks": {t: _task_to_dict(e) for t, e in self.tasks.items()},
        }

    @classmethod
    def from_dict(cls, data: Any) -> CoreState:
        try:
            state = cls(now=float(data["now"]), counter=int(data["counter"]))
            for n, e in data["nodes"].items():
                state.nodes[n] = NodeEntry(int(e["gpus"]), NodeState(e["status"]), str(e["reason"]))
            for t, e in data["tasks"].items():
                state.tasks[t] = _task_from_dict(e)
        except InvalidRecord:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise InvalidRecord(
                f"decision state: malformed ({exc!r}); delete the state key to start afresh"
            ) from exc
        return state


def _task_to_dict(e: TaskEntry) -> dict[str, Any]:
    out = {f.name: getattr(e, f.name) for f in fields(e)}
    out["spec"] = e.spec.to_dict()
    out["phase"] = e.phase.value
    out["placement"] = {n: list(r) for n, r in e.placement.items()}
    out["failed_ranks"] = list(e.failed_ranks)
    o = e.outstanding
    out["outstanding"] = (
        None
        if o is None
        else {"action_id": o.action_id, "kind": o.kind.value, "deadline": o.deadline, "node": o.node}
    )
    return out


def _task_from_dict(d: dict[str, Any]) -> TaskEntry:
    raw = dict(d)
    raw["spec"] = parse_task_spec(raw["spec"], None)
    raw["phase"] = TaskPhase(raw["phase"])
    raw["placement"] = {str(n): [int(r) for r in ranks] for n, ranks in raw["placement"].items()}
    o = raw["outstanding"]
    raw["outstanding"] = (
        None
        if o is None
        else Outstanding(str(o["action_id"]), ActionKind(o["kind"]), float(o["deadline"]), o["node"])
    )
    return TaskEntry(**raw)


# ---------------------------------------------------------------------------------------------------
# the core


@dataclass(frozen=True)
class _Fault:
    """What a trigger carries to its response."""

    reason: str
    node: str | None = None
    ranks: tuple[int, ...] = ()
    placement: Mapping[str, int] | None = None  # for RESIZED


@dataclass(frozen=True)
class Transition:
    """One edge of :data:`TRANSITIONS` taken for one task (for logs and tests)."""

    task: str
    phase: TaskPhase
    trigger: Trigger
    """The trigger looked up last: a spent budget replaces the original trigger (see ``cause``)."""
    next_phase: TaskPhase
    response: Response
    cause: Trigger
    """The trigger that arrived."""
    reason: str

    def __str__(self) -> str:
        via = "" if self.cause is self.trigger else f" (via {self.cause.value})"
        return (
            f"{self.task}: {self.phase.value} --{self.trigger.value}{via}--> {self.next_phase.value} "
            f"[{self.response.value}] {self.reason}"
        )


class DecisionCore:
    """``handle(state, event) -> (new_state, actions)``: pure and deterministic; ``state`` is not modified."""

    def __init__(self, settings: DecisionSettings | None = None, allocator: Allocator | None = None) -> None:
        self.settings = settings or DecisionSettings()
        self.allocator: Allocator = allocator or EvenAllocator()

    @staticmethod
    def initial_state() -> CoreState:
        return CoreState()

    def handle(self, state: CoreState, event: Event) -> tuple[CoreState, list[Action]]:
        """Apply one event. Carry out the actions in order (every StopTask precedes the Assigns)."""
        new_state, actions, _ = self.explain(state, event)
        return new_state, actions

    def explain(self, state: CoreState, event: Event) -> tuple[CoreState, list[Action], list[Transition]]:
        """:meth:`handle`, plus the table edges it took, in order (for the daemon's log)."""
        run = _Run(self, copy.deepcopy(state))
        run.handle(event)
        return run.state, run.actions, run.transitions


class _Run:
    """One ``handle`` call: mutates its private copy of the state and collects actions."""

    def __init__(self, core: DecisionCore, state: CoreState) -> None:
        self.settings = core.settings
        self.allocator = core.allocator
        self.state = state
        self.actions: list[Action] = []
        self.transitions: list[Transition] = []
        self.replan = False
        self.forced: set[str] = set()  # tasks that must get a fresh Assign even if their placement stays
        self.faulted: set[str] = set()  # tasks that lost a worker (paper Eq. 4)
        self.responses: dict[Response, Callable[[str, TaskEntry, _Fault], None]] = {
            _R.MERGE: self._do_merge,
            _R.REATTEMPT: self._do_reattempt,
            _R.RESTART: self._do_restart,
            _R.RECONFIGURE: self._do_reconfigure,
            _R.ESCALATE: self._do_escalate,
            _R.REASSIGN: self._do_reassign,
            _R.ASSIGN: self._do_assign,
            _R.STOP: self._do_stop,
            _R.RECOVERED: self._do_recovered,
            _R.FAIL: self._do_fail,
            _R.RELEASE: self._do_release,
            _R.STOP_RELEASE: self._do_stop_release,
            _R.WITHDRAW: self._do_withdraw,
        }

    # -- plumbing -----------------------------------------------------------------------------------

    def _id(self) -> str:
        self.state.counter += 1
        return f"a{self.state.counter}"

    def _alert(self, message: str, task: str | None = None, node: str | None = None) -> None:
        self.actions.append(Alert(action_id=self._id(), message=message, task=task, node=node))

    def _track(self, entry: TaskEntry, action_id: str, kind: ActionKind, node: str | None) -> None:
        entry.outstanding = Outstanding(
            action_id, kind, self.state.now + self.settings.deadline_s(kind), node
        )

    def _tasks_on(self, node: str) -> list[str]:
        return [
            t
            for t, e in sorted(self.state.tasks.items())
            if e.phase in ACTIVE_PHASES and e.placement.get(node)
        ]

    def handle(self, event: Event) -> None:
        self.state.now = max(self.state.now, event.ts)
        self._expire()
        match event:
            case IncidentRaised():
                self._on_incident(event)
            case NodeJoined():
                self._on_join(event.node, event.gpus)
            case NodeLost():
                self._node_down(event.node, NodeState.LOST, event.reason)
            case NodeDrained():
                self._on_drain(event.node, event.reason)
            case NodeUndrained():
                self._on_undrain(event.node)
            case TaskSubmitted():
                self._on_submit(event.spec)
            case TaskFinished():
                self._fire_named(event.task, _T.FINISHED, _Fault("finished"))
            case TaskCancelled():
                self._fire_named(event.task, _T.CANCELLED, _Fault("cancelled by the user"))
            case ActionSucceeded():
                self._on_result(event.action_id, None)
            case ActionFailed():
                self._on_result(event.action_id, event)
            case ProgressMade():
                self._on_progress(event)
            case Tick():
                pass
        if self.replan:
            self._reconfigure()

    # -- the table ----------------------------------------------------------------------------------

    def _fire(self, name: str, trigger: Trigger, fault: _Fault) -> None:
        entry = self.state.tasks[name]
        edge = TRANSITIONS.get((entry.phase, trigger))
        if edge is None:
            return
        phase, response = edge
        taken = trigger
        while response in BUDGETED and self._spent(entry, response):
            taken = BUDGETED[response]
            phase, response = TRANSITIONS[(entry.phase, taken)]
        self.transitions.append(Transition(name, entry.phase, taken, phase, response, trigger, fault.reason))
        entry.phase = phase
        self.responses[response](name, entry, fault)

    def _fire_named(self, name: str, trigger: Trigger, fault: _Fault) -> None:
        if name in self.state.tasks:
            self._fire(name, trigger, fault)

    def _spent(self, entry: TaskEntry, response: Response) -> bool:
        if response is _R.REATTEMPT:
            return entry.reattempts >= self.settings.max_reattempts
        return entry.restarts >= self.settings.max_restarts_without_progress

    def _count_restart(self, entry: TaskEntry) -> None:
        if entry.restarts == 0:
            entry.no_progress_since = entry.last_step
        entry.restarts += 1

    # -- responses ----------------------------------------------------------------------------------

    def _do_merge(self, name: str, entry: TaskEntry, fault: _Fault) -> None:
        pass

    def _do_reattempt(self, name: str, entry: TaskEntry, fault: _Fault) -> None:
        if fault.node is not None and fault.ranks:
            entry.fault_node, entry.failed_ranks = fault.node, list(fault.ranks)
        if entry.reattempts == 0:
            entry.recovery_step = entry.last_step
        entry.reattempts += 1
        entry.regroup_epoch += 1
        entry.reason = fault.reason
        node = entry.fault_node or min(entry.placement)
        action = Reattempt(
            action_id=self._id(),
            task=name,
            generation=entry.generation,
            regroup_epoch=entry.regroup_epoch,
            node=node,
            members=entry.all_ranks(),
            failed_ranks=tuple(entry.failed_ranks),
        )
        self.actions.append(action)
        self._track(entry, action.action_id, ActionKind.REATTEMPT, node)

    def _do_restart(self, name: str, entry: TaskEntry, fault: _Fault) -> None:
        node = fault.node if fault.node in entry.placement else entry.fault_node
        if node not in entry.placement:  # cannot happen: faults are routed by the task's nodes
            raise PermanentError(f"decision: restart of {name!r} has no node of the task")
        assert node is not None
        self._count_restart(entry)
        entry.fault_node = node
        entry.recovery_step = entry.last_step
        entry.restart_epoch += 1
        entry.reason = fault.reason
        action = RestartRanks(
            action_id=self._id(),
            task=name,
            generation=entry.generation,
            restart_epoch=entry.restart_epoch,
            node=node,
            # Only the failed processes: the others keep their in-memory state and let the new ones
            # rejoin (issue: a healthy rank restarted with them stalled the survivors' regroup).
            ranks=tuple(r for r in entry.ranks_on(node) if r in fault.ranks) or tuple(entry.ranks_on(node)),
        )
        self.actions.append(action)
        self._track(entry, action.action_id, ActionKind.RESTART, node)

    def _force_replan(self, name: str, entry: TaskEntry, fault: _Fault) -> None:
        entry.outstanding = None
        entry.reason = fault.reason
        self.forced.add(name)
        self.faulted.add(name)
        self.replan = True

    def _do_reconfigure(self, name: str, entry: TaskEntry, fault: _Fault) -> None:
        self._force_replan(name, entry, fault)

    def _do_escalate(self, name: str, entry: TaskEntry, fault: _Fault) -> None:
        self._count_restart(entry)
        self._force_replan(name, entry, fault)
        if fault.node is not None:
            self._node_down(fault.node, NodeState.ISOLATED, f"restart of task {name} failed: {fault.reason}")

    def _do_reassign(self, name: str, entry: TaskEntry, fault: _Fault) -> None:
        self._count_restart(entry)
        self._force_replan(name, entry, fault)
        if fault.node is not None:
            self._node_down(
                fault.node, NodeState.ISOLATED, f"assignment of task {name} failed: {fault.reason}"
            )

    def _do_assign(self, name: str, entry: TaskEntry, fault: _Fault) -> None:
        assert fault.placement is not None
        entry.placement = _ranks(entry.placement, fault.placement)
        entry.generation += 1
        entry.recovery_step = entry.last_step
        action = Assign(
            action_id=self._id(),
            task=name,
            generation=entry.generation,
            placement={n: tuple(r) for n, r in sorted(entry.placement.items())},
            world_size=sum(fault.placement.values()),
            reason=fault.reason,
        )
        self.actions.append(action)
        self._track(entry, action.action_id, ActionKind.ASSIGN, None)

    def _clear(self, entry: TaskEntry, reason: str) -> None:
        entry.placement = {}
        entry.outstanding = None
        entry.reason = reason

    def _do_stop(self, name: str, entry: TaskEntry, fault: _Fault) -> None:
        self._clear(entry, fault.reason)
        self.actions.append(StopTask(action_id=self._id(), task=name, reason=fault.reason))

    def _do_recovered(self, name: str, entry: TaskEntry, fault: _Fault) -> None:
        entry.outstanding = None
        entry.reattempts = 0
        entry.fault_node = None
        entry.failed_ranks = []
        entry.reason = ""

    def _do_fail(self, name: str, entry: TaskEntry, fault: _Fault) -> None:
        since = "launch" if entry.no_progress_since is None else f"step {entry.no_progress_since}"
        reason = f"no progress across {entry.restarts} restarts since {since}; last fault: {fault.reason}"
        self._clear(entry, reason)
        self.actions.append(StopTask(action_id=self._id(), task=name, reason=reason))
        self.actions.append(MarkTaskFailed(action_id=self._id(), task=name, reason=reason))
        self._alert(f"task {name} failed: {reason}", task=name)
        self.replan = True

    def _do_release(self, name: str, entry: TaskEntry, fault: _Fault) -> None:
        self._clear(entry, fault.reason)
        self.replan = True

    def _do_stop_release(self, name: str, entry: TaskEntry, fault: _Fault) -> None:
        self._do_stop(name, entry, fault)
        self.replan = True

    def _do_withdraw(self, name: str, entry: TaskEntry, fault: _Fault) -> None:
        entry.reason = fault.reason

    # -- events -------------------------------------------------------------------------------------

    def _expire(self) -> None:
        for name, entry in sorted(self.state.tasks.items()):
            o = entry.outstanding
            if o is not None and o.deadline <= self.state.now:
                reason = f"{o.kind.value} {o.action_id} not confirmed within its deadline"
                self._fire(name, _T.ACTION_FAILED, _Fault(reason, node=o.node))

    def _on_incident(self, event: IncidentRaised) -> None:
        inc = event.incident
        if inc.severity is None:
            return  # degradation: recorded by the daemon, no recovery
        reason = f"{inc.severity} {inc.kind.value} on {inc.node} ({inc.incident_id})"
        if inc.severity is Severity.SEV1:
            self._node_down(inc.node, NodeState.ISOLATED, reason)
            return
        for name in self._tasks_on(inc.node):
            entry = self.state.tasks[name]
            if inc.task is not None and inc.task != name:
                continue
            if event.generation is not None and event.generation < entry.generation:
                continue  # a leftover of a replaced configuration
            on_node = entry.ranks_on(inc.node)
            ranks = (inc.rank,) if inc.rank in on_node else tuple(on_node)
            self._fire(name, _SEVERITY_TRIGGER[inc.severity], _Fault(reason, node=inc.node, ranks=ranks))

    def _node_down(self, node: str, status: NodeState, reason: str) -> None:
        """A sev1 on ``node``: take it out of service, and every task on it reconfigures."""
        entry = self.state.nodes.get(node)
        if entry is None:
            return  # never joined: nothing runs there
        if entry.status in (NodeState.UP, NodeState.DRAINED):
            if status is NodeState.ISOLATED:
                self.actions.append(IsolateNode(action_id=self._id(), node=node, reason=reason))
            self._alert(f"node {node} {status.value}: {reason}", node=node)
            self.replan = True
        if entry.status is not status and entry.status is not NodeState.LOST:
            entry.status, entry.reason = status, reason
        for name in self._tasks_on(node):
            ranks = tuple(self.state.tasks[name].ranks_on(node))
            self._fire(name, _T.SEV1, _Fault(reason, node=node, ranks=ranks))

    def _on_join(self, node: str, gpus: int) -> None:
        entry = self.state.nodes.get(node)
        if entry is None:
            self.state.nodes[node] = NodeEntry(gpus)
            self.replan = True
        elif entry.status is NodeState.DRAINED:
            entry.gpus = gpus  # an operator's drain outlives agent restarts
        elif entry.status is not NodeState.UP or entry.gpus != gpus:
            entry.gpus, entry.status, entry.reason = gpus, NodeState.UP, ""
            self.replan = True

    def _on_drain(self, node: str, reason: str) -> None:
        entry = self.state.nodes.get(node)
        if entry is not None and entry.status is NodeState.UP:
            entry.status, entry.reason = NodeState.DRAINED, reason
            self.replan = True

    def _on_undrain(self, node: str) -> None:
        entry = self.state.nodes.get(node)
        if entry is not None and entry.status in (NodeState.DRAINED, NodeState.ISOLATED):
            entry.status, entry.reason = NodeState.UP, ""
            self.replan = True

    def _on_submit(self, spec: TaskSpec) -> None:
        old = self.state.tasks.get(spec.name)
        if old is not None and old.phase in ACTIVE_PHASES:
            self._alert(
                f"task {spec.name} is already in the task set; cancel it before resubmitting", task=spec.name
            )
            return
        # a resubmitted name continues its generation count, so late reports of the old run stay stale
        generation = 0 if old is None else old.generation
        self.state.tasks[spec.name] = TaskEntry(spec, generation=generation, reason="waiting for a plan")
        self.replan = True

    def _on_result(self, action_id: str, failure: ActionFailed | None) -> None:
        for name, entry in sorted(self.state.tasks.items()):
            o = entry.outstanding
            if o is None or o.action_id != action_id:
                continue
            if failure is None:
                self._fire(name, _T.ACTION_OK, _Fault("confirmed"))
            else:
                reason = f"{o.kind.value} {action_id} failed: {failure.reason}"
                self._fire(name, _T.ACTION_FAILED, _Fault(reason, node=failure.node or o.node))
            return
        # an action that was superseded (or never tracked): its result changes nothing

    def _on_progress(self, event: ProgressMade) -> None:
        entry = self.state.tasks.get(event.task)
        if entry is None or entry.phase not in ACTIVE_PHASES:
            return
        if entry.last_step is None or event.step > entry.last_step:
            entry.last_step = event.step
        if entry.restarts and (entry.no_progress_since is None or event.step > entry.no_progress_since):
            entry.restarts, entry.no_progress_since = 0, None
        if event.generation is None or event.generation != entry.generation:
            return
        # a reattempt or restart keeps the generation: only a step past the fault proves it worked
        same_config = entry.phase in (TaskPhase.REATTEMPTING, TaskPhase.RESTARTING)
        if same_config and entry.recovery_step is not None and event.step <= entry.recovery_step:
            return
        self._fire(event.task, _T.PROGRESS, _Fault(f"step {event.step} completed"))

    # -- reconfiguration ----------------------------------------------------------------------------

    def _reconfigure(self) -> None:
        """Re-plan every active task over the usable nodes (paper: the global optimum may move others)."""
        active = [t for t, e in sorted(self.state.tasks.items()) if e.phase in ACTIVE_PHASES]
        usable = {
            n: e.gpus for n, e in sorted(self.state.nodes.items()) if e.status is NodeState.UP and e.gpus > 0
        }
        specs = [self.state.tasks[t].spec for t in active]
        counts, placement = self._plan(specs, usable)
        # tasks losing all their GPUs first, so that every StopTask comes before the Assigns that reuse them
        for name in active:
            entry = self.state.tasks[name]
            if counts[name] == 0:
                reason = (
                    f"waiting for GPUs: needs at least {entry.spec.min_gpus}, "
                    f"{sum(usable.values())} usable in the cluster"
                )
                if entry.placement:
                    self._fire(name, _T.UNPLACED, _Fault(f"preempted; {reason}"))
                else:
                    entry.reason = reason
        for name in active:
            entry = self.state.tasks[name]
            new = placement[name]
            if not new:
                continue
            if new != {n: len(r) for n, r in entry.placement.items()} or name in self.forced:
                why = entry.reason if name in self.forced else "new plan"
                self._fire(name, _T.RESIZED, _Fault(why, placement=new))

    def _plan(
        self, specs: list[TaskSpec], usable: dict[str, int]
    ) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
        gpus_per_node = max(usable.values(), default=0)
        current = {s.name: sum(len(r) for r in self.state.tasks[s.name].placement.values()) for s in specs}
        holdings = {
            s.name: {n: len(r) for n, r in self.state.tasks[s.name].placement.items() if n in usable}
            for s in specs
        }
        tp = {s.name: s.tp_size for s in specs}
        total = sum(usable.values())
        # counts that cannot be cut into whole TP groups on these nodes: offer the allocator less
        for budget in range(total, -1, -1):
            counts = self.allocator.allocate(specs, budget, gpus_per_node, current, set(self.faulted))
            _check_counts(counts, specs, budget)
            try:
                placement = place(counts, usable, holdings, tp)
            except PermanentError:
                continue
            if budget < total:
                self._alert(
                    f"{total - budget} GPUs left idle: the plan could not be cut into whole TP groups"
                )
            return counts, placement
        raise PermanentError("decision: not even an empty plan could be placed")  # place({0...}) never fails


def _check_counts(counts: Mapping[str, int], specs: list[TaskSpec], budget: int) -> None:
    """The allocator is pluggable: refuse a plan that breaks its contract rather than act on it."""
    for spec in specs:
        got = counts.get(spec.name)
        if got is None or not spec.valid_count(got):
            raise PermanentError(f"allocator: invalid count {got!r} for task {spec.name!r}")
    if sum(counts.values()) > budget:
        raise PermanentError(f"allocator: {sum(counts.values())} GPUs planned, only {budget} usable")


def _ranks(old: Mapping[str, list[int]], new: Mapping[str, int]) -> dict[str, list[int]]:
    """Global ranks per node: consecutive blocks, nodes the task keeps first in their old rank order."""
    kept = sorted((n for n in new if old.get(n)), key=lambda n: (min(old[n]), n))
    order = kept + sorted(n for n in new if not old.get(n))
    out: dict[str, list[int]] = {}
    rank = 0
    for node in order:
        out[node] = list(range(rank, rank + new[node]))
        rank += new[node]
    return out


# ---------------------------------------------------------------------------------------------------
# JSON for events and actions (trace files, logs, the daemon's action records)

_EVENT_TYPES: dict[str, type[Any]] = {
    c.__name__: c
    for c in (
        IncidentRaised,
        NodeJoined,
        NodeLost,
        NodeDrained,
        NodeUndrained,
        TaskSubmitted,
        TaskFinished,
        TaskCancelled,
        ActionSucceeded,
        ActionFailed,
        ProgressMade,
        Tick,
    )
}
_ACTION_TYPES: dict[str, type[Any]] = {
    c.__name__: c for c in (Reattempt, RestartRanks, IsolateNode, Assign, StopTask, MarkTaskFailed, Alert)
}


def to_dict(item: Event | Action) -> dict[str, Any]:
    """An event or action as JSON-ready data, with its class name under ``type``."""
    out: dict[str, Any] = {"type": type(item).__name__}
    for f in fields(item):
        value = getattr(item, f.name)
        if isinstance(value, Incident | TaskSpec):
            value = value.to_dict()
        elif isinstance(value, tuple):
            value = list(value)
        elif f.name == "placement":
            value = {n: list(r) for n, r in value.items()}
        out[f.name] = value
    return out


def from_dict(data: Any) -> Event | Action:
    """Inverse of :func:`to_dict`; raises InvalidRecord on anything malformed."""
    if not isinstance(data, dict) or not isinstance(data.get("type"), str):
        raise InvalidRecord("decision record: expected an object with a 'type'")
    cls = _EVENT_TYPES.get(data["type"]) or _ACTION_TYPES.get(data["type"])
    if cls is None:
        raise InvalidRecord(f"decision record: unknown type {data['type']!r}")
    raw = {k: v for k, v in data.items() if k != "type"}
    try:
        if "incident" in raw:
            raw["incident"] = Incident.from_dict(raw["incident"])
        if "spec" in raw:
            raw["spec"] = parse_task_spec(raw["spec"], None)
        if "placement" in raw:
            raw["placement"] = {n: tuple(r) for n, r in raw["placement"].items()}
        for key in ("members", "failed_ranks", "ranks"):
            if key in raw:
                raw[key] = tuple(raw[key])
        result: Event | Action = cls(**raw)
    except InvalidRecord:
        raise
    except (TypeError, ValueError, AttributeError) as exc:
        raise InvalidRecord(f"decision record {data['type']}: {exc}") from exc
    return result
