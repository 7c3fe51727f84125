"""Unicron in the simulator: the coordinator's own decision core, allocator and placement.

Every decision is ``DecisionCore.handle`` with the live coordinator's ``WafAllocator`` (which calls
``place``); the simulator only plays the daemon's part: it turns trace failures into the core's events
(every failure, a lost node included, -> a ``Report`` classified by ``coordinator.causes.classify``
and raised as ``IncidentRaised``, as the daemon does; a repair -> ``NodeJoined`` for a
lost node, ``NodeUndrained`` for an isolated one, once the failure has been detected), carries out the actions by charging their cost
(:class:`sim.costs.CostSettings`), and confirms each tracked action with ``ActionSucceeded`` and a
``ProgressMade`` at the current generation when its transition ends.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import time

from coordinator import decision as d
from coordinator.allocation import WafAllocator
from coordinator.causes import classify
from coordinator.costs import CostTracker
from coordinator.grounding import Grounding
from coordinator.lookup import PlanLookup
from sim.costs import CostSettings, method_of
from sim.engine import DETECT, IDLE, RUN, TRANSITION, Simulation
from sim.trace import Failure, Trace
from sim.workload import Workload
from unicron.kernel.errors import PermanentError
from unicron.kernel.types import ErrorKind, Incident, Report, Severity


class UnicronSim(Simulation):
    system = "unicron"

    def __init__(
        self, workload: Workload, trace: Trace, costs: CostSettings, seed: int = 0, progress: bool = False,
        lookup: bool = True,
    ) -> None:
        """``lookup=False``: solve every plan (to measure what the lookup table saves)."""
        super().__init__(workload, trace, costs, seed, progress)
        # the live coordinator's planning path: a lookup table of the one-step changes from each plan,
        # built here between events instead of in a background thread (coordinator.lookup)
        self.lookup = PlanLookup(background=False, lazy=True)
        self.allocator = WafAllocator(self.workload.gpu, lookup=self.lookup if lookup else None)
        self.core = d.DecisionCore(d.DecisionSettings(), self.allocator)
        self.state = self.core.initial_state()
        # Eq. 1 costs per incident and the planner inputs measured from them, as the daemon keeps them
        self.tracker = CostTracker()
        # T(t, x) is not calibrated here: the simulator's progress events confirm recoveries, they are
        # not training steps, and its throughput is the planner's own model anyway
        self.grounding = Grounding(self.allocator.planner.reliability, throughput=False)
        self.lookup_counts = (0, 0)  # (hits, misses) at the end of setup
        self.pending: dict[str, str] = {}  # task -> the action id its transition will confirm
        self.steps: dict[str, int] = {t: 0 for t in self.tasks}
        self.faulted: set[str] = set()  # tasks that lost work in the failure being handled
        self.isolated: set[str] = set()
        # sev1 detections still to come per node, and the nodes repaired before theirs came: the core
        # isolates such a node only at detection, so the repair is applied then, not lost
        self.detecting: dict[str, int] = {}
        self.repaired_early: set[str] = set()
        self.actions_log: list[d.Action] = []
        self._incident = 0

    # -- the daemon's part ----------------------------------------------------------------------------

    def feed(self, event: d.Event, raised: Incident | None = None) -> list[d.Action]:
        """One event through the core, then what the daemon does after adopting a decision: the Eq. 1
        costs, the measured planner inputs, the lookup table for the new state. ``raised``: the
        incident behind the event (the daemon records one for a lost node too)."""
        if raised is None and isinstance(event, d.IncidentRaised):
            raised = event.incident
        before, solved = self.state, self.lookup.solve_s
        started = time.perf_counter()
        self.state, actions = self.core.handle(before, event)
        # a lazy table entry solved inside this call was solved in the background, before the event,
        # by the live coordinator: it is not part of the decision's time
        self.result.decide_ms.append((time.perf_counter() - started - (self.lookup.solve_s - solved)) * 1000)
        self.tracker, costed = self.tracker.step(before, self.state, event.ts, raised)
        self.grounding.decided(self.state, event, costed)
        self.grounding.apply(self.allocator)
        self.lookup.build_pending()
        self.actions_log.extend(actions)
        for action in actions:
            self.carry_out(action)
        return actions

    def placement(self) -> dict[str, dict[str, int]]:
        return {
            name: {n: len(r) for n, r in e.placement.items()}
            for name, e in self.state.tasks.items() if e.phase in d.ACTIVE_PHASES
        }

    def carry_out(self, action: d.Action) -> None:
        self.count(type(action).__name__)
        match action:
            case d.Assign():
                run = self.tasks[action.task]
                run.gpus = action.world_size
                if self.now == 0.0:  # the initial launch is free for every system
                    run.status = RUN
                    self.pending[action.task] = action.action_id
                    self.at(0.0, functools.partial(self._confirm, action.task, action.action_id))
                    return
                faulted = action.task in self.faulted
                spec = self.workload.spec(action.task)
                rank_bytes = self.workload.state_bytes(action.task) / spec.unit
                seconds = self.costs.unicron_reconfigure_s(
                    rank_bytes, self.workload.iteration_s(action.task, run.gpus), faulted)
                self._transition(action.task, action.action_id, seconds)
            case d.ResizeInPlace():
                # the same mechanisms as a reattempt (survivors regroup, no process restarts) and, with
                # joiners, a restart (a relaunched rank rejoins from a replica): their measured costs
                run = self.tasks[action.task]
                run.gpus = sum(len(r) for r in action.placement.values())
                seconds = self.costs.unicron_in_place_s(bool(action.joiners),
                                                        self.workload.iteration_s(action.task, run.gpus))
                self._transition(action.task, action.action_id, seconds)
            case d.RestartRanks() | d.Reattempt():
                run = self.tasks[action.task]
                seconds = self.costs.unicron_in_place_s(
                    isinstance(action, d.RestartRanks), self.workload.iteration_s(action.task, run.gpus))
                self._transition(action.task, action.action_id, seconds)
            case d.StopTask():
                run = self.tasks[action.task]
                run.gpus, run.status = 0, IDLE
                run.token += 1
                self.pending.pop(action.task, None)
            case d.IsolateNode():
                self.isolated.add(action.node)
            case d.MarkTaskFailed() | d.Alert():
                pass

    def _transition(self, task: str, action_id: str, seconds: float) -> None:
        self.pending[task] = action_id
        self.start_transition(task, seconds, then=lambda: self._confirm(task, action_id))

    def _confirm(self, task: str, action_id: str) -> None:
        if self.pending.get(task) != action_id:
            return  # superseded by a newer action
        del self.pending[task]
        self.feed(d.ActionSucceeded(ts=self.now, action_id=action_id))
        entry = self.state.tasks.get(task)
        if entry is not None and entry.phase in d.ACTIVE_PHASES:
            self.steps[task] += 1
            self.feed(d.ProgressMade(ts=self.now, task=task, step=self.steps[task], generation=entry.generation))

    # -- the simulation's hooks -----------------------------------------------------------------------

    def setup(self) -> None:
        for node in self.nodes():
            self.feed(d.NodeJoined(ts=0.0, node=node, gpus=self.workload.gpus_per_node))
        for spec in self.workload.tasks:
            self.feed(d.TaskSubmitted(ts=0.0, spec=spec))
        # drain the time-0 confirmations so the run starts on a settled plan
        while self._heap and self._heap[0][0] == 0.0:
            _, _, callback = heapq.heappop(self._heap)
            callback()
        self.lookup_counts = (self.lookup.hits, self.lookup.misses)

    def lookup_stats(self) -> dict[str, object]:
        """Plans answered by the lookup table after the setup, and those solved."""
        hits, misses = self.lookup.hits - self.lookup_counts[0], self.lookup.misses - self.lookup_counts[1]
        return {"lookup_hits": hits, "lookup_misses": misses,
                "lookup_hit_rate": round(hits / (hits + misses), 4) if hits + misses else None}

    def _incident_for(self, f: Failure, task: str | None) -> d.IncidentRaised:
        entry = self.state.tasks.get(task) if task else None
        rank = entry.ranks_on(f.node)[0] if entry is not None and entry.ranks_on(f.node) else None
        report = Report(method=method_of(f.kind), kind=ErrorKind(f.kind), node=f.node, task=task, gpu=f.gpu,
                        rank=rank, source_ts=f.time_s, agent_ts=self.now, message="simulated")
        self._incident += 1
        incident = classify(report, self.now, f"sim-{self._incident}")
        # the trace's severity is authoritative (a file may pair a kind with another severity)
        incident = dataclasses.replace(incident, severity=Severity(f.severity))
        generation = entry.generation if entry is not None else None
        return d.IncidentRaised(ts=self.now, incident=incident, generation=generation)

    def on_failure(self, f: Failure) -> None:
        placement = self.placement()
        if f.severity == 1:
            hit = [t for t, nodes in placement.items() if nodes.get(f.node)]
        else:
            task = self.task_at(placement, f.node, f.gpu)
            hit = [task] if task is not None and self.tasks[task].status == RUN else []
            if not hit:
                self.count("failures_on_idle_gpus")
                return
        for name in hit:
            run = self.tasks[name]
            run.status = DETECT
            run.token += 1
        iteration = min((self.workload.iteration_s(t, self.tasks[t].gpus) for t in hit), default=1.0)
        delay = self.costs.unicron_detect_s(f.kind, iteration)
        if f.severity == 1:
            self.detecting[f.node] = self.detecting.get(f.node, 0) + 1
        self.at(self.now + delay, lambda: self._detected(f, hit))

    def _detected(self, f: Failure, hit: list[str]) -> None:
        self.faulted = set(hit)
        try:
            # a lost node too: the daemon records a node-health report for it and raises its incident
            self.feed(self._incident_for(f, hit[0] if hit and f.severity > 1 else None))
        finally:
            self.faulted = set()
        for name in hit:  # a task the core did not act on (e.g. a stale incident) resumes as it was
            run = self.tasks[name]
            if run.status == DETECT:
                run.status = RUN if run.gpus > 0 else IDLE
        if f.severity == 1:
            self.detecting[f.node] -= 1
            if not self.detecting[f.node]:
                del self.detecting[f.node]
                early = f.node in self.repaired_early
                self.repaired_early.discard(f.node)
                # a node that failed again since its early repair waits for that failure's own repair
                if early and f.node not in self.down:
                    self._rejoin(f.node)

    def on_repair(self, f: Failure) -> None:
        if f.node in self.detecting:
            self.repaired_early.add(f.node)  # applied when the detection has isolated the node
            return
        self._rejoin(f.node)

    def _rejoin(self, node: str) -> None:
        entry = self.state.nodes.get(node)
        if entry is not None and entry.status is d.NodeState.ISOLATED:
            self.feed(d.NodeUndrained(ts=self.now, node=node))
        else:
            self.feed(d.NodeJoined(ts=self.now, node=node, gpus=self.workload.gpus_per_node))
        self.isolated.discard(node)


def initial_placement(sim: UnicronSim) -> dict[str, dict[str, int]]:
    """The plan Unicron starts from (the baselines start from the same one, paper §7.5)."""
    if sim.state.tasks:
        return sim.placement()
    sim.setup()
    if any(r.status == TRANSITION for r in sim.tasks.values()):
        raise PermanentError("simulator: the initial plan did not settle at time 0")
    return sim.placement()
