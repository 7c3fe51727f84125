"""``unicron simulate``: replay a failure trace against a workload for Unicron and the baselines.

Unicron runs through the coordinator's own decision core, allocator and placement (``sim/``); the
output directory gets ``figure11_<trace>.png`` (available GPUs, WAF, accumulated WAF over time) and
``summary.json`` (accumulated WAF per system, Unicron's ratios, the lost WAF split as in Eq. 1, and
every cost constant used). Run ``unicron simulate --list-costs`` to see the constants.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from plans.table3 import CASES
from sim import trace as traces
from sim import workload as workloads
from sim.costs import CostSettings
from sim.report import figure, ratios, summary, write_summary
from sim.run import parse_systems, simulate
from unicron.cli.common import at_least
from unicron.kernel.errors import ConfigError, InvalidRecord


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("simulate", help="simulate weeks of failures: Unicron vs the baselines (Figure 11)")
    p.add_argument("--trace", default="trace-a",
                   help="trace-a, trace-b (generated from --seed), or a JSON-lines trace file (default trace-a)")
    p.add_argument("--workload", default="case5",
                   help="case1..case5 (paper Table 3 on 16 x 8 A800) or a JSON file of task specs (default case5)")
    p.add_argument("--systems", default="all", help="'all' or a comma list of unicron,megatron,oobleck,varuna,bamboo")
    p.add_argument("--out", type=Path, default=Path("sim-out"), help="output directory (default ./sim-out)")
    p.add_argument("--seed", type=at_least(int, 0), default=0, help="seed of the generated trace (default 0)")
    p.add_argument("--cost", action="append", default=[], metavar="FIELD=VALUE",
                   help="override one cost constant (repeatable); see --list-costs")
    p.add_argument("--list-costs", action="store_true", help="print the cost constants and exit")
    p.add_argument("--save-trace", action="store_true", help="also write the trace used as trace.jsonl in --out")
    p.add_argument("--quiet", action="store_true", help="no progress line on stderr")
    p.set_defaults(func=cmd_simulate)


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # a name past the system's limits (ENAMETOOLONG) names no file
        return False


def load_trace(spec: str, seed: int, n_nodes: int, gpus_per_node: int) -> traces.Trace:
    path = Path(spec)
    if spec not in ("trace-a", "trace-b") and _exists(path):
        return traces.read(path, n_nodes=n_nodes, gpus_per_node=gpus_per_node)
    return traces.named(spec, seed)


def load_workload(spec: str) -> workloads.Workload:
    number = spec[4:] if spec.startswith("case") else ""
    # '²'.isdigit(), but int() refuses it, and 4,300 digits or more too: ASCII digits, a few of them
    if number.isascii() and number.isdigit():
        if len(number) > 9:
            raise InvalidRecord(f"--workload: {spec[:24]!r}... is not a Table 3 case; known: case1..case{len(CASES)}")
        return workloads.case(int(number))
    path = Path(spec)
    if not _exists(path):
        raise InvalidRecord(f"--workload: {spec!r} is neither case1..case5 nor an existing file")
    return workloads.from_file(path, n_nodes=16)


def cmd_simulate(args: argparse.Namespace) -> int:
    costs = CostSettings().with_overrides(args.cost)
    if args.list_costs:
        print(json.dumps(costs.to_dict(), indent=2))
        return 0
    systems = parse_systems(args.systems)
    workload = load_workload(args.workload)
    trace = load_trace(args.trace, args.seed, workload.n_nodes, workload.gpus_per_node)
    try:  # before the simulation: its hours of model time should not end in a write that cannot happen
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--out: cannot create {args.out} ({exc.strerror}); pick another directory") from exc
    if args.save_trace:
        traces.write(trace, args.out / "trace.jsonl")
    results = simulate(trace, workload, systems, costs, args.seed, progress=not args.quiet)
    figure(results, args.out / f"figure11_{trace.name}.png", trace.name)
    data = summary({trace.name: results}, costs, {"workload": workload.name, "seed": args.seed})
    write_summary(data, args.out / "summary.json")
    print(f"{trace.name} on {workload.name} ({workload.n_gpus} GPUs, {len(trace.failures)} failures, "
          f"{trace.duration_s / 86400:.1f} days, seed {args.seed}); model outputs, not measurements:")
    for name, r in results.items():
        s = r.summary()
        print(f"  {name:<9} accumulated WAF {s['accumulated_waf_pflop_h']:>10} PFLOP·h  "
              f"efficiency {s['efficiency']:.3f}  lost (det/trans/sub) {s['lost_pflop_h']}")
    for key, value in ratios(results).items():
        print(f"  {key}: {value}")
    print("cost constants: " + ", ".join(f"{k}={v:g}" for k, v in costs.to_dict().items()))
    print(f"wrote {args.out / 'summary.json'} and {args.out / f'figure11_{trace.name}.png'}", file=sys.stderr)
    return 0
