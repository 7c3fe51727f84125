"""The dynamic programme of paper Eq. 5, as a max-plus product over NumPy arrays, with traceback.

S(i, j) = max_k { S(i-1, j-k) + G(t_i, k) }, S(0, j) = 0: the best total reward of the first i
tasks on at most j units. Each task contributes only its ``Choices`` (the allocations that can be
optimal); a step is vectorised over j.

Ties: the programme maximises sum G - eps * (number of changed tasks), with eps a billionth of the
largest possible |sum G|, so among plans within eps per change of each other the one with fewer
changes (Eq. 4's indicator) wins; among exact ties, the smaller allocation of the later task.
``brute_force`` applies the same rule to every allocation vector, to check the programme against.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


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


def epsilon(gain_arrays: Sequence[FloatArray], rel_tol: float = 1e-9) -> float:
    """The price of one change in the tie-break: ``rel_tol`` of the largest possible |sum of G|."""
    scale = sum(float(np.max(np.abs(g))) if len(g) else 0.0 for g in gain_arrays)
    return rel_tol * max(scale, 1e-300)


def solve(tasks: Sequence[Choices], capacity: int, rel_tol: float = 1e-9) -> Solution:
    """Maximise sum G(t_i, k_i) subject to sum k_i <= capacity (Eq. 3 by Eq. 5), fewest changes on ties.

    The recurrence runs on G - eps * changes (``epsilon``): plans whose rewards are within eps per
    change of each other are ties, and the one with fewer changes wins. Each step streams over the
    task's choices, folding each shifted copy of S(i-1, .) into S(i, .) with an in-place maximum
    (two passes over memory per choice; no argmax bookkeeping). The traceback recomputes, at the
    one column it needs per task, which choice reached the maximum: the same float additions give
    bit-identical values, so the first exact match is the choice (the smallest one on a tie).
    """
    width = capacity + 1
    eps = epsilon([c.gains for c in tasks], rel_tol)
    scores = []
    tables = [np.zeros(width)]  # tables[i] = S(i, .)
    scratch = np.empty(width)
    for i, task in enumerate(tasks):
        if len(task.units) == 0 or task.units[0] != 0:
            raise ValueError(f"task {i}: choices must start with 0 units")
        score = task.gains - eps * task.changes
        scores.append(score)
        prev = tables[-1]
        new = prev + score[0]
        for r in range(1, int(np.searchsorted(task.units, capacity, side="right"))):
            k = int(task.units[r])
            shifted = np.add(prev[: width - k], score[r], out=scratch[: width - k])
            np.maximum(new[k:], shifted, out=new[k:])
        tables.append(new)
    units, value, changes = [], 0.0, 0
    j = capacity
    for i in range(len(tasks) - 1, -1, -1):
        task = tasks[i]
        rows = int(np.searchsorted(task.units, j, side="right"))
        reached = tables[i][j - task.units[:rows]] + scores[i][:rows]
        r = int(np.flatnonzero(reached == tables[i + 1][j])[0])
        k = int(task.units[r])
        units.append(k)
        value += float(task.gains[r])
        changes += int(task.changes[r])
        j -= k
    return Solution(value, changes, tuple(reversed(units)))


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
    score = np.where(used <= capacity, total - epsilon(gains, rel_tol) * count, -np.inf)
    winner = tuple(int(k) for k in np.unravel_index(int(np.argmax(score)), score.shape))
    return Solution(float(total[winner]), int(count[winner]), winner)
