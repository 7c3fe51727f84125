"""T(t, x): the best achieved aggregate FLOP/s of a GPT task on exactly x GPUs (paper §5.1, Figure 4).

Every Megatron configuration is enumerated (TP among the divisors of the GPUs per node that also
divide the heads, PP dividing the layers, DP dividing the global batch, micro-batch dividing the
per-replica batch, full activation recomputation on or off), configurations that do not fit in
device memory are rejected, the iteration time of the rest is estimated, and for each GPU count
the fastest configuration wins. The enumeration runs over divisors, not over GPU counts, so the
whole curve (every x any configuration reaches) costs the same for 8 or for 100 000 GPUs.

A GPU count that no configuration uses exactly has T = 0: the task would have to leave GPUs idle,
which the planner expresses by giving it fewer. That is what makes the curve non-monotonic.

``Calibration`` folds measured throughput in, Sia-style (see ``calibrate``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from plans.hardware import GpuType
from plans.models import ModelSpec
from unicron.kernel.errors import InvalidRecord

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class CostModel:
    """Settings of the analytic iteration-time and memory model. Defaults describe Megatron-LM with
    BF16 mixed precision, sequence parallelism when TP > 1, and no distributed optimizer."""

    gemm_efficiency_max: float = 0.72
    """Fraction of peak reached by large GEMMs, elementwise kernels included."""
    gemm_half_width: float = 192.0
    """Per-GPU hidden width h/TP at which GEMM efficiency halves: efficiency falls as TP grows."""
    gemm_half_tokens: float = 256.0
    """Tokens per micro-batch (b·s) at which GEMM efficiency halves."""
    collective_latency_s: float = 15e-6
    """Fixed cost of one collective or point-to-point message, seconds."""
    bytes_per_param: float = 18.0
    """Model state per parameter: BF16 weight 2 + FP32 gradient 4 + FP32 master, Adam m and v 12."""
    grad_reduce_bytes: float = 4.0
    """Bytes per parameter moved by the DP gradient all-reduce (FP32 gradients)."""
    memory_reserve_fraction: float = 0.1
    """Share of device memory kept free for the CUDA context, NCCL buffers and fragmentation."""
    max_micro_batch: int = 16
    """Largest micro-batch size tried."""
    dp_overlap: float = 0.0
    """Share of the DP all-reduce hidden behind the backward pass (0: none, Megatron's old default)."""


@dataclass(frozen=True)
class ParallelConfig:
    """One Megatron configuration and what the model predicts for it."""

    tp: int
    """Tensor-parallel size."""
    pp: int
    """Pipeline-parallel size."""
    dp: int
    """Data-parallel size."""
    micro_batch: int
    """Micro-batch size, sequences."""
    recompute: bool
    """Full activation recomputation."""
    iteration_s: float
    """Predicted time of one optimizer step, seconds."""
    memory_bytes: float
    """Predicted peak memory of the most loaded GPU, bytes."""

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def describe(self) -> str:
        rc = " recompute" if self.recompute else ""
        return f"TP{self.tp} PP{self.pp} DP{self.dp} mb{self.micro_batch}{rc}"


@dataclass(frozen=True)
class ThroughputCurve:
    """The sparse curve x -> (T, config): only GPU counts some configuration uses exactly."""

    gpus: tuple[int, ...]
    """GPU counts with T > 0, ascending."""
    flops: tuple[float, ...]
    """T at each of ``gpus``: achieved aggregate FLOP/s (useful FLOPs, recomputation excluded)."""
    configs: tuple[ParallelConfig | None, ...]
    """Best configuration at each of ``gpus`` (None for a measured point the model cannot place)."""
    _index: dict[int, int] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", {x: i for i, x in enumerate(self.gpus)})

    def at(self, x: int) -> float:
        """T(t, x); 0 where no configuration uses exactly x GPUs."""
        i = self._index.get(x)
        return 0.0 if i is None else self.flops[i]

    def config_at(self, x: int) -> ParallelConfig | None:
        i = self._index.get(x)
        return None if i is None else self.configs[i]

    def dense(self, capacity: int, unit: int) -> FloatArray:
        """T at 0, unit, 2·unit, ..., capacity·unit GPUs, as an array indexed by units."""
        out = np.zeros(capacity + 1)
        for x, f in zip(self.gpus, self.flops, strict=True):
            if x % unit == 0 and x // unit <= capacity:
                out[x // unit] = f
        return out


@dataclass(frozen=True)
class Calibration:
    """Measured throughput of a running task: achieved aggregate FLOP/s at some GPU counts."""

    measured: Mapping[int, float]
    """GPU count -> measured achieved FLOP/s (useful FLOPs per second, as the model counts them)."""

    def __post_init__(self) -> None:
        for x, f in self.measured.items():
            if not isinstance(x, int) or isinstance(x, bool) or x <= 0:
                raise InvalidRecord(f"task.calibration: GPU count {x!r} is not a positive integer")
            if not isinstance(f, int | float) or isinstance(f, bool) or not math.isfinite(f) or f < 0:
                raise InvalidRecord(f"task.calibration[{x}]: {f!r} is not a finite FLOP/s >= 0")

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.measured.items())))


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _enumerate(
    model: ModelSpec, gpus_per_node: int, cost: CostModel, tp: int | None, pp: int | None, mb: int | None
) -> IntArray:
    """All (tp, pp, dp, micro_batch, recompute) tuples Megatron accepts for this model, as rows;
    ``tp``/``pp``/``mb`` not None pin that dimension (a task launched with a fixed layout)."""
    rows = []
    tps = [t for t in _divisors(gpus_per_node) if model.heads % t == 0 and tp in (None, t)]
    # DP and the micro-batch both divide the global batch: its divisors once, not once per DP size
    batches = _divisors(model.global_batch)
    micro = [mb] if mb is not None else [b for b in batches if b <= cost.max_micro_batch]
    for t in tps:
        for p in _divisors(model.layers):
            if pp not in (None, p):
                continue
            for dp in batches:
                for b in micro:
                    if model.global_batch // dp % b == 0:
                        rows.append((t, p, dp, b, 0))
                        rows.append((t, p, dp, b, 1))
    return np.array(rows, dtype=np.int64).reshape(-1, 5)


