"""The decision core's state: per task and per node, JSON-serialisable (the daemon persists it so that
a new leader resumes where the old one stopped)."""

from __future__ import annotations

import contextlib
import enum
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field, fields, replace
from typing import Any, TypeVar

from coordinator.decision.actions import ActionKind
from coordinator.decision.throughput import Measured, StepRate
from coordinator.tasks import TaskSpec, parse_task_spec
from plans.problem import MAX_CLUSTER_GPUS
from unicron.kernel.errors import InvalidRecord
from unicron.kernel.types import MAX_NODE_GPUS, conforms


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



class UpdateOutcome(enum.StrEnum):
    """How an update that relaunched a task went (``unicron update --wait`` waits for the last two)."""

    PENDING = "pending"  # the updated spec has not completed a step at the task's generation yet
    CONFIRMED = "confirmed"  # it has
    ROLLED_BACK = "rolled_back"  # it failed before (update_failed): the spec that ran was put back


#: The sev2 fault times a node entry keeps (the newest): the most ``DecisionSettings.flap_faults`` may be.
SEV2_FAULTS_KEPT = 8


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
    drained: str = ""
    """An operator's drain (its reason) while the node is lost or isolated: it comes back drained."""
    suspected_by: str = ""
    """Isolated on suspicion only: the task whose failed restart or assignment isolated the node, no
    fault of the node's own reported. Should that task fail again elsewhere before making progress,
    the failure was the task's (a crash on every launch) and the node returns to service; progress
    elsewhere, a fault the node reports (not a lost link) or a second task's failure there makes the
    isolation stand."""
    sev2_faults: tuple[float, ...] = ()
    """When (the core's clock) the node's recent sev2 faults started a recovery, oldest first: at most
    ``SEV2_FAULTS_KEPT``, none older than ``DecisionSettings.flap_window_s`` before the newest. Enough of
    them within the window make the node flapping (isolated); its return to service clears them."""


@dataclass
class Outstanding:
    """The one tracked action a task waits for."""

    action_id: str
    kind: ActionKind
    deadline: float
    node: str | None = None
    """The node a restart or reattempt is for (the one to isolate if it fails)."""
    waiting: list[str] = field(default_factory=list)
    """Nodes whose ``assign/<node>`` record carries the action and that have not confirmed it yet."""


