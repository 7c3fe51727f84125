"""Outputs: the Figure 11 panels (available GPUs, WAF, accumulated WAF over time) and a JSON summary."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from sim.costs import CostSettings
from sim.engine import Result

PFLOP = 1e15
COLORS = {"unicron": "tab:red", "megatron": "tab:blue", "oobleck": "tab:green", "varuna": "tab:purple",
          "bamboo": "tab:orange"}


def accumulated_curve(r: Result) -> tuple[list[float], list[float]]:
    """Accumulated WAF (PFLOP·h, weighted) at each change point and at the end."""
    xs, ys, total = [0.0], [0.0], 0.0
    times = [*r.times, r.duration_s]
    for i, waf in enumerate(r.waf):
        total += waf * max(times[i + 1] - times[i], 0.0)
        xs.append(times[i + 1])
        ys.append(total / PFLOP / 3600)
    return xs, ys


def _steps(r: Result, values: list[float]) -> tuple[list[float], list[float]]:
    days = [t / 86400 for t in (*r.times, r.duration_s)]
    return days, [*values, values[-1]]


def figure(results: Mapping[str, Result], path: Path, title: str) -> None:
    """One PNG, three panels like Figure 11 (a)-(c) / (d)-(f)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    first = next(iter(results.values()))
    x, y = _steps(first, [float(g) for g in first.available_gpus])
    axes[0].step(x, y, where="post", color="black")
    axes[0].set(title=f"available GPUs ({title})", xlabel="days", ylabel="GPUs")
    axes[0].set_ylim(0, max(y) * 1.05)
    for name, r in results.items():
        x, y = _steps(r, [w / PFLOP for w in r.waf])
        axes[1].step(x, y, where="post", label=name, color=COLORS.get(name), linewidth=1)
        ax, ay = accumulated_curve(r)
        axes[2].plot([t / 86400 for t in ax], ay, label=name, color=COLORS.get(name))
    axes[1].set(title=f"WAF ({title})", xlabel="days", ylabel="WAF, PFLOP/s (weighted)")
    axes[2].set(title=f"accumulated WAF ({title})", xlabel="days", ylabel="PFLOP·h (weighted)")
    axes[1].legend(fontsize=8)
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ratios(results: Mapping[str, Result]) -> dict[str, float]:
    """Unicron's accumulated WAF over each other system's."""
    if "unicron" not in results:
        return {}
    base = results["unicron"].accumulated
    return {f"waf_vs_{n}": round(base / r.accumulated, 3) for n, r in results.items()
            if n != "unicron" and r.accumulated > 0}


def summary(runs: Mapping[str, Mapping[str, Result]], costs: CostSettings, extra: Mapping[str, object]) -> dict[str, object]:
    return {
        **extra,
        "costs": costs.to_dict(),
        "traces": {
            trace: {"ratios": ratios(results), "systems": {n: r.summary() for n, r in results.items()}}
            for trace, results in runs.items()
        },
        "note": "every figure is an output of the simulator's model (docs/simulator.md), not a measurement",
    }


def write_summary(data: Mapping[str, object], path: Path) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