def estimate(
    model: ModelSpec, gpu: GpuType, gpus_per_node: int, cost: CostModel, cfg: IntArray
) -> tuple[FloatArray, FloatArray]:
    """Iteration time (s) and peak memory per GPU (bytes) of each configuration row, vectorised."""
    tp, pp, dp, mb, rc = (cfg[:, i].astype(np.float64) for i in range(5))
    h, s, a, v = float(model.hidden), float(model.seq_len), float(model.heads), float(model.vocab)
    layers_stage = model.layers / pp
    micro_batches = model.global_batch / (dp * mb)
    gpus = tp * pp * dp
    lat = cost.collective_latency_s

    # Compute: the slowest stage holds its layers plus the output layer; GEMMs shrink with TP.
    width = h / tp
    tokens = mb * s
    eff = (
        cost.gemm_efficiency_max
        * width
        / (width + cost.gemm_half_width)
        * tokens
        / (tokens + cost.gemm_half_tokens)
    )
    layer_fwd = 24 * mb * s * h * h + 4 * mb * s * s * h
    stage_flops = layers_stage * layer_fwd * (3 + rc) + 6 * mb * s * h * v
    t_compute = stage_flops / (tp * gpu.peak_flops * eff)

    # TP: 2 collectives per layer forward, 2 backward, 2 more when the forward is recomputed.
    tp_bytes = 2 * mb * s * h
    per_collective = 2 * (tp - 1) / tp * tp_bytes / gpu.nvlink_bw + lat
    t_tp = np.where(tp > 1, layers_stage * (4 + 2 * rc) * per_collective, 0.0)

    # PP: activations forward and gradients backward between stages (scatter-gather: 1/TP of them).
    per_gpu_net = gpu.internode_bw / gpus_per_node
    pp_bw = np.where(gpus > gpus_per_node, per_gpu_net, gpu.nvlink_bw)
    t_pp = np.where(pp > 1, 2 * (2 * mb * s * h / tp / pp_bw + lat), 0.0)

    # DP: ring all-reduce of the stage's gradients; inside a node only when the group fits in one.
    params_stage = (layers_stage * (12 * h * h + 13 * h) + (v + s) * h) / tp
    group_in_node = gpus_per_node % (tp * dp) == 0
    dp_bw = np.where(group_in_node, gpu.nvlink_bw, per_gpu_net)
    t_dp = np.where(
        dp > 1,
        2 * (dp - 1) / dp * params_stage * cost.grad_reduce_bytes / dp_bw + 2 * np.ceil(np.log2(dp)) * lat,
        0.0,
    )
    t_opt = 2 * params_stage * cost.bytes_per_param / gpu.hbm_bw

    per_micro_batch = t_compute + t_tp + t_pp
    iteration = (micro_batches + pp - 1) * per_micro_batch + (1 - cost.dp_overlap) * t_dp + t_opt

    # Memory (Korthikanti et al. 2022, sequence parallel): 1F1B keeps min(PP, m) micro-batches in flight.
    layer_act = s * mb * h * (34 + 5 * a * s / h) / tp
    in_flight = np.minimum(pp, micro_batches)
    act = np.where(
        rc > 0,
        layers_stage * (2 * s * mb * h / tp) * in_flight + layer_act,
        layers_stage * layer_act * in_flight,
    )
    logits = 2 * 4 * s * mb * v / tp  # FP32 logits and their gradient
    memory = params_stage * cost.bytes_per_param + act + logits
    return iteration, memory