@dataclass
class TaskEntry:
    spec: TaskSpec
    phase: TaskPhase = TaskPhase.PENDING
    generation: int = 0
    restart_epoch: int = 0
    regroup_epoch: int = 0
    membership_epoch: int = 0  # grows on every in-place resize (the generation stays)
    store_node: str = ""  # the node hosting the task's store after an in-place resize moved it ("": the launch's)
    world_size: int = 0  # the ranks (ids 0..world_size-1) of the generation's launch; 0 before one
    confirmed: bool = False  # the generation's ranks all ran (a recovery or its Assign was confirmed)
    placement: dict[str, list[int]] = field(default_factory=dict)  # node -> global ranks
    last_step: int | None = None
    outstanding: Outstanding | None = None
    reattempts: int = 0  # for the incident being handled
    fault_node: str | None = None
    failed_ranks: list[int] = field(default_factory=list)
    relaunching: dict[str, list[int]] = field(default_factory=dict)
    """node -> ranks the restart under way relaunches (a restart widened by a dead peer has several)."""
    relaunch_epoch: int = 0
    """The restart epoch of the restart under way's first relaunch: processes launched at it or later
    are that restart's (widened, it relaunches each node at a higher epoch)."""
    recovery_step: int | None = None  # last step known when the current recovery began
    resized_step: int | None = None
    """Last step known at the latest in-place resize: the survivors' sev3 reports of the peers it removed
    (their collective of the next iteration broke) belong to it, not to a new reattempt."""
    resized_at: float | None = None
    """When the latest in-place resize was decided (the core's clock): see ``resize_echo_s``."""
    joiners: list[int] = field(default_factory=list)
    """Ranks launched by in-place resizes not yet confirmed (a grow's joiners): the resize is confirmed
    once each of them has completed an iteration (``ProgressMade.joined``), not by the survivors' steps."""
    joining_since: int = 0
    """The membership epoch of the oldest of those resizes: a process of a joiner's rank launched before
    it (on a node the rank left) proves nothing."""
    restarts: int = 0  # restarts without progress
    no_progress_since: int | None = None  # last step known at the first of those restarts
    fault_followed: bool = False
    """In this streak of restarts without progress the task failed again on another node after a failed
    recovery isolated one on suspicion: its failures are its own, and isolate no node until it progresses."""
    flapped_off: str = ""
    """The node this task's device faults last got isolated as flapping: should its faults then make
    another node flap, that node is isolated only if they did not follow the task (``flapped_ranks``,
    ``faulted_since_flap``; docs/decision.md, "A flapping node is isolated")."""
    flapped_ranks: list[int] = field(default_factory=list)
    """The ranks whose faults made a node flap (each isolation's in ``flapped_world``): faults of theirs
    on another node followed the rank there (its own kernel, not a GPU)."""
    flapped_world: int = 0
    """How many ranks the task had when ``flapped_ranks`` were recorded (0: none, or a state from before
    it): a rank id means the same code and data only in a world of that size; in another, nothing tells
    the task's faults from a GPU's, and no second node is isolated for it."""
    faulted_since_flap: dict[str, float] = field(default_factory=dict)
    """node -> when (the core's clock) this task last had a fresh device fault there since
    ``flapped_off`` was isolated, none older than ``flap_window_s`` when written: faults on more than
    one node within the window are the task's, not one node's."""
    reason: str = ""  # why pending / failed / what the last recovery was for
    submitted_at: float = 0.0
    """When this run of the task was submitted (the core's clock; 0 in states written before it existed):
    what was measured before it was an earlier run's under the same name (``Grounding.seed``)."""
    ended_at: float = 0.0
    """When the task left the active phases (the core's clock; 0 while active, and for a task that ended
    before this existed): the oldest ended tasks are retired first (``DecisionSettings.ended_tasks_kept``)."""
    rate: StepRate | None = None
    """The steps of uninterrupted training at the current configuration (None during a recovery)."""
    measured: Measured = field(default_factory=Measured)
    """Achieved FLOP/s per GPU count, T(t, x) as measured (:mod:`coordinator.decision.throughput`)."""
    previous_spec: TaskSpec | None = None
    """The spec the task ran with before an update that relaunched it, while the updated spec has not
    completed a step: should the update's launch fail through the task's own fault (its new command
    cannot start), or a process of its generation fail (the new command crashed), the task goes back to
    it instead of failing or restarting the new command (``update_failed`` -> ``rollback``)."""
    update: UpdateOutcome | None = None
    """How the task's last update that relaunched it went, which ``ListTasks`` shows: None when there was
    none, or a later update relaunched nothing (there is no launch to wait for)."""
    update_reason: str = ""
    """Why that update was rolled back (the rollback's reason); "" otherwise."""
    last_placement: dict[str, list[int]] = field(default_factory=dict)
    """node -> global ranks where the task ran when it was stopped to wait for GPUs (``placement``
    cleared, the task still active), until its next ``Assign`` names it (``Assign.previous_placement``):
    the executor's records, which say where each rank ran before, went with the stop, and its restore
    would not find the peers holding its in-memory replicas. Empty otherwise; persisted (left out
    while empty), so a new leader names them too."""

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
    retired_generation: int = 0
    """The highest generation of any task entry retired from ``tasks``: a task submitted under a name
    the state no longer holds starts above it, so late records of a retired run under that name stay
    stale without the state keeping every name it ever saw."""
    failures: int = 0
    """Failures for the planner's failure rate: nodes taken out of service and incidents that started a
    recovery (``DecisionCore._count_failure``)."""
    gpu_hours: float = 0.0
    """GPU-hours the usable nodes ran, up to ``now``: the failure rate's exposure."""
    failure_gpu_hours: float = 0.0
    """``gpu_hours`` at the latest failure: the rate is re-estimated at a failure, not at each decision
    (every new estimate re-plans the lookup table), so a new leader must know the one it was made with."""
    idle_alerted: str = ""
    """The situation (active tasks, idle GPUs) of the last "GPUs left idle" alert, "" when none stands:
    a re-plan of the same situation (any task event re-plans) posted it again each time."""

    def resumed(self, earliest_deadline: float) -> CoreState:
        """This state as a coordinator taking the lead adopts it: no outstanding action's deadline
        before ``earliest_deadline``. What confirms an action (a rank's progress, a node's result)
        while no coordinator led is read only once the new leader's watches start, so a deadline
        that passed meanwhile says nothing of the action; expiring it first isolated a healthy node.
        A copy: entries it changes are new objects."""
        tasks = dict(self.tasks)
        for name, e in self.tasks.items():
            o = e.outstanding
            if o is not None and o.deadline < earliest_deadline:
                late = replace(o, deadline=earliest_deadline, waiting=list(o.waiting))
                tasks[name] = replace(e, outstanding=late)
        return replace(self, tasks=tasks)

    def to_dict(self) -> dict[str, object]:
        return {
            "now": self.now,
            "counter": self.counter,
            "retired_generation": self.retired_generation,
            "failures": self.failures,
            "gpu_hours": self.gpu_hours,
            "failure_gpu_hours": self.failure_gpu_hours,
            **({"idle_alerted": self.idle_alerted} if self.idle_alerted else {}),
            "nodes": {
                n: {"gpus": e.gpus, "status": e.status.value, "reason": e.reason, "drained": e.drained,
                    **({"suspected_by": e.suspected_by} if e.suspected_by else {}),
                    **({"sev2_faults": list(e.sev2_faults)} if e.sev2_faults else {})}
                for n, e in self.nodes.items()
            },
            "tasks": {t: _task_to_dict(e) for t, e in self.tasks.items()},
        }

    @classmethod
    def from_dict(cls, data: object) -> CoreState:
        """Inverse of :meth:`to_dict`; raises InvalidRecord on anything malformed."""
        if not isinstance(data, dict):
            raise InvalidRecord("decision state: expected an object; delete the state key to start afresh")
        with _where("top level"):
            state = cls(now=float(_typed(data["now"], float, "now")), counter=_typed(data["counter"], int, "counter"),
                        # absent in states written before it existed
                        retired_generation=_typed(data.get("retired_generation", 0), int, "retired_generation"),
                        failures=_typed(data.get("failures", 0), int, "failures"),
                        gpu_hours=float(_typed(data.get("gpu_hours", 0.0), float, "gpu_hours")),
                        failure_gpu_hours=float(_typed(data.get("failure_gpu_hours", 0.0), float,
                                                       "failure_gpu_hours")),
                        idle_alerted=_typed(data.get("idle_alerted", ""), str, "idle_alerted"))
            nodes = _typed(data["nodes"], dict[str, dict[str, Any]], "nodes")
            tasks = _typed(data["tasks"], dict[str, dict[str, Any]], "tasks")
        for n, e in nodes.items():
            with _where(_path("nodes", n)):
                state.nodes[n] = NodeEntry(
                    _gpus(e["gpus"], _path("nodes", n, "gpus")), _member(NodeState, e["status"], _path("nodes", n, "status")),
                    _typed(e["reason"], str, _path("nodes", n, "reason")),
                    # absent in states written before it existed
                    _typed(e.get("drained", ""), str, _path("nodes", n, "drained")),
                    _typed(e.get("suspected_by", ""), str, _path("nodes", n, "suspected_by")),
                    # likewise (none recorded); a longer list than is kept keeps its newest
                    tuple(float(t) for t in _typed(e.get("sev2_faults", []), list[float],
                                                   _path("nodes", n, "sev2_faults")))[-SEV2_FAULTS_KEPT:],
                )
        for t, e in tasks.items():
            with _where(_path("tasks", t)):
                state.tasks[t] = _task_from_dict(t, e, state.now)
        return state


