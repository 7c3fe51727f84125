"""What the cluster measured, as the planner's inputs (paper §5: Eq. 3's D_transition, D_running and
T(t, x)); pure functions the daemon and the simulator both call.

* D_transition per task: the median of its own last :data:`TRANSITION_WINDOW` reconfigurations, from
  the incidents' Eq. 1 terms (:mod:`coordinator.costs`: action issued -> the tasks run again). An
  incident that reconfigured several tasks gives each of them its time (until the last one ran).
* The failure rate: :meth:`plans.waf.ReliabilityModel.observe` with the failures the decision core
  counted (a node taken out of service, or an incident that started a recovery; not a degradation, nor
  a consequence merged into a recovery under way) over the GPU-hours the cluster was exposed.
* T(t, x): the achieved FLOP/s of a task at its GPU count, from the steps its ranks report (the model's
  useful FLOPs per step, :attr:`plans.models.ModelSpec.flops_per_iteration`, times measured steps per
  second), measured by the decision core into the task's entry (:mod:`coordinator.decision.throughput`);
  :meth:`~coordinator.decision.throughput.Measured.calibration` folds them into a
  :class:`plans.throughput.Calibration`.

The failure count, exposure and FLOP/s are the decision state's, so a new leader plans with them.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from coordinator import decision as d
from coordinator.allocation import WafAllocator
from coordinator.decision.throughput import Measured, StepRate
from plans.api import ReliabilityModel
from unicron.kernel.types import Incident

#: reconfigurations per task whose median is its D_transition
TRANSITION_WINDOW = 5


#: task -> incident id -> (action time, transition seconds) of its kept reconfigurations
Transitions = dict[str, dict[str, tuple[float, float]]]


def add_transitions(kept: Transitions, incidents: Iterable[Incident], window: int = TRANSITION_WINDOW) -> None:
    """Fold the confirmed reconfigurations among ``incidents`` into ``kept``, each task's latest ``window``.

    Keyed by incident: the cost tracker reports an incident again when a later term of it is known
    (its sub-healthy time), and that must not count its transition twice."""
    for inc in incidents:
        if inc.action != "reconfigure" or inc.transition_s is None or inc.action_ts is None:
            continue
        for task in inc.tasks:
            per_incident = kept.setdefault(task, {})
            per_incident[inc.incident_id] = (inc.action_ts, inc.transition_s)
            if len(per_incident) > window:
                del per_incident[min(per_incident, key=per_incident.__getitem__)]


def medians(kept: Transitions) -> dict[str, float]:
    """task -> median transition seconds of its kept reconfigurations."""
    return {t: statistics.median(s for _, s in v.values()) for t, v in sorted(kept.items()) if v}


def transition_times(incidents: Iterable[Incident], window: int = TRANSITION_WINDOW) -> dict[str, float]:
    """task -> median transition seconds of its last ``window`` confirmed reconfigurations."""
    kept: Transitions = {}
    add_transitions(kept, incidents, window)
    return medians(kept)


@dataclass(frozen=True)
class Exposure:
    """GPU-hours the cluster ran, integrated from (time, usable GPUs) observations."""

    gpu_hours: float = 0.0
    ts: float | None = None
    gpus: int = 0

    def advance(self, ts: float, gpus: int) -> Exposure:
        """The exposure until ``ts`` (at the GPUs seen last), then ``gpus`` from ``ts`` on."""
        if self.ts is None:
            return Exposure(self.gpu_hours, ts, gpus)
        hours = max(ts - self.ts, 0.0) * self.gpus / 3600.0
        return Exposure(self.gpu_hours + hours, max(ts, self.ts), gpus)


def reliability(prior: ReliabilityModel, failed: int, exposure: Exposure) -> ReliabilityModel:
    """The failure model after ``failed`` failures in ``exposure``: the prior's posterior mean."""
    return prior.observe(failed, exposure.gpu_hours)


