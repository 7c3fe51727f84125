"""WAF and the reward of a reconfiguration: paper Eq. 2 (F), Eq. 3 (G) and Eq. 4 (the indicator).

All tables here are indexed by allocation units (one GPU, or one whole node): entry k is the task
holding k units. ``choices`` then drops the allocations that can never be part of an optimum, which
is what makes the dynamic programme of ``plans.dp`` fast; docs/planner.md has the argument.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from plans.dp import Choices
from plans.throughput import FloatArray, IntArray
from unicron.kernel.errors import InvalidRecord

#: Default failure rate: one failure every 3 days on the paper's 128-GPU cluster (§2.4 O1 says the
#: mean time between failures of a 128-GPU cluster ranges from a day to a week).
DEFAULT_GPU_FAILURE_RATE_PER_HOUR = 1.0 / (128 * 72)


@dataclass(frozen=True)
class ReliabilityModel:
    """Failures as a Poisson process with one rate per GPU: D_running(n) = 1 / (n · rate)."""

    gpu_failure_rate_per_hour: float = DEFAULT_GPU_FAILURE_RATE_PER_HOUR
    """Failures per GPU-hour (any severity that stops a task)."""
    prior_gpu_hours: float = 128 * 24 * 7.0
    """Weight of the rate above when ``observe`` folds incidents in, in GPU-hours of exposure."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.gpu_failure_rate_per_hour) and self.gpu_failure_rate_per_hour > 0):
            raise InvalidRecord(
                f"reliability.gpu_failure_rate_per_hour: must be a finite number > 0, "
                f"got {self.gpu_failure_rate_per_hour!r}"
            )
        if not (math.isfinite(self.prior_gpu_hours) and self.prior_gpu_hours > 0):
            raise InvalidRecord(f"reliability.prior_gpu_hours: must be > 0, got {self.prior_gpu_hours!r}")

    def d_running_s(self, n_gpus: int) -> float:
        """Expected time until the next failure of a cluster of ``n_gpus`` GPUs, seconds."""
        return 3600.0 / (max(n_gpus, 1) * self.gpu_failure_rate_per_hour)

    def observe(self, incidents: int, gpu_hours: float) -> ReliabilityModel:
        """The posterior mean rate after ``incidents`` failures in ``gpu_hours`` of exposure (a
        Gamma prior worth ``prior_gpu_hours``); the prior weight grows by the exposure."""
        if incidents < 0 or gpu_hours < 0:
            raise InvalidRecord("reliability.observe: incidents and gpu_hours must be >= 0")
        hours = self.prior_gpu_hours + gpu_hours
        rate = (self.gpu_failure_rate_per_hour * self.prior_gpu_hours + incidents) / hours
        return ReliabilityModel(rate, hours)


def _index(n: int, units: IntArray | None) -> IntArray:
    return np.arange(n, dtype=np.int64) if units is None else units


def waf_table(
    throughput: FloatArray, weight: float, min_units: int, units: IntArray | None = None
) -> FloatArray:
    """Eq. 2: F = w · T where the allocation meets the task's minimum, else 0.

    Entry i is the allocation ``units[i]`` (default: i units) for every table in this module.
    """
    f = weight * throughput
    f[_index(len(f), units) < min_units] = 0.0
    return f


def gain_table(
    waf: FloatArray,
    current: int | None,
    faulted: bool,
    waf_now: float,
    d_running: float,
    d_transition: float,
    units: IntArray | None = None,
) -> tuple[FloatArray, IntArray]:
    """Eq. 3 and 4: G(k) = F(k)·D_running - F(x_i)·1(k ≠ x_i or faulted)·D_transition, and the indicator.

    ``current`` is the task's present allocation in units, None when it is not a whole number of
    units (then every choice is a change); ``waf_now`` is F(t_i, x_i) in GPUs.
    """
    changes = np.ones(len(waf), dtype=np.int64)
    if current is not None and not faulted:
        changes[_index(len(waf), units) == current] = 0
    # where, not a product: inf * 0 would be NaN at the no-change entry
    gains = waf * d_running - np.where(changes > 0, waf_now * d_transition, 0.0)
    return gains, changes


def choices(gains: FloatArray, changes: IntArray, units: IntArray | None = None) -> Choices:
    """The allocations worth considering: k survives unless a smaller k' has G(k') ≥ G(k) and no more
    changes. S(i-1, ·) never decreases with capacity, so a dominated k can never beat its k'.
    ``units`` (ascending, starting with 0) may already be a subset; see docs/planner.md for why
    leaving out the allocations where T = 0 is exact."""
    index = _index(len(gains), units)
    prefix = np.maximum.accumulate(gains)
    keep = np.zeros(len(gains), dtype=bool)
    keep[0] = True
    keep[1:] = gains[1:] > prefix[:-1]
    keep |= changes == 0  # the no-change choice is only dominated by another no-change choice: none
    return Choices(index[keep].astype(np.int64), gains[keep].copy(), changes[keep].copy())


def all_choices(gains: FloatArray, changes: IntArray) -> Choices:
    """Every allocation 0..capacity, unpruned: the dense O(m·n²) programme, for comparison."""
    return Choices(np.arange(len(gains), dtype=np.int64), gains.copy(), changes.copy())