def _task_to_dict(e: TaskEntry) -> dict[str, object]:
    out = {f.name: getattr(e, f.name) for f in fields(e)}
    out["spec"] = e.spec.to_dict()
    out["previous_spec"] = None if e.previous_spec is None else e.previous_spec.to_dict()
    out["phase"] = e.phase.value
    out["update"] = None if e.update is None else e.update.value
    out["placement"] = {n: list(r) for n, r in e.placement.items()}
    out["last_placement"] = {n: list(r) for n, r in e.last_placement.items()}
    for key in _OMITTED_WHEN_EMPTY:
        if not out[key]:
            del out[key]  # a reader from before the field refuses unknown fields
    out["failed_ranks"] = list(e.failed_ranks)
    out["joiners"] = list(e.joiners)
    out["rate"] = None if e.rate is None else {"generation": e.rate.generation, "gpus": e.rate.gpus,
                                               "first": list(e.rate.first), "last": list(e.rate.last)}
    out["measured"] = {str(g): f for g, f in sorted(e.measured.flops.items())}  # JSON keys are strings
    o = e.outstanding
    out["outstanding"] = (
        None
        if o is None
        else {
            "action_id": o.action_id,
            "kind": o.kind.value,
            "deadline": o.deadline,
            "node": o.node,
            "waiting": list(o.waiting),
        }
    )
    return out


