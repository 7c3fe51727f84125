"""Benchmark of the WAF planner (paper §5): solve time, lookup time, Table 3 WAF, brute-force agreement.

    .venv/bin/python bench/planner.py [--quick]

Solve time is measured on the decision the coordinator actually makes: the tasks run on the plan
for n + 8 GPUs, a node of one of them is lost, and the planner re-plans n GPUs (Eq. 3 with the
transition penalty live). ``plan()`` is timed end to end (tables, pruning, the programme, scoring)
with the throughput curves already cached, as they are in a running coordinator; the programme
alone is reported as ``dp_ms``. The unpruned O(m·n²) programme is timed where it is affordable.

``lookup_ms`` times the call the coordinator makes, ``LookupTable.answer(cluster, tasks)``
(coordinator/lookup.py), on problems built afresh as the coordinator builds them for an event (a
node of a task lost, a node joined), each answered from the table; before 2026-11-28 it timed
``on_node_lost(name)``, a dictionary lookup by name the coordinator never calls.

``table3_wins`` is a model output, not a check: the planner and the baselines are scored by the same
``plans.result.evaluate`` the planner maximises, so it wins by construction; it is reported and
labelled (``table3_note``) but is not in ``targets_met``. ``bruteforce_mismatches`` is the real
check of the programme.
The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plans import dp
from plans.baselines import BASELINES
from plans.hardware import gpu_type
from plans.lookup import LookupTable, joined_scenario, lost_scenario
from plans.models import GPT3
from plans.planner import Unit, WafPlanner
from plans.problem import ClusterSpec, TaskDemand
from plans.table3 import CASES, case
from plans.waf import choices, gain_table, waf_table

A800 = gpu_type("A800-80GB")
SIZES = list(GPT3)


def best_of(fn: Callable[[], object], repeat: int) -> float:
    """Fastest of ``repeat`` runs, milliseconds (the machine is shared: the minimum is the signal)."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def workload(m: int) -> list[TaskDemand]:
    """m tasks cycling through the GPT-3 sizes with weights spread over the paper's 0.5-2.0."""
    return [
        TaskDemand(f"t{i}", GPT3[SIZES[i % len(SIZES)]], weight=0.5 + 1.5 * ((7 * i) % 11) / 10)
        for i in range(m)
    ]


def replan_state(planner: WafPlanner, m: int, n: int) -> tuple[ClusterSpec, list[TaskDemand]]:
    """Tasks placed by a plan for n + 8 GPUs, then one node of the largest one lost: re-plan n."""
    before = ClusterSpec(A800, n + 8)
    tasks = workload(m)
    start = planner.plan(before, tasks)
    victim = max(start.allocation, key=lambda k: start.allocation[k])
    running = [replace(t, current_gpus=start.allocation[t.name], faulted=t.name == victim) for t in tasks]
    return ClusterSpec(A800, n), running


def solve_times(quick: bool) -> dict[str, Any]:
    repeat = 3 if quick else 15
    out: dict[str, Any] = {}
    units: tuple[Unit, ...] = ("node", "gpu")
    for unit in units:
        for m in (6, 20, 100):
            for n in (128, 1024, 16384):
                planner = WafPlanner(unit=unit)
                cluster, tasks = replan_state(planner, m, n)
                problem = planner.problem(cluster, tasks)
                capacity = n // planner.unit_size(cluster)
                key = f"{m}x{n}" + ("" if unit == "node" else "_gpu")
                out[f"solve_ms_{key}"] = round(
                    best_of(functools.partial(planner.plan, cluster, tasks), repeat), 3
                )
                out[f"dp_ms_{key}"] = round(
                    best_of(functools.partial(dp.solve, problem, capacity), repeat), 3
                )
                out[f"choices_{key}"] = round(float(np.mean([len(c.units) for c in problem])), 1)
                print(
                    f"  {unit:4s} m={m:3d} n={n:5d}: plan {out[f'solve_ms_{key}']:8.2f} ms, "
                    f"dp {out[f'dp_ms_{key}']:8.2f} ms, "
                    f"{out[f'choices_{key}']:5.1f} choices/task (of {capacity + 1})"
                )
    return out


def dense_times(quick: bool) -> dict[str, Any]:
    """The unpruned programme (every k from 0 to n for every task), GPU units."""
    out: dict[str, Any] = {}
    sizes = [(6, 128), (20, 128), (100, 128), (6, 1024), (20, 1024), (100, 1024)]
    if not quick:
        sizes.append((6, 16384))
    for m, n in sizes:
        planner = WafPlanner(unit="gpu")
        cluster, tasks = replan_state(planner, m, n)
        pruned = planner.problem(cluster, tasks)
        dense = planner.problem(cluster, tasks, prune=False)
        ms = best_of(functools.partial(dp.solve, dense, n), 1 if n > 1024 else 2)
        pruned_ms = best_of(functools.partial(dp.solve, pruned, n), 3)
        same = dp.solve(dense, n).value == dp.solve(pruned, n).value
        out[f"dense_dp_ms_{m}x{n}_gpu"] = round(ms, 1)
        out[f"dense_over_pruned_{m}x{n}_gpu"] = round(ms / pruned_ms, 1)
        print(
            f"  dense m={m:3d} n={n:5d}: {ms:9.1f} ms ({ms / pruned_ms:6.1f}x the pruned dp), "
            f"same optimum: {same}"
        )
    if not quick:
        # m=100 x 16384 dense: linear in m from the measured m=6 point (one run would take minutes).
        out["dense_dp_ms_100x16384_gpu_extrapolated"] = round(out["dense_dp_ms_6x16384_gpu"] * 100 / 6, 0)
    return out


