"""The paper's Table 3: six tasks on 128 A800 GPUs, five cases of sizes and weights."""

from __future__ import annotations

from plans.hardware import gpu_type
from plans.models import gpt3
from plans.problem import ClusterSpec, TaskDemand

_MIXED = ("1.3B", "1.3B", "1.3B", "7B", "7B", "13B")
_RISING = (0.5, 0.8, 1.1, 1.4, 1.7, 2.0)

#: case -> (model sizes, weights), tasks 1..6 as in the paper.
CASES: dict[int, tuple[tuple[str, ...], tuple[float, ...]]] = {
    1: (("7B",) * 6, (1.0,) * 6),
    2: (_MIXED, (1.0,) * 6),
    3: (("7B",) * 6, _RISING),
    4: (_MIXED, _RISING),
    5: (_MIXED, tuple(reversed(_RISING))),
}


def case(number: int, n_gpus: int = 128) -> tuple[ClusterSpec, list[TaskDemand]]:
    """Cluster and tasks of one Table 3 case (fresh start: nothing running, nothing faulted)."""
    sizes, weights = CASES[number]
    tasks = [
        TaskDemand(f"task{i + 1}", gpt3(size), weight=w)
        for i, (size, w) in enumerate(zip(sizes, weights, strict=True))
    ]
    return ClusterSpec(gpu_type("A800-80GB"), n_gpus), tasks