def _typed(value: Any, hint: Any, where: str) -> Any:
    """``value`` if it is a ``hint`` in JSON terms (element by element, finite numbers), else
    InvalidRecord naming the field: a wrong type here would raise deep inside the decision core."""
    if not conforms(value, hint):
        raise InvalidRecord(f"decision state: {where}: bad value {value!r:.80} (expected {hint}); "
                            "delete the state key to start afresh")
    return value


def _gpus(value: Any, where: str, bound: int = MAX_NODE_GPUS) -> int:
    """A node's GPU count, bounded as its registration (NodeInfo) is (a task's, with ``bound``, as the
    planner's cluster is): a damaged one would raise or mislead the planner later, inside the leader's loop."""
    count: int = _typed(value, int, where)
    if not 0 <= count <= bound:
        raise InvalidRecord(f"decision state: {where}: {count} is not a GPU count in [0, {bound}]; "
                            "delete the state key to start afresh")
    return count


E = TypeVar("E", bound=enum.Enum)


def _path(*parts: str) -> str:
    """Where in the state, for an error message: a node or task name that is not plain printable text
    is quoted, so the message stays one line."""
    return ".".join(p if p.isprintable() and "." not in p else repr(p) for p in parts)


@contextlib.contextmanager
def _where(where: str) -> Iterator[None]:
    """A missing key or an unknown field as InvalidRecord saying where in the state it is."""
    try:
        yield
    except InvalidRecord:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise InvalidRecord(
            f"decision state: {where}: malformed ({exc!r:.200}); delete the state key to start afresh"
        ) from exc


def _member(kind: type[E], value: Any, where: str) -> E:
    try:
        return kind(value)
    except ValueError:
        raise InvalidRecord(f"decision state: {where}: {value!r:.80} is not one of {[k.value for k in kind]}; "
                            "delete the state key to start afresh") from None


#: TaskEntry fields left out of the state while empty: a reader from before them refuses unknown fields
_OMITTED_WHEN_EMPTY = ("last_placement", "flapped_ranks", "flapped_world", "faulted_since_flap")

#: TaskEntry fields stored as plain JSON values (the others are parsed below)
_PLAIN = {f.name for f in fields(TaskEntry)} - {"spec", "phase", "outstanding", "rate", "measured", "previous_spec",
                                                "update"}


