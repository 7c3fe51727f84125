"""Benchmark of the simulator (issue 15): Figure 11's ratios on Case #5, and a scale run.

    .venv/bin/python bench/simulate.py [--quick] [--seeds N]

1. trace-a and trace-b (paper §7.5) on Case #5 (128 A800) for Unicron, Megatron, Oobleck, Varuna and
   Bamboo, over several seeds: Unicron's accumulated WAF over each baseline's. These are outputs of
   the simulator's cost model (sim/costs.py) - a setting, not a measurement (docs/simulator.md).
2. A scale run through the real decision core and WAF planner: 16,384 GPUs (2,048 nodes), 100 tasks,
   8 weeks of Poisson failures at trace-a's per-GPU rate (``--quick``: 4,096 GPUs, 50 tasks, 2 weeks).
   ``sim_weeks_per_s`` is simulated weeks per wall second; ``decide_p99_ms`` the 99th percentile of one
   event through ``DecisionCore.handle`` (allocator = WafPlanner, placement) after the initial setup.
   The allocator answers from the coordinator's lookup table when the event is a one-step change of
   the last plan's state (``lookup_hit_rate``: such answers / all plans after setup); the simulator
   solves a table entry when it is first asked for and leaves that solve out of the event's time,
   because the live coordinator solves it in a background thread before the event (coordinator/lookup.py).

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sim import trace as tr
from sim.costs import CostSettings
from sim.report import ratios
from sim.run import SYSTEMS, simulate
from sim.unicron import UnicronSim
from sim.workload import case, scale


def figure11(seeds: int) -> dict[str, object]:
    out: dict[str, object] = {}
    highest = True
    for name, make in (("a", tr.trace_a), ("b", tr.trace_b)):
        per_seed: dict[str, list[float]] = {}
        for seed in range(seeds):
            results = simulate(make(seed), case(5), SYSTEMS, CostSettings(), seed)
            for key, value in ratios(results).items():
                per_seed.setdefault(key, []).append(value)
                highest &= value > 1.0
        for key, values in per_seed.items():
            system = key.removeprefix("waf_vs_")
            label = f"waf_vs_{system}_trace_{name}" if system == "megatron" else f"waf_vs_{system}_{name}"
            out[label] = round(statistics.mean(values), 3)
            out[label + "_range"] = [min(values), max(values)]
        print(f"trace-{name}: " + ", ".join(f"{k} {statistics.mean(v):.3f} [{min(v)}-{max(v)}]"
                                            for k, v in per_seed.items()), file=sys.stderr)
    out["unicron_highest_every_seed"] = highest
    return out


def scale_run(quick: bool, weeks_override: float | None = None, lookup: bool = True) -> dict[str, object]:
    n_tasks, n_nodes, weeks = (50, 512, 2.0) if quick else (100, 2048, 8.0)
    weeks = weeks_override or weeks
    workload = scale(n_tasks, n_nodes)
    trace = tr.poisson(0, n_nodes, weeks * tr.WEEK_S, name=f"poisson-{n_nodes * 8}")
    sim = UnicronSim(workload, trace, CostSettings(), progress=True, lookup=lookup)
    result = sim.run()
    lookup_stats = sim.lookup_stats()
    setup_s = result.setup_s
    events = np.array(result.decide_ms[result.setup_events:])
    loop_s = result.wall_s - setup_s
    print(f"scale: {n_nodes * 8} GPUs, {n_tasks} tasks, {weeks:g} weeks, {len(trace.failures)} failures "
          f"({trace.count(1)} sev1): setup {setup_s:.1f} s, run {result.wall_s:.1f} s, {len(events)} core events",
          file=sys.stderr)
    return {
        "scale_gpus": n_nodes * 8, "scale_tasks": n_tasks, "scale_weeks": weeks,
        "scale_failures": len(trace.failures), "scale_sev1": trace.count(1),
        "scale_core_events": len(events), "scale_setup_s": round(setup_s, 2),
        "scale_efficiency": round(result.accumulated / result.ideal, 4) if result.ideal else 0.0,
        "scale_counters": result.counters,
        "sim_weeks_per_s": round(weeks / max(loop_s, 1e-9), 5),
        "decide_p50_ms": round(float(np.percentile(events, 50)), 2),
        "decide_p99_ms": round(float(np.percentile(events, 99)), 2),
        "decide_max_ms": round(float(events.max()), 2),
        "decide_mean_ms": round(float(events.mean()), 2),
        **lookup_stats,
        "measured_transition_s_median": _median(sim.allocator.transition_s.values()),
        "observed_gpu_failure_rate_per_hour": sim.allocator.planner.reliability.gpu_failure_rate_per_hour,
    }


def _median(values: Iterable[float]) -> float | None:
    got = list(values)
    return round(statistics.median(got), 1) if got else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 seeds and a small scale run (under a minute)")
    parser.add_argument("--seeds", type=int, help="seeds per trace (default 2 quick, 5 full)")
    parser.add_argument("--part", choices=("all", "figure11", "scale"), default="all",
                        help="run only Figure 11's ratios or only the scale run (default: both)")
    parser.add_argument("--scale-weeks", type=float,
                        help="simulated weeks of the scale run (default 8, quick 2): a shorter run for profiling")
    parser.add_argument("--no-lookup", action="store_true",
                        help="scale run without the lookup table: every plan solved (for comparison)")
    args = parser.parse_args()
    if args.scale_weeks is not None and not args.scale_weeks > 0:
        parser.error(f"--scale-weeks must be a positive number of weeks, got {args.scale_weeks}")
    started = time.perf_counter()
    figures: dict[str, object] = {"quick": args.quick, "part": args.part, "lookup": not args.no_lookup}
    if args.part in ("all", "figure11"):
        figures |= figure11(args.seeds or (2 if args.quick else 5))
    if args.part in ("all", "scale"):
        figures |= scale_run(args.quick, args.scale_weeks, not args.no_lookup)
    figures["paper"] = {"waf_vs_megatron_trace_a": 1.2, "waf_vs_megatron_trace_b": 1.9, "waf_vs_oobleck_b": 3.8,
                        "waf_vs_varuna_b": 5.8, "waf_vs_bamboo_b": 4.8}
    figures["note"] = "ratios are outputs of sim/costs.py's model (docs/simulator.md), not measurements"
    figures["wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
