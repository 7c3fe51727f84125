"""What the cluster measured, as the planner's inputs (paper §5: Eq. 3's D_transition, D_running and
T(t, x)); pure functions the daemon and the simulator both call.

* D_transition per task: the median of its own last :data:`TRANSITION_WINDOW` reconfigurations, from
  the incidents' Eq. 1 terms (:mod:`coordinator.costs`: action issued -> the tasks run again). An
  incident that reconfigured several tasks gives each of them its time (until the last one ran).
* The failure rate: :meth:`plans.waf.ReliabilityModel.observe` with the incidents that stopped a task
  (sev1-3; a degradation is not a failure) over the GPU-hours the cluster was exposed (:class:`Exposure`).
* T(t, x): the achieved FLOP/s of a task at its GPU count, from the steps its ranks report (the model's
  useful FLOPs per step, :attr:`plans.models.ModelSpec.flops_per_iteration`, times measured steps per
  second); :func:`calibration` folds them into a :class:`plans.throughput.Calibration`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from coordinator import decision as d
from coordinator.allocation import WafAllocator, model_spec
from plans.api import Calibration, ReliabilityModel
from unicron.kernel.types import Incident

#: reconfigurations per task whose median is its D_transition
TRANSITION_WINDOW = 5
#: a measured FLOP/s reaches the planner only when it moved by more than this fraction (each change
#: makes the lookup table stale)
CALIBRATION_TOLERANCE = 0.1


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


def failures(incidents: Iterable[Incident]) -> int:
    """Incidents that stopped a task (a severity): the events the failure rate counts."""
    return sum(1 for inc in incidents if inc.severity is not None)


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


@dataclass(frozen=True)
class StepRate:
    """Progress of one task at one configuration (generation and GPU count): first and last report."""

    generation: int
    gpus: int
    first: tuple[float, int]
    last: tuple[float, int]

    def advance(self, generation: int, gpus: int, ts: float, step: int) -> StepRate:
        """With a new progress report; a new configuration starts a new measurement."""
        if generation != self.generation or gpus != self.gpus or step < self.last[1] or ts < self.last[0]:
            return StepRate(generation, gpus, (ts, step), (ts, step))
        return StepRate(generation, gpus, self.first, (ts, step) if step > self.last[1] else self.last)

    def steps_per_s(self, min_steps: int = 3) -> float | None:
        """Steps per second between the first and last report; None before ``min_steps`` steps."""
        steps, seconds = self.last[1] - self.first[1], self.last[0] - self.first[0]
        return steps / seconds if steps >= min_steps and seconds > 0 else None


#: FLOP/s per GPU no accelerator comes near (an H200 does ~2e15 dense at FP8): a rate beyond it was
#: computed from a step no task took (a rank's bug, a mangled record), not measured
MAX_FLOPS_PER_GPU = 1e17


def achieved_flops(flops_per_step: float, rate: StepRate) -> float | None:
    """Achieved FLOP/s at ``rate``'s GPU count (None until enough steps were seen, or when the steps
    reported make a rate no hardware reaches: one absurd step made it ``inf``, which the planner's
    calibration refused after every later decision, for good)."""
    per_s = rate.steps_per_s()
    if per_s is None:
        return None
    flops = flops_per_step * per_s
    return flops if math.isfinite(flops) and flops <= MAX_FLOPS_PER_GPU * max(rate.gpus, 1) else None


@dataclass(frozen=True)
class Measured:
    """A task's achieved FLOP/s per GPU count, as fed to the planner."""

    flops: Mapping[int, float] = field(default_factory=dict)

    def with_point(self, gpus: int, flops: float, tolerance: float = CALIBRATION_TOLERANCE) -> Measured:
        """Self with ``flops`` at ``gpus`` when it differs from the point held by more than ``tolerance``
        (returns self unchanged otherwise, so the planner's inputs and its lookup table stay put)."""
        old = self.flops.get(gpus)
        if old is not None and abs(flops - old) <= tolerance * old:
            return self
        return Measured({**self.flops, gpus: flops})

    def calibration(self) -> Calibration | None:
        return Calibration(dict(self.flops)) if self.flops else None




class Grounding:
    """The measured inputs, fed with each *adopted* decision (so a decision whose write failed teaches
    nothing), and handed to a :class:`~coordinator.allocation.WafAllocator` by :meth:`apply`."""

    def __init__(self, prior: ReliabilityModel, window: int = TRANSITION_WINDOW, throughput: bool = True) -> None:
        """``throughput=False``: do not measure FLOP/s from progress (a simulator whose progress events
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
        """Transitions recorded before this process led (a new leader reads the incident records), of
        the tasks in ``state``: only those decided since the task's run was submitted, as :meth:`decided`
        forgets an earlier run's on resubmission (the records keep them, by task name)."""
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

    def reliability(self) -> ReliabilityModel:
        """The failure model as of the last failure observed."""
        return self._reliability

    def decided(
        self, state: d.CoreState, event: d.Event, raised: Incident | None, costed: Iterable[Incident]
    ) -> None:
        """One adopted decision: the state after it, its event, the incident it was for, the incidents
        whose recovery cost changed (``coordinator.costs``)."""
        usable = sum(e.gpus for e in state.nodes.values() if e.status is d.NodeState.UP)
        self.exposure = self.exposure.advance(event.ts, usable)
        if raised is not None and raised.severity is not None:
            self.failed += 1
            self._reliability = reliability(self.prior, self.failed, self.exposure)
        add_transitions(self._transitions, costed, self.window)
        if self.throughput and isinstance(event, d.ProgressMade):
            self._progress(state, event)
        for task in set(self.rates) | set(self.measured) | set(self._transitions):
            entry = state.tasks.get(task)
            # a new run under an old name (a refused duplicate of a task that ran keeps its last step)
            # has a model and a layout of its own: nothing measured of the old run applies to it
            renewed = isinstance(event, d.TaskSubmitted) and event.spec.name == task
            if entry is None or (renewed and entry.last_step is None):
                self.rates.pop(task, None)
                self.measured.pop(task, None)
                self._transitions.pop(task, None)
            elif entry.phase is not d.TaskPhase.RUNNING or entry.outstanding is not None:
                # a step rate spans uninterrupted training only: a pause to recover (a reattempt keeps
                # the generation and the GPUs) is the failure's cost, D_transition, not a slower T(t, x)
                self.rates.pop(task, None)

    def _progress(self, state: d.CoreState, event: d.ProgressMade) -> None:
        entry = state.tasks.get(event.task)
        if entry is None or entry.spec.model is None or event.generation != entry.generation:
            return
        gpus = len(entry.all_ranks())
        old = self.rates.get(event.task)
        rate = (StepRate(entry.generation, gpus, (event.ts, event.step), (event.ts, event.step)) if old is None
                else old.advance(entry.generation, gpus, event.ts, event.step))
        self.rates[event.task] = rate
        flops = achieved_flops(model_spec(entry.spec).flops_per_iteration, rate)
        if flops is None and rate.steps_per_s() is not None:
            self.rates.pop(event.task, None)  # an absurd step: measure afresh from the next report
            return
        if flops is not None and gpus > 0:
            self.measured[event.task] = self.measured.get(event.task, Measured()).with_point(gpus, flops)

    def apply(self, allocator: WafAllocator) -> bool:
        """Give the allocator the current measurements; True if its inputs changed."""
        calibration = {t: c for t, m in self.measured.items() if (c := m.calibration()) is not None}
        return allocator.ground(transition_s=self.transition_s, calibration=calibration,
                                reliability=self.reliability())