def _rate(value: Any, where: str) -> StepRate | None:
    if value is None:
        return None
    o = _typed(value, dict[str, Any], where)
    # a task's count, not a node's: a task on more than one node's worth of GPUs failed to load, and a
    # new leader dropped the cluster's largest task
    return StepRate(_typed(o["generation"], int, f"{where}.generation"),
                    _gpus(o["gpus"], f"{where}.gpus", MAX_CLUSTER_GPUS),
                    _point(o["first"], f"{where}.first"), _point(o["last"], f"{where}.last"))


def _point(value: Any, where: str) -> tuple[float, int]:
    """A (time, step) report of a :class:`StepRate`."""
    point = _typed(value, list[float], where)
    if len(point) != 2 or not isinstance(point[1], int):
        raise InvalidRecord(f"decision state: {where}: bad value {value!r:.80} (expected [time, step]); "
                            "delete the state key to start afresh")
    return float(point[0]), point[1]


def _spec(name: str, value: Any, key: str) -> TaskSpec:
    """Task ``name``'s stored spec at ``key`` of its entry."""
    try:
        spec = parse_task_spec(value, None, stored=True)
    except InvalidRecord as exc:  # its message names the spec's field; say whose spec it is
        raise InvalidRecord(f"decision state: {_path('tasks', name, key)}: {exc}") from exc
    if spec.name != name:  # the core finds a task's entry by its spec's name
        raise InvalidRecord(f"decision state: {_path('tasks', name, key, 'name')}: {spec.name!r} is not "
                            "the entry's name; delete the state key to start afresh")
    return spec


def _task_from_dict(name: str, d: dict[str, Any], now: float) -> TaskEntry:
    raw = dict(d)
    if isinstance(faulted := raw.get("faulted_since_flap"), list):
        # written as a list of nodes, without times: taken as faults of now, which they may be
        raw["faulted_since_flap"] = {n: now for n in _typed(faulted, list[str], _path("tasks", name,
                                                                                      "faulted_since_flap"))}
    raw.setdefault("relaunching", {})  # absent in states written before it existed
    # likewise; the restart epoch is what a restart under way was judged by before
    raw.setdefault("relaunch_epoch", raw.get("restart_epoch", 0))
    raw.setdefault("submitted_at", 0.0)  # likewise; 0: every kept measurement is taken as this run's
    raw.setdefault("ended_at", 0.0)  # likewise; 0: retired before any task that ended since
    raw.setdefault("fault_followed", False)  # likewise
    raw.setdefault("last_placement", {})  # likewise, and left out while empty
    raw["rate"] = _rate(raw.get("rate"), _path("tasks", name, "rate"))  # likewise (absent: None)
    where = _path("tasks", name, "measured")
    raw["measured"] = Measured({_gpus(int(g), where, MAX_CLUSTER_GPUS): float(f)
                                for g, f in _typed(raw.get("measured", {}), dict[str, float], where).items()})
    hints = typing.get_type_hints(TaskEntry)
    for key in _PLAIN & set(raw):
        _typed(raw[key], hints[key], _path("tasks", name, key))
    raw["spec"] = _spec(name, raw["spec"], "spec")
    previous = raw.get("previous_spec")  # absent in states written before it existed: no update to undo
    raw["previous_spec"] = None if previous is None else _spec(name, previous, "previous_spec")
    raw["phase"] = _member(TaskPhase, raw["phase"], _path("tasks", name, "phase"))
    update = raw.get("update")  # absent in states written before it existed: no update to report
    raw["update"] = None if update is None else _member(UpdateOutcome, update, _path("tasks", name, "update"))
    o = raw["outstanding"]
    if o is not None:
        where = _path("tasks", name, "outstanding")
        raw["outstanding"] = Outstanding(
            _typed(o["action_id"], str, f"{where}.action_id"),
            _member(ActionKind, o["kind"], f"{where}.kind"),
            float(_typed(o["deadline"], float, f"{where}.deadline")),
            _typed(o["node"], str | None, f"{where}.node"),
            # absent in states written before it existed
            _typed(o.get("waiting", []), list[str], f"{where}.waiting"),
        )
    return TaskEntry(**raw)