def lookup_times(quick: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m, n in [(6, 128), (100, 16384)]:
        planner = WafPlanner(unit="node")
        tasks = workload(m)
        cluster = ClusterSpec(A800, n)
        start = planner.plan(cluster, tasks)
        running = [replace(t, current_gpus=start.allocation[t.name]) for t in tasks]
        begin = time.perf_counter()
        table = LookupTable(cluster, running, planner)
        build = time.perf_counter() - begin
        victim = next(t.name for t in running if t.current_gpus > 0)
        reps = 2000 if not quick else 500
        # the coordinator asks with problems it has just built (new objects, hashed and compared in
        # full), alternating a node lost and a node joined; built before the clock starts
        problems = [scenario for _ in range(reps) for scenario in (
            lost_scenario(replace(cluster), [replace(t) for t in running], victim),
            joined_scenario(replace(cluster), [replace(t) for t in running]))]
        begin = time.perf_counter()
        answers = [table.answer(c, ts) for c, ts in problems]
        per = (time.perf_counter() - begin) / len(problems)
        if any(a is None for a in answers):
            raise SystemExit(f"lookup m={m} n={n}: the table missed a one-step change it holds")
        entries = len(list(table.entries())) + 1
        out[f"lookup_build_s_{m}x{n}"] = round(build, 3)
        out[f"lookup_ms_{m}x{n}"] = per * 1e3
        print(
            f"  lookup m={m:3d} n={n:5d} (node units): {entries} entries built in {build:.2f} s, "
            f"lookup {per * 1e6:.2f} us"
        )
    out["lookup_ms"] = out["lookup_ms_100x16384"]
    return out


def table3() -> dict[str, Any]:
    """WAF (PFLOP/s) of the planner and the three baselines on Table 3, 128 A800 GPUs, GPU units."""
    out: dict[str, Any] = {}
    wins = 0
    print(
        f"  {'case':4s} {'unicron':>8s} " + " ".join(f"{b:>8s}" for b in BASELINES) + "   unicron allocation"
    )
    for number in CASES:
        cluster, tasks = case(number)
        ours = WafPlanner().plan(cluster, tasks)
        theirs = {name: cls().plan(cluster, tasks) for name, cls in BASELINES.items()}
        win = all(ours.total_waf >= r.total_waf * (1 - 1e-12) for r in theirs.values())
        wins += win
        out[f"table3_case{number}_pflops"] = {
            "unicron": round(ours.total_waf / 1e15, 3),
            **{name: round(r.total_waf / 1e15, 3) for name, r in theirs.items()},
        }
        print(
            f"  {number:4d} {ours.total_waf / 1e15:8.2f} "
            + " ".join(f"{r.total_waf / 1e15:8.2f}" for r in theirs.values())
            + f"   {list(ours.allocation.values())}"
        )
    out["table3_wins"] = wins
    return out


def bruteforce(quick: bool) -> dict[str, Any]:
    """Random small instances: the planner's programme against enumeration of Eq. 3."""
    rng = np.random.default_rng(2024)
    trials = 300 if quick else 2000
    mismatches = 0
    for _ in range(trials):
        capacity = int(rng.integers(0, 10))
        m = int(rng.integers(1, 5))
        gains, changes, pruned = [], [], []
        for _ in range(m):
            t = (
                rng.integers(0, 7, capacity + 1).astype(np.float64)
                if rng.random() < 0.5
                else rng.random(capacity + 1)
            )
            t[0] = 0.0
            f = waf_table(t, float(rng.choice([0.5, 1.0, 2.0])), int(rng.integers(0, capacity + 2)))
            current = int(rng.integers(0, capacity + 2))
            f_now = float(f[current]) if current <= capacity else 1.0
            g, c = gain_table(
                f,
                current,
                bool(rng.random() < 0.3),
                f_now,
                float(rng.choice([1.0, 5.0])),
                float(rng.choice([0.0, 1.0, 3.0])),
            )
            gains.append(g)
            changes.append(c)
            pruned.append(choices(g, c))
        want = dp.brute_force(gains, changes, capacity)
        got = dp.solve(pruned, capacity)
        scale = sum(float(np.abs(g).max()) for g in gains) + 1.0
        if abs(got.value - want.value) > 1e-9 * scale or got.changes != want.changes:
            mismatches += 1
    print(f"  {trials} random instances, {mismatches} mismatches")
    return {"bruteforce_trials": trials, "bruteforce_mismatches": mismatches}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer repeats and trials, no dense 16384 run")
    args = parser.parse_args()
    begin = time.perf_counter()
    for model in GPT3.values():  # warm the throughput-curve cache, as a running coordinator has it
        WafPlanner().plan(ClusterSpec(A800, 8), [TaskDemand("warm", model)])
    figures: dict[str, Any] = {"quick": args.quick}
    print("solve time (re-plan after a node loss; node units = 8 GPUs):")
    figures |= solve_times(args.quick)
    print("unpruned programme, GPU units:")
    figures |= dense_times(args.quick)
    print("lookup table:")
    figures |= lookup_times(args.quick)
    print("Table 3 WAF, PFLOP/s (128 A800):")
    figures |= table3()
    print("brute force:")
    figures |= bruteforce(args.quick)
    figures["table3_note"] = ("table3_wins is a model output (planner and baselines scored by the "
                              "plans.result.evaluate the planner maximises), not a target")
    figures["targets_met"] = bool(
        figures["solve_ms_100x16384"] <= 100
        and figures["lookup_ms"] <= 1
        and figures["bruteforce_mismatches"] == 0
    )
    figures["wall_s"] = round(time.perf_counter() - begin, 1)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
