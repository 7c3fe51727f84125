"""T(t, x) as measured: a task's achieved FLOP/s at a GPU count, from the steps its ranks report.

Kept in the task's entry (:attr:`~coordinator.decision.state.TaskEntry.rate` and ``measured``), so a
new leader that loads the state plans with what its predecessor measured: kept by the leader alone,
the planner's T(t, x) fell back to the model after a failover and healthy tasks were reconfigured.
``coordinator.grounding`` hands the points to the planner.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from plans.api import Calibration

#: a measured FLOP/s reaches the planner only when it moved by more than this fraction (each change
#: makes the lookup table stale)
CALIBRATION_TOLERANCE = 0.1
#: FLOP/s per GPU no accelerator comes near (an H200 does ~2e15 dense at FP8): a rate beyond it was
#: computed from a step no task took (a rank's bug, a mangled record), not measured
MAX_FLOPS_PER_GPU = 1e17


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

    def same_window(self, other: StepRate | None) -> bool:
        """Whether ``other`` measures from the same first report (only its last report moved)."""
        return other is not None and (other.generation, other.gpus, other.first) == (
            self.generation, self.gpus, self.first)


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
