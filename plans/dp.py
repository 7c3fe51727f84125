"""The dynamic programme of paper Eq. 5, as a max-plus product over NumPy arrays, with traceback.

S(i, j) = max_k { S(i-1, j-k) + G(t_i, k) }, S(0, j) = 0: the best total reward of the first i
tasks on at most j units. Each task contributes only its ``Choices`` (the allocations that can be
optimal); a step builds the |choices| x (capacity+1) matrix of candidate values in one go and
reduces it column-wise.

Ties: values within ``rel_tol`` of the column maximum count as equal (sums of floats in different
orders differ in the last bits); among them the fewest changed tasks win (Eq. 4's indicator), then
the smallest allocation for the task at hand. ``brute_force`` applies the same rule to every
allocation vector, to check the programme against.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

_NO_CHOICE = np.iinfo(np.int64).max // 4


@dataclass(frozen=True)
class Choices:
    """One task's candidate allocations, ascending, with their reward and change indicator."""

    units: IntArray
    """Allocation sizes in units; starts with 0."""
    gains: FloatArray
    """G(t_i, k) for each of ``units``."""
    changes: IntArray
    """1(t_i, x_i → k) for each of ``units``: 1 when taking it reconfigures or restarts the task."""


@dataclass(frozen=True)
class Solution:
    """The optimum of Eq. 3."""

    value: float
    """Sum of G over the tasks."""
    changes: int
    """Number of tasks the plan reconfigures (or restarts after a fault)."""
    units: tuple[int, ...]
    """Allocation of each task, in units."""


def _tolerance(gain_arrays: Sequence[FloatArray], rel_tol: float) -> float:
    scale = sum(float(np.max(np.abs(g))) if len(g) else 0.0 for g in gain_arrays)
    return rel_tol * max(scale, 1e-300)


def solve(tasks: Sequence[Choices], capacity: int, rel_tol: float = 1e-9) -> Solution:
    """Maximise Σ G(t_i, k_i) subject to Σ k_i ≤ capacity (Eq. 3 by Eq. 5)."""
    width = capacity + 1
    tol = _tolerance([c.gains for c in tasks], rel_tol)
    best = np.zeros(width)
    changes = np.zeros(width, dtype=np.int64)
    picks = np.empty((len(tasks), width), dtype=np.int32)
    columns = np.arange(width)
    for i, task in enumerate(tasks):
        rows = int(np.searchsorted(task.units, capacity, side="right"))
        values = np.full((rows, width), -np.inf)
        counts = np.full((rows, width), _NO_CHOICE, dtype=np.int64)
        for r in range(rows):
            k = int(task.units[r])
            values[r, k:] = best[: width - k] + task.gains[r]
            counts[r, k:] = changes[: width - k] + task.changes[r]
        top = values.max(axis=0)
        counts[values < top - tol] = _NO_CHOICE
        pick = counts.argmin(axis=0)  # first row among the tied: the smallest allocation
        best = values[pick, columns]
        changes = counts[pick, columns]
        picks[i] = pick
    units = []
    j = capacity
    for i in range(len(tasks) - 1, -1, -1):
        k = int(tasks[i].units[picks[i, j]])
        units.append(k)
        j -= k
    return Solution(float(best[capacity]), int(changes[capacity]), tuple(reversed(units)))


def brute_force(
    gains: Sequence[FloatArray], changes: Sequence[IntArray], capacity: int, rel_tol: float = 1e-9
) -> Solution:
    """Eq. 3 by enumerating every allocation vector with dense tables (entry k = k units); tiny cases only."""
    total = np.zeros(())
    used = np.zeros((), dtype=np.int64)
    count = np.zeros((), dtype=np.int64)
    for g, c in zip(gains, changes, strict=True):
        k = np.arange(len(g))
        total = total[..., None] + g
        used = used[..., None] + k
        count = count[..., None] + c
    feasible = used <= capacity
    top = float(total[feasible].max())
    tied = feasible & (total >= top - _tolerance(gains, rel_tol))
    fewest = int(count[tied].min())
    winner = tuple(int(k) for k in np.argwhere(tied & (count == fewest))[0])
    return Solution(float(total[winner]), fewest, winner)