class Grounding:
    """The measured inputs, fed with each *adopted* decision (so a decision whose write failed teaches
    nothing), and handed to a :class:`~coordinator.allocation.WafAllocator` by :meth:`apply`.

    The failure count, the exposure and T(t, x) are the decision state's (``CoreState.failures``,
    ``gpu_hours``, ``TaskEntry.measured``): a new leader that loads the state plans as its predecessor
    did. Kept here alone, they started again at zero after a failover, D_running and T(t, x) moved
    and healthy tasks were reconfigured."""

    def __init__(self, prior: ReliabilityModel, window: int = TRANSITION_WINDOW, throughput: bool = True) -> None:
        """``throughput=False``: do not take FLOP/s from progress (a simulator whose progress events
        are recovery confirmations, not training steps)."""
        self.prior = prior
        self.window = window
        self.throughput = throughput
        self.exposure = Exposure()
        self.failed = 0
        # re-estimated at each failure, not at each decision: every new estimate re-plans the lookup table
        self._reliability = prior
        self.rates: dict[str, StepRate] = {}
        self.measured: dict[str, Measured] = {}
        self._transitions: Transitions = {}

    @property
    def transition_s(self) -> dict[str, float]:
        return medians(self._transitions)

    def achieved_flops(self, task: str) -> float | None:
        """The task's last achieved FLOP/s at the GPUs it holds now (None until measured)."""
        rate = self.rates.get(task)
        measured = self.measured.get(task)
        return None if rate is None or measured is None else measured.flops.get(rate.gpus)

    def seed(self, incidents: Iterable[Incident], state: d.CoreState) -> None:
        """What was measured before this process led: the state's failures, exposure and FLOP/s, and
        the transitions in the incident records, of the tasks in ``state``: only those decided since
        the task's run was submitted, as :meth:`decided` forgets an earlier run's on resubmission (the
        records keep them, by task name)."""
        self._transitions = {}
        add_transitions(self._transitions, incidents, self.window)
        for task in list(self._transitions):
            entry = state.tasks.get(task)
            kept = {} if entry is None else {
                i: (ts, s) for i, (ts, s) in self._transitions[task].items() if ts >= entry.submitted_at}
            if kept:
                self._transitions[task] = kept
            else:
                del self._transitions[task]
        self._observe(state)

    def reliability(self) -> ReliabilityModel:
        """The failure model as of the last failure observed."""
        return self._reliability

    def decided(self, state: d.CoreState, event: d.Event, costed: Iterable[Incident]) -> None:
        """One adopted decision: the state after it (which counts the failures), its event, the
        incidents whose recovery cost changed (``coordinator.costs``)."""
        add_transitions(self._transitions, costed, self.window)
        for task in set(self._transitions):
            entry = state.tasks.get(task)
            # a new run under an old name (a refused duplicate of a task that ran keeps its last step)
            # has a model and a layout of its own: nothing measured of the old run applies to it
            renewed = isinstance(event, d.TaskSubmitted) and event.spec.name == task
            if entry is None or (renewed and entry.last_step is None):
                self._transitions.pop(task, None)
        self._observe(state)

    def _observe(self, state: d.CoreState) -> None:
        usable = sum(e.gpus for e in state.nodes.values() if e.status is d.NodeState.UP)
        self.exposure = Exposure(state.gpu_hours, state.now, usable)
        if state.failures != self.failed:
            self.failed = state.failures
            self._reliability = reliability(self.prior, self.failed, Exposure(state.failure_gpu_hours))
        if self.throughput:
            self.rates = {t: e.rate for t, e in state.tasks.items() if e.rate is not None}
            self.measured = {t: e.measured for t, e in state.tasks.items() if e.measured.flops}

    def apply(self, allocator: WafAllocator) -> bool:
        """Give the allocator the current measurements; True if its inputs changed."""
        calibration = {t: c for t, m in self.measured.items() if (c := m.calibration()) is not None}
        return allocator.ground(transition_s=self.transition_s, calibration=calibration,
                                reliability=self.reliability())
