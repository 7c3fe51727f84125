"""The simulated workload: task specs (the coordinator's own ``TaskSpec``) and their throughput T(t, x).

``case5()`` is paper Table 3's Case #5 (the §7.5 workload): 1.3B x3, 7B x2, 13B on 128 A800, weights
2.0 .. 0.5. The coordinator runs a task with a fixed TP x PP (only data parallelism is elastic), so each
model size gets one pinned layout here (:data:`LAYOUTS`). ``from_file`` reads a JSON list of task specs
(the ``unicron submit`` format, with a model description). Throughput comes from the same curves the
planner uses (``coordinator.allocation.task_demand`` -> ``plans.problem.task_curve``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from coordinator.allocation import task_demand
from coordinator.tasks import ModelDescription, TaskSpec, parse_task_spec
from plans.api import ClusterSpec, CostModel, gpu_type
from plans.models import gpt3
from plans.problem import task_curve
from plans.table3 import CASES
from plans.throughput import ThroughputCurve
from unicron.kernel.errors import InvalidRecord

#: model size -> (tp, pp, micro batch): the layout each size is launched with (the planner's
#: configuration for it on Case #5's first plan, or the smallest unit that fits in 80 GB).
LAYOUTS: dict[str, tuple[int, int, int]] = {"1.3B": (1, 1, 2), "7B": (2, 2, 2), "13B": (2, 4, 1)}

BYTES_PER_PARAM = 16.0
"""Mixed-precision Adam training state per parameter (fp16 weights + grads, fp32 master + 2 moments)."""


def model_description(size: str, micro_batch: int) -> ModelDescription:
    m = gpt3(size)
    return ModelDescription(m.layers, m.hidden, m.heads, m.seq_len, m.vocab, m.global_batch, micro_batch)


def gpt3_task(name: str, size: str, weight: float) -> TaskSpec:
    tp, pp, mb = LAYOUTS[size]
    # the simulated tasks are Unicron-runtime jobs (reattempt, single-rank restart), not stock scripts
    data = {"name": name, "command": ["train"], "weight": weight, "tp_size": tp, "pp_size": pp,
            "min_gpus": tp * pp, "model": model_description(size, mb).to_dict(), "recovery": "inprocess"}
    return parse_task_spec(data, cluster_gpus=None, gpus_per_node=8)


@dataclass
class Workload:
    """Tasks on a cluster of ``n_nodes`` x ``gpus_per_node`` GPUs of ``gpu``."""

    name: str
    tasks: list[TaskSpec]
    n_nodes: int
    gpus_per_node: int = 8
    gpu: str = "A800"
    _curves: dict[str, ThroughputCurve] = field(default_factory=dict, repr=False)

    @property
    def n_gpus(self) -> int:
        return self.n_nodes * self.gpus_per_node

    def spec(self, name: str) -> TaskSpec:
        for t in self.tasks:
            if t.name == name:
                return t
        raise KeyError(name)

    def curve(self, name: str) -> ThroughputCurve:
        """T(t, ·) exactly as the WafAllocator sees it (pinned TP x PP, micro batch)."""
        if name not in self._curves:
            cluster = ClusterSpec(gpu_type(self.gpu), self.n_gpus, self.gpus_per_node)
            self._curves[name] = task_curve(task_demand(self.spec(name), {}, set()), cluster, CostModel())
        return self._curves[name]

    def waf(self, name: str, gpus: int) -> float:
        """Eq. 2: F(t, x) = w(t) T(t, x) if x meets T_necessary, else 0; FLOP/s."""
        spec = self.spec(name)
        if gpus < spec.min_gpus or gpus <= 0:
            return 0.0
        return spec.weight * self.curve(name).at(gpus)

    def iteration_s(self, name: str, gpus: int) -> float:
        """D_iter at ``gpus`` GPUs (from the throughput model); 60 s when no configuration runs there."""
        config = self.curve(name).config_at(gpus) if gpus > 0 else None
        return config.iteration_s if config is not None else 60.0

    def state_bytes(self, name: str) -> float:
        """The task's whole training state (what a reconfiguration restores), bytes."""
        model = self.spec(name).model
        if model is None:
            return 0.0
        m = model
        params = 12 * m.num_layers * m.hidden_size**2 + (m.vocab_size + m.seq_length) * m.hidden_size
        return params * BYTES_PER_PARAM


def case(number: int = 5, n_nodes: int = 16) -> Workload:
    """A Table 3 case on ``n_nodes`` x 8 A800 (the paper: 16 nodes, 128 GPUs)."""
    if number not in CASES:
        raise InvalidRecord(f"--workload: case{number} is not a Table 3 case; known: case1..case{len(CASES)}")
    sizes, weights = CASES[number]
    tasks = [gpt3_task(f"task{i + 1}", size, w) for i, (size, w) in enumerate(zip(sizes, weights, strict=True))]
    return Workload(f"case{number}", tasks, n_nodes)


def scale(n_tasks: int = 100, n_nodes: int = 2048) -> Workload:
    """The scale run: ``n_tasks`` tasks cycling through Case #5's sizes and weights."""
    sizes, weights = CASES[5]
    tasks = [gpt3_task(f"t{i:03d}", sizes[i % 6], weights[(i // 6) % 6]) for i in range(n_tasks)]
    return Workload(f"scale-{n_tasks}x{n_nodes * 8}", tasks, n_nodes)


def from_file(path: Path, n_nodes: int, gpus_per_node: int = 8) -> Workload:
    """A JSON list of task specs (every one with a ``model``), or ``{"tasks": [...], "n_nodes": N}``."""
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise InvalidRecord(f"--workload: cannot read {path}: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise InvalidRecord(f"--workload: {path} is not JSON ({exc.msg})") from None
    if isinstance(data, dict):
        nodes = data.get("n_nodes", n_nodes)
        if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
            raise InvalidRecord(f"workload.n_nodes: expected a positive integer, got {nodes!r}")
        n_nodes, data = nodes, data.get("tasks")
    if not isinstance(data, list) or not data:
        raise InvalidRecord("workload.tasks: expected a non-empty list of task specs")
    # the simulator models Unicron's own recovery: a task says "restart" only if it means it
    tasks = [parse_task_spec({"recovery": "inprocess", **t} if isinstance(t, dict) else t, n_nodes * gpus_per_node,
                             gpus_per_node) for t in data]
    for t in tasks:
        if t.model is None:
            raise InvalidRecord(f"workload.tasks[{t.name}].model: missing; the simulator needs it for T(t, x)")
    return Workload(path.stem, tasks, n_nodes, gpus_per_node)