@functools.lru_cache(maxsize=512)
def model_curve(
    model: ModelSpec,
    gpu: GpuType,
    gpus_per_node: int,
    cost: CostModel,
    tp: int | None = None,
    pp: int | None = None,
    micro_batch: int | None = None,
) -> ThroughputCurve:
    """T(t, x) for every x any configuration reaches (the analytic model, no calibration); ``tp``,
    ``pp`` and ``micro_batch`` pin those dimensions when the task's layout is fixed."""
    cfg = _enumerate(model, gpus_per_node, cost, tp, pp, micro_batch)
    iteration, memory = estimate(model, gpu, gpus_per_node, cost, cfg)
    fits = memory <= gpu.memory_bytes * (1 - cost.memory_reserve_fraction)
    cfg, iteration, memory = cfg[fits], iteration[fits], memory[fits]
    if len(cfg) == 0:
        return ThroughputCurve((), (), ())
    flops = model.flops_per_iteration / iteration
    gpus = cfg[:, 0] * cfg[:, 1] * cfg[:, 2]
    # Best per GPU count: sort by (gpus, -flops) and keep each group's first row.
    order = np.lexsort((-flops, gpus))
    first = np.ones(len(order), dtype=bool)
    first[1:] = gpus[order][1:] != gpus[order][:-1]
    best = order[first]
    configs = tuple(
        ParallelConfig(
            int(cfg[i, 0]),
            int(cfg[i, 1]),
            int(cfg[i, 2]),
            int(cfg[i, 3]),
            bool(cfg[i, 4]),
            float(iteration[i]),
            float(memory[i]),
        )
        for i in best
    )
    return ThroughputCurve(tuple(int(g) for g in gpus[best]), tuple(float(f) for f in flops[best]), configs)


def calibrate(curve: ThroughputCurve, calibration: Calibration | None) -> ThroughputCurve:
    """Fold measurements in, Sia-style: a measured point replaces the model's value; an unmeasured
    point is the model's value scaled by measured/modelled at the nearest measured GPU count (in
    log2 distance, the smaller count on a tie) among those the model can also place."""
    if calibration is None or not calibration.measured:
        return curve
    ratios = {x: f / curve.at(x) for x, f in calibration.measured.items() if curve.at(x) > 0}
    points: dict[int, tuple[float, ParallelConfig | None]] = {}
    for x, f, c in zip(curve.gpus, curve.flops, curve.configs, strict=True):
        if ratios:
            nearest = min(ratios, key=lambda m: (abs(math.log2(m / x)), m))
            f = f * ratios[nearest]
        points[x] = (f, c)
    for x, f in calibration.measured.items():
        points[x] = (float(f), curve.config_at(x))
    xs = sorted(x for x, (f, _) in points.items() if f > 0)
    return ThroughputCurve(tuple(xs), tuple(points[x][0] for x in xs), tuple(points[x][1] for x in xs))
