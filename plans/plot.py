"""Figure 4 of the paper from the throughput model: achieved FLOP/s ratio and aggregate FLOP/s of the
GPT-3 sizes on 8-128 GPUs. matplotlib is imported here only, lazily, so ``plans`` stays light."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from plans.hardware import GpuType, gpu_type
from plans.models import GPT3
from plans.throughput import CostModel, model_curve


def throughput_rows(
    gpu: GpuType,
    sizes: Sequence[str],
    gpu_counts: Sequence[int],
    gpus_per_node: int = 8,
    cost: CostModel | None = None,
) -> dict[str, list[float]]:
    """T(t, x) in FLOP/s for each size at each GPU count (0 where no configuration uses exactly x)."""
    cost = cost or CostModel()
    return {s: [model_curve(GPT3[s], gpu, gpus_per_node, cost).at(x) for x in gpu_counts] for s in sizes}


def plot_throughput(
    out: str | Path,
    gpu: GpuType | None = None,
    sizes: Sequence[str] = ("1.3B", "7B", "13B", "70B", "175B"),
    gpu_counts: Sequence[int] = tuple(range(8, 129, 8)),
) -> dict[str, list[float]]:
    """Write the two-panel figure to ``out`` and return the plotted values.

    Dots are GPU counts some configuration uses exactly; lines join them. Crosses in the strip below
    zero (one row per model) are counts no configuration uses exactly, where T = 0: the task would
    have to leave GPUs idle. Both kinds of dip are the non-monotonic shape of Figure 4.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpu = gpu or gpu_type("A800-80GB")
    rows = throughput_rows(gpu, sizes, gpu_counts)
    fig, (ax_ratio, ax_agg) = plt.subplots(1, 2, figsize=(11, 4.2))
    top_ratio = max(
        (f / (x * gpu.peak_flops) for v in rows.values() for x, f in zip(gpu_counts, v, strict=True)),
        default=1,
    )
    top_agg = max((f / 1e15 for v in rows.values() for f in v), default=1)
    for i, (size, values) in enumerate(rows.items()):
        ok = [(x, f) for x, f in zip(gpu_counts, values, strict=True) if f > 0]
        gaps = [x for x, f in zip(gpu_counts, values, strict=True) if f <= 0]
        line = ax_ratio.plot([x for x, _ in ok], [f / (x * gpu.peak_flops) for x, f in ok], "o-", label=size)
        color = line[0].get_color()
        ax_agg.plot([x for x, _ in ok], [f / 1e15 for _, f in ok], "o-", color=color, label=size)
        # One row per model below zero: "no configuration uses exactly this many GPUs" (T = 0).
        for ax, top in ((ax_ratio, top_ratio), (ax_agg, top_agg)):
            ax.plot(gaps, [-(i + 1) * 0.025 * top] * len(gaps), "x", color=color, ms=4)
    ax_ratio.set_title(f"(a) achieved FLOP/s ratio ({gpu.name})")
    ax_ratio.set_ylabel("achieved / peak FLOP/s")
    ax_agg.set_title("(b) aggregate achieved FLOP/s")
    ax_agg.set_ylabel("PFLOP/s")
    for ax in (ax_ratio, ax_agg):
        ax.set_xlabel("GPUs")
        ax.set_xticks(list(gpu_counts)[1::2])
        ax.grid(alpha=0.3)
        ax.axhline(0.0, color="grey", lw=0.5)
        ax.legend(title="GPT-3 (x: T=0)", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return rows
