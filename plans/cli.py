"""``unicron plan``: plan a cluster from a JSON file, or draw the throughput model (Figure 4)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

from plans.baselines import BASELINES
from plans.planner import Planner, WafPlanner
from plans.problem import unmet_minimums
from plans.result import PlanResult
from plans.spec import PlanInput, load
from unicron.kernel.errors import InvalidRecord, UnicronError

PLANNERS = ("unicron", *BASELINES)


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "plan",
        help="allocate GPUs to tasks by WAF (paper §5) or plot the throughput model",
        description="Reads a cluster and its tasks (JSON, see docs/planner.md) and prints the allocation "
        "that maximises Eq. 3, with each task's Megatron configuration, T, F and G.",
    )
    p.add_argument("--input", metavar="FILE", help="cluster and task set, JSON")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.add_argument(
        "--planner",
        choices=(*PLANNERS, "all"),
        default="unicron",
        help="which planner to run; 'all' runs the WAF planner and the three baselines",
    )
    p.add_argument("--unit", choices=("gpu", "node"), help="allocation unit (default: the file's, else gpu)")
    p.add_argument(
        "--allow-unmet",
        action="store_true",
        help="plan even when not every task can meet its minimum (those get 0 GPUs)",
    )
    p.add_argument(
        "--plot-throughput",
        metavar="OUT.png",
        help="draw T(t,x) of the GPT-3 sizes on 8-128 A800 GPUs (paper Figure 4) to this file",
    )
    p.set_defaults(func=run)


def _planner(name: str, spec: PlanInput, unit: str) -> Planner:
    cls = WafPlanner if name == "unicron" else BASELINES[name]
    return cls(unit=unit, reliability=spec.reliability)  # type: ignore[arg-type]


def _print_plan(result: PlanResult, spec: PlanInput, out: TextIO) -> None:
    c = spec.cluster
    print(
        f"{result.planner}: {result.used_gpus}/{c.n_gpus} GPUs used, objective sum G = "
        f"{result.objective / 1e18:.4g} EFLOP, total WAF = {result.total_waf / 1e15:.4g} PFLOP/s",
        file=out,
    )
    header = (
        f"  {'task':<12} {'model':<10} {'w':>4} {'GPUs':>5}  {'config':<24} {'T PF/s':>8} {'F PF/s':>8} "
        f"{'G EFLOP':>9}  changed"
    )
    print(header, file=out)
    for t in spec.tasks:
        cfg = result.configs[t.name]
        print(
            f"  {t.name:<12} {t.model.label:<10} {t.weight:>4.2g} {result.allocation[t.name]:>5}  "
            f"{cfg.describe() if cfg else '-':<24} {result.throughput[t.name] / 1e15:>8.3f} "
            f"{result.waf[t.name] / 1e15:>8.3f} {result.gain[t.name] / 1e18:>9.4g}  "
            f"{'yes' if result.changed[t.name] else 'no'}",
            file=out,
        )


def _plan(args: argparse.Namespace) -> int:
    spec = load(args.input)
    unit = args.unit or spec.unit
    if not args.allow_unmet:
        unit_size = 1 if unit == "gpu" else spec.cluster.gpus_per_node
        problems = unmet_minimums(spec.cluster, spec.tasks, WafPlanner().cost, unit_size)
        if problems:
            raise InvalidRecord("; ".join(problems) + " (lower min_gpus, add GPUs, or pass --allow-unmet)")
    names = PLANNERS if args.planner == "all" else (args.planner,)
    results = [_planner(n, spec, unit).plan(spec.cluster, spec.tasks) for n in names]
    if args.json:
        doc: dict[str, Any] = {"unit": unit, "plans": [r.to_dict() for r in results]}
        print(json.dumps(doc, indent=2))
        return 0
    c = spec.cluster
    print(
        f"cluster: {c.n_gpus} x {c.gpu_type.name}, {c.gpus_per_node} per node; unit: {unit}; "
        f"D_running = {results[0].d_running_s / 3600:.1f} h"
    )
    for r in results:
        _print_plan(r, spec, sys.stdout)
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        if args.plot_throughput is None and args.input is None:
            raise InvalidRecord("plan: give --input FILE or --plot-throughput OUT.png")
        if args.plot_throughput is not None:
            from plans.plot import plot_throughput

            try:
                plot_throughput(args.plot_throughput)
            except OSError as exc:
                raise InvalidRecord(f"--plot-throughput: cannot write {args.plot_throughput}: {exc}") from exc
            print(f"wrote {args.plot_throughput}")
        if args.input is not None:
            return _plan(args)
        return 0
    except UnicronError as exc:
        print(f"unicron plan: error: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``python -m plans.cli``) until the lead wires ``plan`` into ``unicron``."""
    parser = argparse.ArgumentParser(prog="unicron")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
