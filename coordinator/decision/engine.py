"""The engine: :class:`DecisionCore` applies one event to a state and returns the new state and the
actions, by firing triggers through :data:`~coordinator.decision.table.TRANSITIONS`.

A reconfiguration asks the :class:`~coordinator.allocation.Allocator` for counts over *all* tasks
(the global optimum may move healthy tasks too), then :func:`~coordinator.placement.place` for nodes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from coordinator.allocation import Allocator, EvenAllocator, model_spec
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
from coordinator.decision.resize import InPlace, launch_store_node, plan_in_place, store_move
from coordinator.decision.settings import DecisionSettings
from coordinator.decision.state import (
    ACTIVE_PHASES,
    SEV2_FAULTS_KEPT,
    CoreState,
    NodeEntry,
    NodeState,
    Outstanding,
    TaskEntry,
    TaskPhase,
    UpdateOutcome,
)
from coordinator.decision.table import BUDGETED, SEVERITY_TRIGGER, TRANSITIONS, Response, Trigger
from coordinator.decision.throughput import StepRate, achieved_flops
from coordinator.placement import place
from coordinator.tasks import TaskSpec
from unicron.kernel.errors import PermanentError
from unicron.kernel.types import ErrorKind, Incident, Severity

_T = Trigger
_R = Response


@dataclass(frozen=True)
class _Fault:
    """What a trigger carries to its response."""

    reason: str
    node: str | None = None
    ranks: tuple[int, ...] = ()
    placement: Mapping[str, int] | None = None  # for RESIZED
    in_place: InPlace | None = None  # for RESIZED_IN_PLACE
    fatal: bool = False  # the reason is the task's failure itself (TASK_ERROR), not a spent budget


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
    """``handle(state, event) -> (new_state, actions)``: pure and deterministic; ``state`` is not modified.

    The new state shares every node and task entry the event did not touch with ``state`` (copy on
    write: an event touches a few entries, and copying all of them made a decision on 2,048 nodes cost
    hundreds of milliseconds). Treat states as values: change one only through :meth:`handle`.
    """

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
        run = _Run(self, state)
        run.handle(event)
        return run.state, run.actions, run.transitions


def _copy_task(e: TaskEntry) -> TaskEntry:
    """A copy of ``e`` that shares nothing mutable with it (the spec is frozen)."""
    o = e.outstanding
    return dataclasses.replace(
        e,
        placement={n: list(r) for n, r in e.placement.items()},
        last_placement={n: list(r) for n, r in e.last_placement.items()},
        failed_ranks=list(e.failed_ranks),
        joiners=list(e.joiners),
        relaunching={n: list(r) for n, r in e.relaunching.items()},
        outstanding=None if o is None else dataclasses.replace(o, waiting=list(o.waiting)),
    )


class _Run:
    """One ``handle`` call: builds the new state copy-on-write and collects actions.

    ``self.state`` starts as a new :class:`CoreState` whose dicts hold the caller's entries; an entry is
    copied into it the first time this run changes it (:meth:`_task` / :meth:`_node`), so the caller's
    state is never modified. Every write to an entry goes through those two methods; reads may use
    ``self.state`` directly.
    """

    def __init__(self, core: DecisionCore, state: CoreState) -> None:
        self.settings = core.settings
        self.allocator = core.allocator
        self.state = dataclasses.replace(state, nodes=dict(state.nodes), tasks=dict(state.tasks))
        self._own_tasks: set[str] = set()  # entries of self.state that are this run's copies
        self._own_nodes: set[str] = set()
        self.actions: list[Action] = []
        self.transitions: list[Transition] = []
        self.replan = False
        self.forced: set[str] = set()  # tasks that must get a fresh Assign even if their placement stays
        self.faulted: set[str] = set()  # tasks that lost a worker (paper Eq. 4)
        self.relaunched: set[str] = set()  # forced tasks none of whose ranks runs: no in-place change
        self.isolated_now: set[str] = set()  # nodes this decision isolates (their ranks are killed)
        self.ended = False  # a task left the active phases: the oldest ended ones may be retired
        self.responses: dict[Response, Callable[[str, TaskEntry, _Fault], None]] = {
            _R.MERGE: self._do_merge,
            _R.REATTEMPT: self._do_reattempt,
            _R.RESTART: self._do_restart,
            _R.RESTART_ALL: self._do_restart_all,
            _R.RECONFIGURE: self._do_reconfigure,
            _R.ESCALATE: self._do_escalate,
            _R.REASSIGN: self._do_reassign,
            _R.ASSIGN: self._do_assign,
            _R.RESIZE: self._do_resize,
            _R.STOP: self._do_stop,
            _R.RECOVERED: self._do_recovered,
            _R.FAIL: self._do_fail,
            _R.RELAUNCH: self._do_relaunch,
            _R.RELAUNCH_UPDATED: self._do_relaunch_updated,
            _R.ROLLBACK: self._do_rollback,
            _R.RELEASE: self._do_release,
            _R.STOP_RELEASE: self._do_stop_release,
            _R.WITHDRAW: self._do_withdraw,
        }

    # -- plumbing -----------------------------------------------------------------------------------

    def _task(self, name: str) -> TaskEntry:
        """Task ``name``'s entry, to change: copied from the caller's state on first use."""
        if name not in self._own_tasks:
            self.state.tasks[name] = _copy_task(self.state.tasks[name])
            self._own_tasks.add(name)
        return self.state.tasks[name]

    def _node(self, node: str) -> NodeEntry | None:
        """Node ``node``'s entry, to change (None if it never joined): copied on first use."""
        entry = self.state.nodes.get(node)
        if entry is not None and node not in self._own_nodes:
            entry = self.state.nodes[node] = dataclasses.replace(entry)
            self._own_nodes.add(node)
        return entry

    def _id(self) -> str:
        self.state.counter += 1
        return f"a{self.state.counter}"

    def _alert(self, message: str, task: str | None = None, node: str | None = None) -> None:
        self.actions.append(Alert(action_id=self._id(), message=message, task=task, node=node))

    def _track(
        self, entry: TaskEntry, action_id: str, kind: ActionKind, node: str | None, waiting: list[str]
    ) -> None:
        """``waiting``: the nodes whose ``assign/<node>`` record the executor rewrites for this action."""
        deadline = self.state.now + self.settings.deadline_s(kind)
        entry.outstanding = Outstanding(action_id, kind, deadline, node, sorted(waiting))

    def _tasks_on(self, node: str) -> list[str]:
        return [
            t
            for t, e in sorted(self.state.tasks.items())
            if e.phase in ACTIVE_PHASES and e.placement.get(node)
        ]

    def handle(self, event: Event) -> None:
        self._expose(event)
        self.state.now = max(self.state.now, event.ts)
        self._expire()
        fired = len(self.transitions)  # the edges from here on are the event's own (not the expiries')
        down = _down_node(event)
        in_service = down is not None and down in self.state.nodes and self.state.nodes[down].status in (
            NodeState.UP, NodeState.DRAINED)
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
            case NodeForgotten():
                self._on_forget(event.node)
            case TaskSubmitted():
                self._on_submit(event.spec)
            case TaskUpdated():
                self._on_update(event.spec)
            case TaskFinished():
                self._fire_named(event.task, _T.FINISHED, _Fault("finished"))
            case TaskStopped():
                self._fire_named(event.task, _T.STOPPED, _Fault(event.reason))
            case TaskCancelled():
                self._fire_named(event.task, _T.CANCELLED, _Fault("cancelled by the user"))
            case ActionSucceeded():
                self._on_success(event)
            case ActionFailed():
                self._on_failure(event)
            case ProgressMade():
                self._on_progress(event)
            case Tick():
                pass
        self._count_failure(event, fired, in_service)
        if self.replan:
            self._reconfigure()
        if isinstance(event, ProgressMade):
            self._measure(event)
        for name in self._own_tasks:
            entry = self.state.tasks[name]
            if entry.rate is not None and (entry.phase is not TaskPhase.RUNNING or entry.outstanding is not None):
                # a step rate spans uninterrupted training only: a pause to recover (a reattempt keeps
                # the generation and the GPUs) is the failure's cost, D_transition, not a slower T(t, x)
                entry.rate = None
        if self.ended or (isinstance(event, Tick) and len(self.state.tasks) > self.settings.ended_tasks_kept):
            self._retire()  # on a tick too: a lowered setting, or a state kept from before retirement

    # -- the planner's measured inputs (coordinator.grounding reads them) -------------------------------

    def _expose(self, event: Event) -> None:
        """The failure rate's exposure, kept in the state so that a new leader plans with it: the
        GPU-hours the usable nodes ran until ``event``."""
        usable = sum(e.gpus for e in self.state.nodes.values() if e.status is NodeState.UP)
        self.state.gpu_hours += max(event.ts - self.state.now, 0.0) * usable / 3600.0

    def _count_failure(self, event: Event, fired: int, in_service: bool) -> None:
        """The failure rate's count: a node the event took out of service (``in_service``: it was
        before), or an incident that started a recovery. An incident merged into the recovery under
        way (the peers' crashes and hangs that one rank's death sets off) is its consequence: counted,
        one killed rank of a 4-rank task read as 12 failures and the planner held back GPUs."""
        if _down_node(event) is not None:
            counts = in_service
        elif isinstance(event, IncidentRaised) and not self._leftover(event):
            # a peer's death that widens the restart under way is the same burst (as for its budget)
            # an update's command that crashed is the user's change failing, not the cluster's: no failure
            counts = any(t.response is not _R.MERGE and t.cause not in (_T.PEER_DIED, _T.UPDATE_FAILED)
                         for t in self.transitions[fired:])
        else:
            return
        if counts:
            self.state.failures += 1
            self.state.failure_gpu_hours = self.state.gpu_hours

    def _leftover(self, event: IncidentRaised) -> bool:
        """Whether an incident is no failure to count: a degradation, or a task's report from a
        configuration already replaced (the failure that replaced it was counted; a node's sev1 is
        the node's own, whatever the generation)."""
        inc = event.incident
        if inc.severity is None:
            return True
        entry = self.state.tasks.get(inc.task or "")
        return (inc.severity is not Severity.SEV1 and entry is not None and event.generation is not None
                and event.generation < entry.generation)

    def _measure(self, event: ProgressMade) -> None:
        """T(t, x): the task's achieved FLOP/s at its GPU count, from uninterrupted training at the
        configuration the decision left it in."""
        entry = self.state.tasks.get(event.task)
        if (entry is None or entry.spec.model is None or event.generation != entry.generation
                or entry.phase is not TaskPhase.RUNNING or entry.outstanding is not None):
            return
        entry = self._task(event.task)
        gpus = len(entry.all_ranks())
        rate = (StepRate(entry.generation, gpus, (event.ts, event.step), (event.ts, event.step))
                if entry.rate is None else entry.rate.advance(entry.generation, gpus, event.ts, event.step))
        flops = achieved_flops(model_spec(entry.spec).flops_per_iteration, rate)
        entry.rate = None if flops is None and rate.steps_per_s() is not None else rate  # absurd: afresh
        if flops is not None and gpus > 0:
            entry.measured = entry.measured.with_point(gpus, flops)

    # -- the table ----------------------------------------------------------------------------------

    def _fire(self, name: str, trigger: Trigger, fault: _Fault) -> None:
        edge = TRANSITIONS.get((self.state.tasks[name].phase, trigger))
        if edge is None:
            return
        entry = self._task(name)
        phase, response = edge
        taken = trigger
        while response in BUDGETED and self._spent(entry, response):
            taken = BUDGETED[response]
            phase, response = TRANSITIONS[(entry.phase, taken)]
        self.transitions.append(Transition(name, entry.phase, taken, phase, response, trigger, fault.reason))
        if entry.phase in ACTIVE_PHASES and phase not in ACTIVE_PHASES:
            entry.ended_at = self.state.now
            self.ended = True
            entry.last_placement = {}  # no Assign will name it
        entry.phase = phase
        self.responses[response](name, entry, fault)
        if phase not in ACTIVE_PHASES:
            self._confirm_suspicion(name)  # the task's last word: a later run of the name proves nothing

    def _fire_named(self, name: str, trigger: Trigger, fault: _Fault) -> None:
        if name in self.state.tasks:
            self._fire(name, trigger, fault)

    def _retire(self) -> None:
        """Drop the ended tasks past ``ended_tasks_kept``, the one that ended first first."""
        ended = sorted((e.ended_at, n) for n, e in self.state.tasks.items() if e.phase not in ACTIVE_PHASES)
        for _, name in ended[:max(0, len(ended) - self.settings.ended_tasks_kept)]:
            retired = self.state.tasks.pop(name)
            self._own_tasks.discard(name)
            self.state.retired_generation = max(self.state.retired_generation, retired.generation)

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
        # the executor bumps regroup_epoch on every node of the task: each of them confirms
        self._track(entry, action.action_id, ActionKind.REATTEMPT, node, list(entry.placement))

    def _do_restart(self, name: str, entry: TaskEntry, fault: _Fault) -> None:
        node = fault.node if fault.node in entry.placement else entry.fault_node
        if node not in entry.placement:  # cannot happen: faults are routed by the task's nodes
            raise PermanentError(f"decision: restart of {name!r} has no node of the task")
        assert node is not None
        widening = entry.outstanding is not None and entry.outstanding.kind is ActionKind.RESTART
        if not widening:  # a widened restart is the same recovery: one burst of deaths spends one restart
            self._count_restart(entry)
            entry.relaunching = {}
            entry.relaunch_epoch = entry.restart_epoch + 1
        if not widening:  # a widened restart's deaths follow the first fault's: its node is the one to blame
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
        entry.relaunching[node] = sorted({*entry.relaunching.get(node, []), *action.ranks})
        self.actions.append(action)
        # A widened restart is tracked as one action for every node it relaunches; at its deadline it
        # isolates the first fault's node (peers died in the collective it broke), not the last one.
        self._track(entry, action.action_id, ActionKind.RESTART, entry.fault_node, [node])

    def _do_restart_all(self, name: str, entry: TaskEntry, fault: _Fault) -> None:
        """Every rank of the task, on every node, stopped and relaunched as one new attempt."""
        node = fault.node if fault.node in entry.placement else min(entry.placement)
        self._count_restart(entry)
        delay = self.settings.backoff_s(entry.restarts)
        entry.fault_node = node
        entry.recovery_step = entry.last_step
        entry.restart_epoch += 1  # one counter for the task: the same TORCHELASTIC_RESTART_COUNT everywhere
        entry.relaunch_epoch = entry.restart_epoch
        entry.reason = fault.reason
        entry.relaunching = {n: list(r) for n, r in sorted(entry.placement.items())}
        action = RestartTask(
            action_id=self._id(),
            task=name,
            generation=entry.generation,
            restart_epoch=entry.restart_epoch,
            placement={n: tuple(r) for n, r in sorted(entry.placement.items())},
            delay_s=delay,
            reason=fault.reason,
        )
        self.actions.append(action)
        # ``node``: the one a failed restart escalates to (sev1) - where the fault was seen
        self._track(entry, action.action_id, ActionKind.RESTART, node, list(entry.placement))
        assert entry.outstanding is not None
        entry.outstanding.deadline += delay  # the backoff is not the restart's time to be confirmed

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
        self._suspect(name, entry, fault, f"restart of task {name} failed: {fault.reason}")

    def _do_reassign(self, name: str, entry: TaskEntry, fault: _Fault) -> None:
        self._count_restart(entry)
        self._force_replan(name, entry, fault)
        self._suspect(name, entry, fault, f"assignment of task {name} failed: {fault.reason}")

    def _suspect(self, name: str, entry: TaskEntry, fault: _Fault, reason: str) -> None:
        """A failed recovery isolates the node it blames (Figure 7's escalation to sev1), on suspicion:
        nothing says whether the node or the task is at fault. Unless the task already had a node
        isolated so in this streak without progress: failing again elsewhere, the fault follows the
        task (a job that crashes on every launch), so that one comes back, and no node is isolated
        for the task's failures until it makes progress."""
        if self._fault_followed(name, fault.node):
            entry.fault_followed = True
        # a failure on no one node (a multi-node action) still shows the suspected node was not the cause
        if fault.node is None or entry.fault_followed:
            return
        self._node_down(fault.node, NodeState.ISOLATED, reason, suspected_by=name)

    def _fault_followed(self, name: str, node: str | None) -> bool:
        """Task ``name`` failed again without progress, on ``node`` (None: on no one node): the nodes
        its earlier failed recoveries isolated on suspicion return to service. Whether any did."""
        suspects = sorted(n for n, e in self.state.nodes.items() if e.suspected_by == name and n != node)
        for n in suspects:
            seen = self.state.nodes[n]
            if seen.status is NodeState.ISOLATED:
                back = NodeState.DRAINED if seen.drained else NodeState.UP
                self._node_set(n, status=back, reason=seen.drained, drained="", suspected_by="")
                self.replan = True
                self._alert(f"node {n} back in service: task {name} failed again elsewhere before any "
                            f"progress, so its failed recovery on {n} was the task's fault", node=n)
            else:
                self._node_set(n, suspected_by="")
        return bool(suspects)

    def _confirm_suspicion(self, name: str) -> None:
        """Task ``name`` made progress elsewhere, or ended: the nodes it isolated on suspicion stay isolated."""
        for n in [n for n, e in self.state.nodes.items() if e.suspected_by == name]:
            self._node_set(n, suspected_by="")

    def _do_relaunch(self, name: str, entry: TaskEntry, fault: _Fault) -> None:
        """Every rank stopped unasked: the task goes on as a new generation from their snapshot. A
        relaunch spends the restart budget, so a task stopped again and again without a step fails."""
        self._count_restart(entry)
        self._do_relaunch_updated(name, entry, fault)
        self._alert(f"task {name}: {fault.reason}; relaunching it as a new generation", task=name)

    def _do_relaunch_updated(self, name: str, entry: TaskEntry, fault: _Fault) -> None:
        """A new generation wherever the re-plan puts the task, never in place (none of its running
        ranks can go on). The user's change, not a failure: no restart is counted (``relaunch`` adds it)."""
        self._force_replan(name, entry, fault)
        self.relaunched.add(name)

    def _do_rollback(self, name: str, entry: TaskEntry, fault: _Fault) -> None:
        """The updated spec cannot launch (a typo in its command, say) or crashed (an ImportError in the
        new script), and never completed a step: the task goes back to the spec it ran with, relaunched
        as a new generation that restores the update's on-demand snapshot. Not the job's failure: no
        restart is counted. The previous spec is dropped, so its own launch failing after this fails
        the task (no loop)."""
        previous = entry.previous_spec
        assert previous is not None  # the trigger fires only with one
        changes = ", ".join(previous.launch_changes(entry.spec)) or "spec"
        entry.spec, entry.previous_spec = previous, None
        message = (f"task {name}: update failed ({changes}): {fault.reason}; rolled back to the spec it ran "
                   "with and relaunched from the update's snapshot")
        entry.update, entry.update_reason = UpdateOutcome.ROLLED_BACK, message
        self._do_relaunch_updated(name, entry, dataclasses.replace(fault, reason=message))
        self._alert(message, task=name)

    def _do_assign(self, name: str, entry: TaskEntry, fault: _Fault) -> None:
        assert fault.placement is not None
        if entry.spec.restarts_whole and entry.placement:  # running (or lost a node): a relaunch, not a launch
            entry.restart_epoch += 1
        entry.placement = _ranks(entry.placement, fault.placement)
        entry.generation += 1
        entry.store_node = ""  # a new launch's store is on its rank 0's node
        entry.joiners = []  # every rank of a new generation starts: nobody joins
        entry.world_size = sum(fault.placement.values())
        entry.confirmed = False
        entry.recovery_step = entry.last_step
        action = Assign(
            action_id=self._id(),
            task=name,
            generation=entry.generation,
            placement={n: tuple(r) for n, r in sorted(entry.placement.items())},
            world_size=sum(fault.placement.values()),
            reason=fault.reason,
            restart_epoch=entry.restart_epoch if entry.spec.restarts_whole else 0,
            previous_placement={n: tuple(r) for n, r in sorted(entry.last_placement.items())},
        )
        entry.last_placement = {}  # named once: the records the executor writes now say it
        self.actions.append(action)
        self._track(entry, action.action_id, ActionKind.ASSIGN, None, list(entry.placement))

    def _do_resize(self, name: str, entry: TaskEntry, fault: _Fault) -> None:
        """Same generation, new membership: only joiners start, only leavers stop."""
        plan = fault.in_place
        assert plan is not None
        entry.placement = {n: list(r) for n, r in plan.placement.items()}
        entry.membership_epoch += 1
        entry.store_node = plan.store_node
        entry.recovery_step = entry.resized_step = entry.last_step
        entry.resized_at = self.state.now
        self._add_joiners(entry, plan)
        # only a restart on a node now gone, or of a grow's pending joiners, can be under way (see
        # _may_resize): the joiners are waited for as such (_add_joiners)
        entry.relaunching = {}
        entry.reason = fault.reason
        action = ResizeInPlace(
            action_id=self._id(),
            task=name,
            generation=entry.generation,
            membership_epoch=entry.membership_epoch,
            placement={n: tuple(r) for n, r in sorted(plan.placement.items())},
            members=plan.members,
            joiners=plan.joiners,
            leaving=plan.leaving,
            lost=plan.lost,
            world_size=entry.world_size,
            reason=fault.reason,
            store_node=plan.store_node,
            fresh_store=plan.fresh_store,
        )
        self.actions.append(action)
        # confirmed by a step completed after it (the generation stays: older steps say nothing), where
        # it has joiners by an iteration of each; if that does not come in time, their node (when they
        # share one) is the one to isolate, as a failed restart's is
        hosts = _joiner_hosts(entry)
        node = next(iter(hosts)) if len(hosts) == 1 else None
        self._track(entry, action.action_id, ActionKind.RESIZE, node, list(entry.placement))

    def _clear(self, entry: TaskEntry, reason: str) -> None:
        if entry.phase in ACTIVE_PHASES and entry.placement:
            # stopped to wait for GPUs: its next Assign names where the ranks ran (their replicas'
            # holders), which the stop removes from the executor's records
            entry.last_placement = {n: list(r) for n, r in entry.placement.items()}
        entry.placement = {}
        entry.relaunching = {}  # a restart under way ends with the ranks it relaunched
        entry.outstanding = None
        entry.reason = reason

    def _do_stop(self, name: str, entry: TaskEntry, fault: _Fault) -> None:
        self._clear(entry, fault.reason)
        self.actions.append(StopTask(action_id=self._id(), task=name, reason=fault.reason))

    def _do_recovered(self, name: str, entry: TaskEntry, fault: _Fault) -> None:
        entry.outstanding = None
        entry.confirmed = True
        entry.reattempts = 0
        entry.fault_node = None
        entry.failed_ranks = []
        entry.relaunching = {}
        entry.joiners = []
        entry.reason = ""

    def _do_fail(self, name: str, entry: TaskEntry, fault: _Fault) -> None:
        self._fault_followed(name, fault.node)
        if fault.fatal:
            reason = fault.reason
        else:
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
        for name in sorted(self.state.tasks):
            # read afresh: an earlier expiry may have replaced the entry (a sev1 re-plans every task
            # on the node, superseding their outstanding actions)
            entry = self.state.tasks[name]
            o = entry.outstanding
            if o is not None and o.deadline <= self.state.now:
                reason = f"{o.kind.value} {o.action_id} not confirmed within its deadline"
                self._fire(name, _T.ACTION_FAILED, _Fault(reason, node=_to_blame(entry, o)))

    def _on_incident(self, event: IncidentRaised) -> None:
        inc = event.incident
        if inc.severity is None:
            return  # degradation: recorded by the daemon, no recovery
        reason = f"{inc.severity} {inc.kind.value} on {inc.node} ({inc.incident_id})"
        if inc.severity is Severity.SEV1:
            # the coordinator's own word that it lost the node (its link) says nothing of its hardware:
            # a node already lost stays lost, and comes back when its agent registers
            liveness = inc.kind is ErrorKind.LOST_CONNECTION
            self._node_down(inc.node, NodeState.ISOLATED, reason, liveness=liveness)
            return
        if inc.severity is Severity.SEV2 and self._fresh_device_fault(event):
            for name in self._concerned(event):
                if self.state.tasks[name].flapped_off:
                    entry = self._task(name)
                    entry.faulted_since_flap = {**self._recent_faults(entry), inc.node: self.state.now}
            flapping = self._flapping(inc.node)
            # escalated to sev1 (the node isolated, every task on it re-planned) unless the faults
            # followed their task here: then it is restarted as any sev2 is
            if flapping and not self._flapped_elsewhere(event, flapping):
                for name in self._concerned(event):
                    entry = self._task(name)
                    entry.flapped_off, entry.faulted_since_flap = inc.node, {}
                    world = len(entry.all_ranks())
                    # rank ids of another world name other code and data: they start afresh with this one
                    kept = entry.flapped_ranks if entry.flapped_world == world else []
                    entry.flapped_ranks = sorted({*kept, *_fault_ranks(entry, inc)})
                    entry.flapped_world = world
                self._node_down(inc.node, NodeState.ISOLATED, f"{flapping}; last: {reason}")
                return
        for name in self._tasks_on(inc.node):
            entry = self.state.tasks[name]
            if not _concerns(name, entry, event):
                continue
            ranks = _fault_ranks(entry, inc)
            if _update_failed(entry, inc, event.generation):
                # the new command crashed before its first step (an ImportError, a bad flag): restarting
                # it would only fail again until the budget failed the job that trained fine before
                why = f"{reason}: {inc.message}" if inc.message else reason  # the exit and its exception
                self._fire(name, _T.UPDATE_FAILED, _Fault(why, node=inc.node, ranks=ranks))
                continue
            if inc.kind is ErrorKind.STORE_LOST and not entry.spec.restarts_whole:
                self._store_lost(name, entry, inc, reason)
                continue
            self._fire(name, self._trigger(entry, event), _Fault(reason, node=inc.node, ranks=ranks))

    def _trigger(self, entry: TaskEntry, event: IncidentRaised) -> Trigger:
        """The trigger an incident (sev2 or sev3, not a store's loss) fires for a task it concerns."""
        inc = event.incident
        assert inc.severity is not None
        trigger = SEVERITY_TRIGGER[inc.severity]
        if trigger is _T.SEV3 and _echo_of_resize(entry, inc, self.state.now, self.settings.resize_echo_s):
            trigger = _T.RESIZE_ECHO
        if inc.kind is ErrorKind.FENCED:
            trigger = _T.STOPPED
        elif _restart_died(entry, inc, event):
            trigger = _T.RESTART_DIED
        elif entry.spec.restarts_whole:
            trigger = _T.TASK_FAULT  # sev2 and sev3 alike: only a new attempt of every rank recovers it
        elif trigger is _T.SEV2 and inc.kind is ErrorKind.EXITED_ABNORMALLY and not _relaunched(entry, inc):
            trigger = _T.PEER_DIED
        elif trigger is _T.SEV2 and _launching(entry, inc, event.generation):
            trigger = _T.LAUNCH_FAULT
        return trigger

    def _concerned(self, event: IncidentRaised) -> list[str]:
        """The tasks on the incident's node that it is the fault of (:func:`_concerns`)."""
        node = event.incident.node
        return [name for name in self._tasks_on(node) if _concerns(name, self.state.tasks[name], event)]

    def _flapped_elsewhere(self, event: IncidentRaised, flapping: str) -> bool:
        """Whether the faults of a task this flapping fault concerns, which made another node flap
        before, followed the task here (a kernel of its own, not a GPU): isolating node after node would
        drain the cluster one hour at a time. Alerts instead; the node's history starts afresh. Not
        followed (a second bad GPU, isolated too): the task ran on other nodes since without device
        faults there within ``flap_window_s`` (one stray fault long ago says nothing of the faults
        here), and the faults here are not on a rank whose faults made a node flap before, in the
        same world (a bug of the last rank, or a poison sample sharded by the world size, lands on another
        rank once the task shrank: no rank id tells the task's faults from a GPU's then)."""
        inc = event.incident
        node = inc.node
        followed = [(name, e.flapped_off) for name in self._concerned(event)
                    if (e := self.state.tasks[name]).flapped_off not in ("", node)
                    and (len(e.all_ranks()) != e.flapped_world  # its ranks are other ranks now: no telling
                         or set(_fault_ranks(e, inc)) & set(e.flapped_ranks)  # the faults moved with their rank
                         or set(self._recent_faults(e)) - {node}  # faults on other nodes too, lately
                         or not set(e.placement) - {node})]  # it ran nowhere else: no telling
        for name, earlier in followed:
            self._alert(f"{flapping} on {node}, but task {name}'s faults made node {earlier} flap before: "
                        f"they follow the task (its code, not a GPU); {node} is kept in service", task=name,
                        node=node)
        if followed:
            self._node_set(node, sev2_faults=())
        return bool(followed)

    def _recent_faults(self, entry: TaskEntry) -> dict[str, float]:
        """``entry.faulted_since_flap`` within ``flap_window_s`` of now: a node's fault further back is no
        part of the faults that make a node flap now, and kept for good it disabled the rule for the task."""
        window = self.settings.flap_window_s
        return {n: t for n, t in entry.faulted_since_flap.items() if self.state.now - t <= window}

    def _fresh_device_fault(self, event: IncidentRaised) -> bool:
        """Whether a sev2 incident is a fresh fault of its node's GPUs: a CUDA error or an illegal memory
        access (a rank that exited or hung says nothing of the GPU: counted, a job's own bug made every
        node it ran on flap), that restarts a task there which was not recovering and had made progress
        since its last restart (its restart budget whole). Not one merged into the recovery under way (a
        consequence of its fault), nor a launch's or a restart's own failure (judged as such: the latter
        escalates by itself). (An update's rollback takes only exits and exceptions, ``SPEC_FAULTS``: no
        device fault is one.) Nor a fault before the task progressed
        again: crashes without progress are the restart budget's to judge (a job crashing on every
        resume is failed, and no node is blamed for it)."""
        inc = event.incident
        if inc.kind not in DEVICE_FAULTS:
            return False
        for name in self._tasks_on(inc.node):
            entry = self.state.tasks[name]
            if not _concerns(name, entry, event) or entry.restarts:
                continue
            trigger = self._trigger(entry, event)
            edge = TRANSITIONS.get((entry.phase, trigger))
            if trigger in (_T.SEV2, _T.TASK_FAULT) and edge is not None and edge[1] is not _R.MERGE:
                return True
        return False

    def _flapping(self, node: str) -> str:
        """Records a fresh sev2 fault of ``node`` now; why the node is flapping if this fault makes its
        faults within ``flap_window_s`` reach ``flap_faults``, else "". Each restart that worked reset
        the task's restart budget, so without this a GPU failing every few steps was restarted for ever,
        each time a failure of the cluster for the planner's failure rate."""
        threshold, window = self.settings.flap_faults, self.settings.flap_window_s
        entry = self._node(node)
        if entry is None or threshold == 0:
            return ""
        now = self.state.now
        entry.sev2_faults = (*(t for t in entry.sev2_faults if now - t <= window), now)[-SEV2_FAULTS_KEPT:]
        if len(entry.sev2_faults) < threshold:
            return ""
        span = now - entry.sev2_faults[-threshold]
        return f"flapping: {threshold} sev2 faults in {span:g} s (the limit: {threshold - 1} within {window:g} s)"

    def _store_lost(self, name: str, entry: TaskEntry, inc: Incident, reason: str) -> None:
        """The task's store sidecar died on a node still in service: the same membership goes on with
        a fresh store, which the running ranks re-seed (an in-place resize that changes nothing else);
        where no in-place change is allowed now, a new generation, which brings its own store. (Taken
        for a rank's fault, it restarted ranks onto the dead store, and the failed restart isolated a
        healthy node.) A task whose recovery is ``restart`` gets a fresh store with its next attempt."""
        if inc.node != (entry.store_node or launch_store_node(entry.placement)):
            return  # the store has moved on since
        if self._may_resize(entry, _T.STORE_LOST):
            self._fire(name, _T.STORE_LOST, _Fault(reason, node=inc.node,
                                                   in_place=store_move(entry.placement, inc.node)))
        else:
            self._fire(name, _T.STOPPED, _Fault(f"its store was lost: {reason}", node=inc.node))

    def _node_down(self, node: str, status: NodeState, reason: str, liveness: bool = False,
                   suspected_by: str = "") -> None:
        """A sev1 on ``node``: take it out of service, and every task on it reconfigures.
        ``liveness``: only the coordinator's word that it lost the node's link, no fault of the node's
        hardware: a node already LOST stays lost (a fault reported after the loss isolates it), and a
        node isolated on suspicion stays suspected (an agent restart or a network blip confirmed it
        for good, while its lease expiring did not).
        ``suspected_by``: the task whose failed recovery isolates it ("": a fault of the node's own)."""
        seen = self.state.nodes.get(node)
        if seen is None:
            return  # never joined: nothing runs there
        if suspected_by and self._restarting_on(node, suspected_by):
            # A second task's ranks died there too: its restart is superseded by this very isolation
            # (every task on the node reconfigures), so its own failure there could never be counted.
            suspected_by = ""
        if (seen.status is NodeState.ISOLATED and status is NodeState.ISOLATED and seen.suspected_by
                and seen.suspected_by != suspected_by and not liveness):
            self._node_set(node, suspected_by="")  # its own fault, or a second task's failure: it stands
        if seen.status in (NodeState.UP, NodeState.DRAINED):
            if status is NodeState.ISOLATED:
                self.actions.append(IsolateNode(action_id=self._id(), node=node, reason=reason))
                self.isolated_now.add(node)
            self._alert(f"node {node} {status.value}: {reason}", node=node)
            self.replan = True
        # An isolation outlives the node's loss (its agent's lease expiring, then re-registering, is no
        # repair), and a node lost then found faulty (a late report) is isolated: only an operator's
        # undrain brings it back.
        if seen.status is not status and seen.status is not NodeState.ISOLATED and (
                seen.status is not NodeState.LOST or (status is NodeState.ISOLATED and not liveness)):
            entry = self._node(node)
            assert entry is not None
            if seen.status is NodeState.DRAINED:
                entry.drained = seen.reason  # an operator's drain outlives the node's loss
            entry.status, entry.reason = status, reason
            entry.suspected_by = suspected_by if status is NodeState.ISOLATED else ""
        for name in self._tasks_on(node):
            ranks = tuple(self.state.tasks[name].ranks_on(node))
            self._fire(name, _T.SEV1, _Fault(reason, node=node, ranks=ranks))

    def _restarting_on(self, node: str, name: str) -> bool:
        """Whether a task other than ``name`` has a restart under way for a fault on ``node`` (its first
        fault's node: peers that died in a collective the fault broke say nothing of theirs). One whose
        fault followed it is excepted: its failures are its own."""
        for other in self._tasks_on(node):
            entry = self.state.tasks[other]
            o = entry.outstanding
            if (other != name and not entry.fault_followed and o is not None and o.kind is ActionKind.RESTART
                    and o.node == node):
                return True
        return False

    def _on_join(self, node: str, gpus: int) -> None:
        self._back_in_service(node)
        seen = self.state.nodes.get(node)
        if seen is None:
            self.state.nodes[node] = NodeEntry(gpus)
            self._own_nodes.add(node)
            self.replan = True
        elif seen.status is NodeState.DRAINED:
            if seen.gpus != gpus:
                self._node_set(node, gpus=gpus)  # an operator's drain outlives agent restarts
        elif seen.drained:  # lost or isolated while drained: back drained, until NodeUndrained
            self._node_set(node, gpus=gpus, status=NodeState.DRAINED, reason=seen.drained, drained="",
                           suspected_by="", **self._repaired(seen))
        elif seen.status is not NodeState.UP or seen.gpus != gpus:
            if gpus < seen.gpus:  # its GPUs are numbered anew: a rank may be on one it no longer has
                self._relaunch_on(node, f"node {node} re-registered with {gpus} GPUs (had {seen.gpus})")
            # back from isolation (a repair) as an undrain brings it: no suspicion left to settle
            self._node_set(node, gpus=gpus, status=NodeState.UP, reason="", suspected_by="",
                           **self._repaired(seen))
            self.replan = True

    @staticmethod
    def _repaired(seen: NodeEntry) -> dict[str, tuple[float, ...]]:
        """What a node's return from isolation (a repair) clears besides its status: its sev2 faults.
        A node merely lost and back (an agent restart) keeps them: nothing was repaired."""
        return {"sev2_faults": ()} if seen.status is NodeState.ISOLATED else {}

    def _back_in_service(self, node: str) -> None:
        """A node this very decision isolated is back (its NodeJoined's deadline check isolated it, say):
        the IsolateNode kills every rank there, so none may be kept as an in-place survivor."""
        if node in self.isolated_now:
            self.relaunched.update(self._tasks_on(node))

    def _relaunch_on(self, node: str, reason: str) -> None:
        """Every task with ranks on ``node`` gets a new generation wherever the re-plan puts it, never an
        in-place change, which would keep its ranks there on the GPUs and processes they had."""
        for name in self._tasks_on(node):
            self._task(name).reason = reason
            self.forced.add(name)
            self.relaunched.add(name)

    def _node_set(self, node: str, **changes: object) -> None:
        entry = self._node(node)
        assert entry is not None
        for key, value in changes.items():
            setattr(entry, key, value)

    def _on_drain(self, node: str, reason: str) -> None:
        entry = self.state.nodes.get(node)
        if entry is None:
            return
        if entry.status is NodeState.UP:
            self._node_set(node, status=NodeState.DRAINED, reason=reason)
            self.replan = True
        elif entry.status in (NodeState.LOST, NodeState.ISOLATED):
            self._node_set(node, drained=reason)  # kept out of service when it comes back

    def _on_undrain(self, node: str) -> None:
        self._back_in_service(node)
        entry = self.state.nodes.get(node)
        if entry is not None and entry.drained:
            self._node_set(node, drained="")
        if entry is not None and entry.status in (NodeState.DRAINED, NodeState.ISOLATED):
            # the operator's word that it is fit again: its earlier sev2 faults make it flapping no more
            self._node_set(node, status=NodeState.UP, reason="", suspected_by="", sev2_faults=())
            self.replan = True

    def _on_forget(self, node: str) -> None:
        """The node's entry goes (``unicron forget``): a node retired for good otherwise stayed lost or
        isolated for ever, walked by every decision. Refused while it is up or an active task still
        names it: its ranks, a restart or an action waiting on it, its store."""
        entry = self.state.nodes.get(node)
        if entry is None:
            raise PermanentError(f"no node {node!r} to forget; see 'unicron nodes'")
        if entry.status is NodeState.UP:
            raise PermanentError(f"node {node} is up; drain it and stop its agent first")
        holding = [t for t, e in sorted(self.state.tasks.items()) if e.phase in ACTIVE_PHASES and _names(e, node)]
        if holding:
            raise PermanentError(f"node {node} still holds task(s) {', '.join(holding)}; wait until they have "
                                 "moved off it (see 'unicron tasks')")
        del self.state.nodes[node]
        self._own_nodes.discard(node)

    def _on_submit(self, spec: TaskSpec) -> None:
        old = self.state.tasks.get(spec.name)
        if old is not None and old.phase in ACTIVE_PHASES:
            self._alert(
                f"task {spec.name} is already in the task set; cancel it before resubmitting", task=spec.name
            )
            return
        # a resubmitted name continues its generation count, so late reports of the old run stay stale
        # (one retired from the state: above every retired run's)
        generation = self.state.retired_generation if old is None else old.generation
        self.state.tasks[spec.name] = TaskEntry(spec, generation=generation, reason="waiting for a plan",
                                                submitted_at=self.state.now)
        self._own_tasks.add(spec.name)
        self.replan = True

    def _on_update(self, spec: TaskSpec) -> None:
        old = self.state.tasks.get(spec.name)
        if old is None or old.phase not in ACTIVE_PHASES:
            self._alert(f"task {spec.name} is not in the task set; submit it instead", task=spec.name)
            return
        changes = old.spec.launch_changes(spec)
        entry = self._task(spec.name)
        if not (changes and entry.placement) and entry.update is not UpdateOutcome.PENDING:
            # this update relaunches nothing, so an earlier one's outcome is not its own to report (one
            # still pending is: its spec is part of this one)
            entry.update, entry.update_reason = None, ""
        if spec == old.spec:
            return
        entry.spec = spec
        if changes and entry.placement:
            entry.update, entry.update_reason = UpdateOutcome.PENDING, ""  # until a step or a rollback
            # what to go back to should the new spec fail to launch: the spec that ran (a second update
            # before the first made a step keeps the first's; a spec that never stepped is nothing to keep)
            if entry.previous_spec is None and entry.last_step is not None:
                entry.previous_spec = old.spec
            elif entry.previous_spec == spec:  # the user put it back: nothing else to go back to
                entry.previous_spec = None
            self._fire(spec.name, _T.UPDATED, _Fault(f"spec updated ({', '.join(changes)})"))
        self.replan = True

    def _outstanding(self, action_id: str) -> tuple[str, Outstanding] | None:
        """The task waiting for ``action_id``; None for a superseded (or never tracked) action."""
        for name, entry in sorted(self.state.tasks.items()):
            o = entry.outstanding
            if o is not None and o.action_id == action_id:
                return name, o
        return None

    def _on_success(self, event: ActionSucceeded) -> None:
        found = self._outstanding(event.action_id)
        if found is None:
            return  # a late result of a superseded action changes nothing
        name, o = found
        if event.node is not None and o.waiting:
            if event.node in o.waiting:
                own = self._task(name).outstanding
                assert own is not None
                own.waiting.remove(event.node)
                o = own
            if o.waiting:
                return  # the ranks on the other nodes have not been confirmed yet
        self._fire(name, _T.ACTION_OK, _Fault("confirmed"))

    def _on_failure(self, event: ActionFailed) -> None:
        found = self._outstanding(event.action_id)
        if found is None:
            return
        name, o = found
        reason = f"{o.kind.value} {event.action_id} failed: {event.reason}"
        if event.cause is FailureCause.TASK and self.state.tasks[name].previous_spec is not None:
            self._fire(name, _T.UPDATE_FAILED, _Fault(reason))  # an update's command: back to the one that ran
        elif event.cause is FailureCause.TASK:
            # the command itself cannot run: retrying elsewhere would only spread the failure over
            # healthy nodes, so the task fails at once and every node stays in service
            self._fire(name, _T.TASK_ERROR, _Fault(reason, fatal=True))
        else:
            node = event.node if event.node is not None else _sole_node(self.state.tasks[name], o)
            self._fire(name, _T.ACTION_FAILED, _Fault(reason, node=node))

    def _on_progress(self, event: ProgressMade) -> None:
        entry = self.state.tasks.get(event.task)
        if entry is None or entry.phase not in ACTIVE_PHASES:
            return
        if event.generation is not None and event.generation < entry.generation:
            return  # a replaced configuration's step says nothing of this one's (causes.progress drops it too)
        if entry.last_step is None or event.step > entry.last_step:
            entry = self._task(event.task)
            entry.last_step = event.step
        if entry.restarts and (entry.no_progress_since is None or event.step > entry.no_progress_since):
            entry = self._task(event.task)
            entry.restarts, entry.no_progress_since, entry.fault_followed = 0, None, False
            self._confirm_suspicion(event.task)
        if event.generation is None or event.generation != entry.generation:
            return
        if entry.previous_spec is not None or entry.update is UpdateOutcome.PENDING:
            # the updated spec trained: its failures are ordinary ones now, and the update is confirmed
            entry = self._task(event.task)
            entry.previous_spec = None
            if entry.update is UpdateOutcome.PENDING:
                entry.update = UpdateOutcome.CONFIRMED
        # a reattempt, restart or in-place resize keeps the generation: only a step past it proves it
        # worked, or, for a restart, an iteration completed by a process it launched (which may redo
        # steps from the job's checkpoint: waiting for it to pass the fault would outlast the deadline)
        relaunched = (entry.phase is TaskPhase.RESTARTING and event.restart_epoch is not None
                      and event.restart_epoch >= entry.restart_epoch)
        resizing = entry.outstanding is not None and entry.outstanding.kind is ActionKind.RESIZE
        if _joining(entry):
            if relaunched and entry.relaunching:  # the restart worked: only the grow's joiners are left
                entry = self._task(event.task)
                entry.relaunching = {}
            if not self._joined(entry, event.task, event.joined):
                return  # the survivors step on without joiners until they are admitted: no proof of a grow
            if entry.relaunching:
                return  # the joiners joined, but no process the restart launched has shown it worked
            by = " once every joiner completed an iteration"
        else:
            by = ""
        if relaunched:
            by += f" by a process of restart epoch {event.restart_epoch}"
        same_config = resizing or entry.phase in (TaskPhase.REATTEMPTING, TaskPhase.RESTARTING)
        if same_config and not relaunched and entry.recovery_step is not None and event.step <= entry.recovery_step:
            return
        self._fire(event.task, _T.PROGRESS, _Fault(f"step {event.step} completed{by}"))

    def _joined(self, entry: TaskEntry, name: str, joined: tuple[int, ...]) -> bool:
        """Takes ``joined`` off the task's pending joiners; whether none is left."""
        if set(joined) & set(entry.joiners):
            entry = self._task(name)
            entry.joiners = sorted(set(entry.joiners) - set(joined))
        return not entry.joiners

    def _add_joiners(self, entry: TaskEntry, plan: InPlace) -> None:
        """The resize's joiners, plus those of an unconfirmed grow that stay members: a shrink decided
        while a grow's joiners are still joining must not be confirmed without them. That holds whatever
        the resize supersedes: the grow itself, or a restart or re-plan (a node lost, which clears the
        outstanding action first) decided meanwhile; only a confirmation or a new generation clears them."""
        pending = set(entry.joiners) & set(plan.members)
        if not pending:
            entry.joining_since = entry.membership_epoch
        entry.joiners = sorted(pending | set(plan.joiners))

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
                reason = _waiting_reason(entry.spec, usable, counts)
                if entry.placement:
                    self._fire(name, _T.UNPLACED, _Fault(f"preempted; {reason}"))
                elif entry.reason != reason:
                    self._task(name).reason = reason
        for name in active:
            entry = self.state.tasks[name]
            new = placement[name]
            if not new:
                continue
            if new != {n: len(r) for n, r in entry.placement.items()} or name in self.forced:
                why = entry.reason if name in self.forced else "new plan"
                in_place = None if name in self.relaunched else self._in_place(entry, new)
                if in_place is not None:
                    self._fire(name, _T.RESIZED_IN_PLACE, _Fault(why, placement=new, in_place=in_place))
                else:
                    self._fire(name, _T.RESIZED, _Fault(why, placement=new))

    def _in_place(self, entry: TaskEntry, new: Mapping[str, int]) -> InPlace | None:
        """The in-place change to ``new``, where the task's phase, recovery mode and outstanding action
        allow one (an Assign not yet confirmed may have ranks that never ran; a restart relaunches
        ranks of the membership it knows)."""
        if not self._may_resize(entry, _T.RESIZED_IN_PLACE):
            return None
        plan = plan_in_place(entry.placement, new, world_size=entry.world_size, unit=entry.spec.unit,
                             tp=entry.spec.tp_size, gone=self._gone(), store_node=entry.store_node)
        if plan is None:
            return None
        # A grow's joiners that have not joined hold no state: they cannot be the replica that
        # survives (a node lost during a grow could leave only them)
        held = set(plan.members) - set(plan.joiners) - set(entry.joiners)
        unit = entry.spec.unit
        if not any(all(x in held for x in range(r // unit * unit, (r // unit + 1) * unit)) for r in held):
            return None
        return plan

    def _may_resize(self, entry: TaskEntry, trigger: Trigger) -> bool:
        """Whether the task's phase, recovery mode and outstanding action allow a change in place now."""
        if not self.settings.in_place_resize:
            return False
        if (entry.phase, trigger) not in TRANSITIONS or entry.spec.restarts_whole:
            return False
        if not entry.confirmed:
            return False  # a rank of the generation may never have started: it could not join
        o = entry.outstanding
        if o is not None and o.kind not in (ActionKind.RESIZE, ActionKind.REATTEMPT):
            return False
        # A restart under way (its outstanding action cleared by this re-plan) relaunches ranks. One
        # for a node now gone relaunches nothing: a peer's hang report named the rank of a node cut
        # off a moment before its loss was found (resize soak, seed 11), and the loss relaunched the
        # task as a new generation. Nor does one of a grow's joiners that died at its start: it never
        # held state, and stays a pending joiner of the new membership (its agent launches a joiner
        # that is not running at the resize's epoch); refused, a node lost ~1 s after such a crash
        # killed every survivor and restarted the task from its checkpoint.
        gone = self._gone()
        return all(n in gone or set(ranks) <= set(entry.joiners) for n, ranks in entry.relaunching.items())

    def _gone(self) -> set[str]:
        return {n for n, e in self.state.nodes.items() if e.status in (NodeState.LOST, NodeState.ISOLATED)}

    def _plan(
        self, specs: list[TaskSpec], usable: dict[str, int]
    ) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
        # the planner models one node size: the largest (it plans only TP sizes dividing it, and the largest
        # node divides by every power-of-two TP that fits any node); how many groups fit is _fit_to's cap
        gpus_per_node = max(usable.values(), default=0)
        current = {s.name: sum(len(r) for r in self.state.tasks[s.name].placement.values()) for s in specs}
        holdings = {
            s.name: {n: len(r) for n, r in self.state.tasks[s.name].placement.items() if n in usable}
            for s in specs
        }
        tp = {s.name: s.tp_size for s in specs}
        # Each task is offered at most what whole TP groups of it fit on the usable nodes, and one whose
        # minimum does not fit is left out (it waits, _waiting_reason says why): else its share fails to
        # place and the budget loop below takes GPUs from every task until that share is small enough
        # (a TP=8 task on 4-GPU nodes left the others a fraction of the cluster).
        fitting = [c for c in (_fit_to(s, usable) for s in specs) if c is not None]
        # counts that still cannot be cut into whole TP groups (tasks competing for the nodes that hold
        # their groups): offer the allocator less. Every count is whole TP groups, so what a plan uses
        # on a node is a multiple of the TP sizes' gcd: a node's GPUs beyond it can never be used, and a
        # budget between two multiples plans as the lower one. Tried one GPU at a time from the total,
        # a few 7-GPU nodes under TP=8 tasks cost ~430 planner runs a decision at 512 nodes (28 s).
        step = math.gcd(*(s.tp_size for s in fitting)) if fitting else 1
        usable_by_groups = sum(g // step * step for g in usable.values())
        for budget in range(usable_by_groups, -1, -step):
            planned = self.allocator.allocate(fitting, budget, gpus_per_node, current, set(self.faulted))
            _check_counts(planned, fitting, budget)
            counts = {s.name: planned.get(s.name, 0) for s in specs}
            try:
                placement = place(counts, usable, holdings, tp)
            except PermanentError:
                continue
            # a node's GPUs no TP group can use were never on offer; one alert per situation, not per re-plan
            idle = usable_by_groups - budget
            situation = f"{','.join(sorted(counts))}: {idle}" if idle else ""
            if situation and situation != self.state.idle_alerted:
                self._alert(f"{idle} GPUs left idle: the plan could not be cut into whole TP groups")
            self.state.idle_alerted = situation
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


def _tp_fit(spec: TaskSpec, usable: Mapping[str, int]) -> int:
    """The most GPUs ``spec`` can run on over ``usable`` (node -> GPUs): whole TP groups, each inside
    one node, making up whole replicas of TP x PP."""
    groups = sum(g // spec.tp_size for g in usable.values())
    return groups * spec.tp_size // spec.unit * spec.unit


def _fit_to(spec: TaskSpec, usable: Mapping[str, int]) -> TaskSpec | None:
    """``spec`` with ``max_gpus`` capped at :func:`_tp_fit`; None if even its minimum does not fit."""
    fit = _tp_fit(spec, usable)
    if fit < spec.min_gpus:
        return None
    if fit == sum(usable.values()) // spec.unit * spec.unit or (spec.max_gpus is not None and spec.max_gpus <= fit):
        # the cap binds nothing (TP divides every node, say): the spec unchanged, as the allocator's
        # lookup table keys it, so a node lost or joined is still answered from the table
        return spec
    return dataclasses.replace(spec, max_gpus=fit)


def _waiting_reason(spec: TaskSpec, nodes: Mapping[str, int], counts: Mapping[str, int]) -> str:
    """Why a task got no GPUs, in words that do not contradict themselves ("needs 6, 6 usable")."""
    min_gpus, usable = spec.min_gpus, sum(nodes.values())
    if usable < min_gpus:
        return f"waiting for GPUs: needs at least {min_gpus}, only {usable} usable in the cluster"
    fit = _tp_fit(spec, nodes)
    if fit < min_gpus:
        return (
            f"waiting for GPUs: needs at least {min_gpus} in TP groups of {spec.tp_size} inside one node; "
            f"the usable nodes hold {fit}"
        )
    holders = ", ".join(f"{t} {n}" for t, n in sorted(counts.items()) if n)
    if holders:
        return f"waiting for GPUs: needs at least {min_gpus}; the plan gives the {usable} usable to {holders}"
    return f"waiting for GPUs: no placement of {min_gpus} fits the usable nodes (tp_size, batch split)"


def _names(entry: TaskEntry, node: str) -> bool:
    """Whether a task entry refers to ``node`` (placed there, even with no ranks left, relaunching or
    waiting there, its store there): such a node cannot be forgotten."""
    o = entry.outstanding
    return (node in entry.placement or node in entry.relaunching or entry.store_node == node
            or (o is not None and (o.node == node or node in o.waiting)))


def _down_node(event: Event) -> str | None:
    """The node an event takes out of service: a sev1's, a lost one's."""
    if isinstance(event, NodeLost):
        return event.node
    if isinstance(event, IncidentRaised) and event.incident.severity is Severity.SEV1:
        return event.incident.node
    return None


#: the sev2 kinds that are faults of a node's GPUs, which make a node flapping when they keep recurring
DEVICE_FAULTS = frozenset({ErrorKind.CUDA_ERROR, ErrorKind.ILLEGAL_MEMORY_ACCESS})


def _fault_ranks(entry: TaskEntry, inc: Incident) -> tuple[int, ...]:
    """The ranks of ``entry``'s task an incident on one of its nodes is the fault of: its rank, or
    every rank of the task there when it names none of them (a GPU's event, a node's)."""
    on_node = entry.ranks_on(inc.node)
    return (inc.rank,) if inc.rank in on_node else tuple(on_node)


def _concerns(name: str, entry: TaskEntry, event: IncidentRaised) -> bool:
    """Whether an incident on a node task ``name`` runs on is the task's to act on: it names no other
    task and is no leftover of a configuration the task has replaced."""
    inc = event.incident
    if inc.task is not None and inc.task != name:
        return False
    return event.generation is None or event.generation >= entry.generation


def _echo_of_resize(entry: TaskEntry, inc: Incident, now: float, window_s: float) -> bool:
    """Whether a sev3 incident is a survivor's view of the in-place resize of its task: the broken
    collective of the iteration in flight when peers were lost or left (its step at most one past the
    resize's), or anything within ``window_s`` of it (a call to a store that moved, see
    ``DecisionSettings.resize_echo_s``). In the transition benchmark these reports arrived after the
    resize was confirmed and raised a reattempt of a task that had already recovered."""
    if entry.resized_at is not None and now - entry.resized_at <= window_s:
        return True
    if entry.resized_step is None or inc.step is None:
        return False
    return inc.step <= entry.resized_step + 1


def _joining(entry: TaskEntry) -> bool:
    """Whether the recovery under way waits for a grow's joiners: the grow's own resize, or a restart
    that superseded it (a joiner that died at its start is relaunched; the others still have to join)."""
    o = entry.outstanding
    return bool(entry.joiners) and o is not None and o.kind in (ActionKind.RESIZE, ActionKind.RESTART)


def _sole_node(entry: TaskEntry, o: Outstanding) -> str | None:
    """The node a failure that names none blames: the one the action is for when it is for one node
    (a reattempt's fault, a restart of ranks there). A whole-task restart, a widened restart, an
    Assign or a resize is for several: none is blamed (the restart budget ends a task that cannot run),
    where the action's node isolated another node than the one that failed."""
    if o.kind is ActionKind.REATTEMPT:
        return o.node
    if o.kind is ActionKind.RESTART and set(entry.relaunching) <= {o.node}:
        return o.node
    return None


def _to_blame(entry: TaskEntry, o: Outstanding) -> str | None:
    """The node an action that missed its deadline isolates. For a grow, the node of its joiners still
    missing; likewise for a restart that superseded a grow once a process it relaunched completed an
    iteration (the restart worked, ``_on_progress`` emptied ``relaunching``: the joiners are missing)."""
    if o.kind is ActionKind.RESIZE or (_joining(entry) and not entry.relaunching):
        return _joiners_node(entry)
    return o.node


def _joiners_node(entry: TaskEntry) -> str | None:
    """The node of the pending joiners when they share one and the survivors stepped on past the
    resize; else none: if nothing moved, the task stalled (a survivor hung, say), not the joiners."""
    if entry.last_step is None or entry.resized_step is None or entry.last_step <= entry.resized_step:
        return None
    hosts = _joiner_hosts(entry)
    return next(iter(hosts)) if len(hosts) == 1 else None


def _joiner_hosts(entry: TaskEntry) -> set[str]:
    return {n for n, ranks in entry.placement.items() if set(ranks) & set(entry.joiners)}


def _launching(entry: TaskEntry, inc: Incident, generation: int | None) -> bool:
    """Whether a process of the task's current generation reports while its Assign is not confirmed,
    or died while an in-place resize is (a resize stops no process unasked: a joiner that crashed at its
    start, or a survivor, must be relaunched; merged, the survivors' steps confirmed the resize without it)."""
    o = entry.outstanding
    if generation != entry.generation or o is None:
        return False
    return o.kind is ActionKind.ASSIGN or (o.kind is ActionKind.RESIZE and inc.kind is ErrorKind.EXITED_ABNORMALLY)


#: the faults an updated command can be the cause of: its process exited or raised. A network fault
#: (sev3, reattempted in place), a GPU's (counted for flapping), a hang (a slow restore), a fence or the
#: store's loss rolled back a good update, and a script waiting on ``update --wait`` read it as a bad one
SPEC_FAULTS = frozenset({ErrorKind.EXITED_ABNORMALLY, ErrorKind.OTHER_SOFTWARE_ERROR})


def _update_failed(entry: TaskEntry, inc: Incident, generation: int | None) -> bool:
    """Whether a process of an updated spec that has not completed a step yet failed of its own doing
    (:data:`SPEC_FAULTS`; the task still keeps the spec it ran with: ``previous_spec``). Only a report of
    the current generation, the one running the new spec, counts; a node's fault (sev1) is handled before."""
    return (entry.previous_spec is not None and generation is not None and generation == entry.generation
            and inc.kind in SPEC_FAULTS)


def _restart_died(entry: TaskEntry, inc: Incident, event: IncidentRaised) -> bool:
    """Whether a process that the restart under way launched has died: one launched at its first epoch
    or later (a widened restart relaunches each node at its own epoch; merged, the first node's relaunch
    dying was never relaunched and the deadline isolated the node widened to last)."""
    o = entry.outstanding
    return (o is not None and o.kind is ActionKind.RESTART and inc.kind is ErrorKind.EXITED_ABNORMALLY
            and event.generation == entry.generation
            and event.restart_epoch is not None and event.restart_epoch >= entry.relaunch_epoch)


def _relaunched(entry: TaskEntry, inc: Incident) -> bool:
    """Whether the restart under way relaunches the rank ``inc`` names (outside a restart: vacuously)."""
    if entry.phase is not TaskPhase.RESTARTING:
        return True
    return inc.rank is None or inc.rank in entry.relaunching.get(inc.node, [])
