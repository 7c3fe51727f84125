"""Finishing a failed iteration by redistributing micro-batches (paper §6), against its alternatives.

A 4-rank Megatron-core GPT on CPU (gloo). Rank 3 is SIGKILLed in iteration ``F`` after ``P`` of its
``k`` micro-batches; the launcher marks it failed the moment it exits, as the agent does. Measured in
the same run, each from the moment of death to the end of iteration ``F``:

* ``redistribute_s``: survivors regroup in place and compute the dead rank's micro-batches;
* ``rerun_iteration_s``: (a) survivors regroup in place but recompute the whole iteration;
* ``restart_from_ckpt_s``: (b) every rank is killed and relaunched (new processes, forked from the
  same warm spawner as the other runs, as the agent forks every rank), restores the torch.save
  checkpoint written after every iteration (the baseline's best case: only the failed iteration is
  lost) and recomputes iteration ``F``.

The three alternate, ``reps`` times each (5 in the full profile, 1 in ``--quick``); each figure is the
median, with its ``*_range_s`` [min, max]; ``speedup_vs_restart`` is a ratio of the two medians.

Death to the end of iteration ``F`` includes the survivors' own remaining micro-batches, which they
compute with or without a failure: with ``P`` of ``k`` done, even a free redistribution takes about
``(k - P) / k`` of an iteration, which bounds ``speedup_vs_restart``. So each run also gives the
failed iteration's *delay*: (end of ``F`` - end of ``F - 1``) - the median duration of the same job's
iterations before ``F`` (for the restart, of its first launch, which saves a checkpoint every
iteration), all from the ranks' own stamps; ``delay_ratio_vs_restart`` is the ratio of the medians.
(Before 2026-11-28 the restart ran once, relaunched by a cold ``exec`` of python, 14-18 s of
importing torch, and its single sample was divided by the redistribution's median.)

Also: the scheduler's cost against a plain training loop with no failures, and the cost of
deterministic mode (``unicron.runtime.perf``: the three alternate in the same processes); exactness
after the failure against the failure-free run (float64 default mode, bit-identity in deterministic
mode, float32).

    .venv/bin/python bench/redistribute.py [--quick]

The last line is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from transition import LINE  # type: ignore[import-not-found,unused-ignore]

from agent.prefork import Prefork
from unicron.cluster.launch import LocalJob, warm_spawner
from unicron.runtime.compare import bitwise_equal, load_params, max_rel_diff, per_tensor

PROFILES: dict[str, dict[str, Any]] = {
    # B = 16 micro-batches of 4 sequences: k = 4 per rank at DP = 4. Full: 1800 measured rounds of the
    # overhead comparison (~20 min), because the 90 % interval of a paired median on this shared
    # 2-core machine is about +-0.7 % at 600 rounds: too wide to decide a 1 % target.
    # Whole run: about 22 minutes.
    "quick": {"model": ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--vocab", "128"],
              "iterations": 4, "fail_it": 2, "fail_pos": 2, "rounds": 9, "det_rounds": 5, "per_round": 1,
              "reps": 1},
    "full": {"model": ["--layers", "4", "--hidden", "96", "--heads", "4", "--seq", "64", "--vocab", "256"],
             "iterations": 6, "fail_it": 3, "fail_pos": 2, "rounds": 1801, "det_rounds": 101, "per_round": 1,
             "reps": 5},
}
BATCH = ["--global-batch-size", "64", "--micro-batch-size", "4"]
COMM = ["--collective-timeout", "30", "--regroup-timeout", "60", "--heartbeat-window", "5"]
WORLD = 4
DEAD = 3
SURVIVORS = [r for r in range(WORLD) if r != DEAD]


class Bench:
    def __init__(self, profile: dict[str, Any], root: str, spawner: Prefork) -> None:
        self.p = profile
        self.root = root
        self.spawner = spawner
        self.n = 0

    def args(self, dtype: str, *extra: str) -> list[str]:
        return [*self.p["model"], *BATCH, *COMM, "--iterations", str(self.p["iterations"]), "--dtype", dtype, *extra]

    def job(self, args: list[str], faults: dict[int, str] | None = None, **kw: Any) -> LocalJob:
        self.n += 1
        env = {r: {"UNICRON_RUNTIME_FAULTS": f} for r, f in (faults or {}).items()}
        return LocalJob(WORLD, args, os.path.join(self.root, f"job{self.n}"), rank_env=env, **kw)

    def run(self, args: list[str], faults: dict[int, str] | None = None, **kw: Any) -> LocalJob:
        job = self.job(args, faults, spawner=kw.pop("spawner", self.spawner), **kw)
        with job:
            codes = job.wait(600)
        expect = {r: (-9 if faults and r in faults else 0) for r in range(WORLD)}
        if codes != expect:
            raise SystemExit(f"job {job.out_dir} exited {codes}, expected {expect}\n{job.logs()}")
        return job

    @property
    def fault(self) -> dict[int, str]:
        return {DEAD: f"die@{self.p['fail_it']}:mb{self.p['fail_pos']}"}

    def death_to_iteration_end(self, job: LocalJob, incarnation: int = 1) -> float:
        death = float(job.store_value(f"fault/{DEAD}/ts") or "nan")
        return _iteration_ends(job, incarnation)[self.p["fail_it"]] - death

    def delay(self, before: dict[int, float], after: dict[int, float]) -> float:
        """How much longer the failed iteration took than the job's own iterations before it: (end of
        iteration F - end of F-1) - the median of the earlier iterations' durations. ``before`` and
        ``after`` map iterations to their end (the survivors' latest stamp); the two differ for the
        restart, whose iteration F ends in the relaunched job."""
        f = self.p["fail_it"]
        usual = statistics.median(before[i] - before[i - 1] for i in range(1, f))
        return after[f] - before[f - 1] - usual

    # --- measurements ----------------------------------------------------------------------------

    def _perf_job(self, modes: str, rounds: int) -> tuple[dict[str, list[float]], ...]:
        """Run the perf worker alternating ``modes``; per kind, every rank's iterations: wall seconds,
        process CPU seconds, training-thread CPU seconds, and the loop's own seconds (wall minus forward/backward, collective waits, optimizer)."""
        args = [*self.args("float32"), "--rounds", str(rounds), "--per-round", str(self.p["per_round"]),
                "--modes", modes]
        self.n += 1
        job = LocalJob(WORLD, args, os.path.join(self.root, f"job{self.n}"), module="unicron.runtime.perf",
                       spawner=self.spawner)
        with job:
            codes = job.wait(1800)
        if any(c != 0 for c in codes.values()):
            raise SystemExit(f"perf job failed {codes}\n{job.logs()}")
        wall: dict[str, list[float]] = {}
        cpu: dict[str, list[float]] = {}
        tcpu: dict[str, list[float]] = {}
        own: dict[str, list[float]] = {}
        for r in range(WORLD):
            with open(os.path.join(job.out_dir, "inc1", f"perf_rank{r}.json")) as fh:
                data = json.load(fh)
            for m in data["times"]:
                wall.setdefault(m, []).extend(data["times"][m])
                cpu.setdefault(m, []).extend(data["cpu"][m])
                tcpu.setdefault(m, []).extend(data["thread_cpu"][m])
                own.setdefault(m, []).extend(w - s for w, s in zip(data["times"][m], data["shared"][m], strict=True))
        return wall, cpu, tcpu, own

    def perf(self) -> dict[str, Any]:
        # Two jobs: the scheduler against the plain loop, with plain-b (the plain loop again) as an
        # A/A control of what the method reads between identical loops (its noise floor); then
        # deterministic mode against the default, whose larger cost needs fewer rounds.
        wall, cpu, tcpu, own = self._perf_job("plain,scheduler,plain-b", self.p["rounds"])
        dwall, dcpu, _, down = self._perf_job("scheduler,deterministic", self.p["det_rounds"])

        def paired(t: dict[str, list[float]], a: str, b: str) -> float:
            # the kinds alternate within a round: pair each iteration with the other kind's in that round
            return 100 * (statistics.median(x / y for x, y in zip(t[a], t[b], strict=True)) - 1)

        med = {m: statistics.median(v) for m, v in wall.items()}
        own_med = {m: statistics.median(v) for m, v in own.items()}
        down_med = {m: statistics.median(v) for m, v in down.items()}
        ratios = [x / y for x, y in zip(wall["scheduler"], wall["plain"], strict=True)]
        aa = [x / y for x, y in zip(wall["plain-b"], wall["plain"], strict=True)]
        return {
            "own_ms": {**{m: 1000 * v for m, v in own_med.items()}, "deterministic": 1000 * down_med["deterministic"]},
            "overhead_attributed_pct": 100 * (own_med["scheduler"] - own_med["plain"]) / med["plain"],
            "deterministic_attributed_pct": 100 * (down_med["deterministic"] - down_med["scheduler"]) / med["plain"],
            "overhead_ci90_pct": [100 * (q - 1) for q in _bootstrap_median_ci(ratios)],
            "aa_ci90_pct": [100 * (q - 1) for q in _bootstrap_median_ci(aa)],
            "iterations_per_mode": len(wall["plain"]) // WORLD,
            "det_iterations_per_mode": len(dwall["scheduler"]) // WORLD,
            "plain_s": med["plain"], "scheduler_s": med["scheduler"],
            "deterministic_s": statistics.median(dwall["deterministic"]),
            "overhead_pct": paired(wall, "scheduler", "plain"),
            "aa_control_pct": paired(wall, "plain-b", "plain"),
            "deterministic_overhead_pct": paired(dwall, "deterministic", "scheduler"),
            "overhead_cpu_pct": paired(cpu, "scheduler", "plain"),
            "overhead_thread_cpu_pct": paired(tcpu, "scheduler", "plain"),
            "aa_thread_cpu_pct": paired(tcpu, "plain-b", "plain"),
            "thread_cpu_ms": {m: 1000 * statistics.median(v) for m, v in tcpu.items()},
            "deterministic_overhead_cpu_pct": paired(dcpu, "deterministic", "scheduler"),
            "overhead_of_medians_pct": 100 * (med["scheduler"] / med["plain"] - 1),
        }

    def exactness_and_recovery(self) -> dict[str, Any]:
        ref = self.run(self.args("float64"))
        reds: list[LocalJob] = []
        reruns: list[LocalJob] = []
        restarts: list[tuple[float, int | None, float]] = []
        for _ in range(self.p["reps"]):  # alternate, so that load drifts hit all three alike
            reds.append(self.run(self.args("float64"), self.fault))
            reruns.append(self.run(self.args("float64", "--recovery", "rerun"), self.fault))
            restarts.append(self.restart_from_checkpoint())
        restart_s = [s for s, _, _ in restarts]
        restored = [it for _, it, _ in restarts]
        red = reds[0]
        det_ref = self.run(self.args("float32", "--deterministic"))
        det = self.run(self.args("float32", "--deterministic"), self.fault)
        ref_p, red_p = load_params(ref.params_path(0)), load_params(red.params_path(0))
        regroup = next(e["data"] for e in red.result(0)["events"]
                       if e["kind"] == "regroup" and e["data"]["reason"] == "failure")
        ends = [e["ts"] for e in ref.result(0)["events"] if e["kind"] == "iteration"]
        iteration_s = statistics.median(b - a for a, b in itertools.pairwise(ends))
        red_s = [self.death_to_iteration_end(j) for j in reds]
        rerun_s = [self.death_to_iteration_end(j) for j in reruns]
        red_delay = [self.delay(ends, ends) for ends in (_iteration_ends(j) for j in reds)]
        return {
            "redistribute_delay_s": statistics.median(red_delay),
            "restart_delay_s": statistics.median(d for _, _, d in restarts),
            "redistribute_delay_all": red_delay,
            "restart_delay_all": [d for _, _, d in restarts],
            "redistribute_s": statistics.median(red_s),
            "rerun_iteration_s": statistics.median(rerun_s),
            "restart_from_ckpt_s": statistics.median(restart_s),
            "redistribute_all": red_s,
            "rerun_all": rerun_s,
            "restart_all": restart_s,
            "restored_iterations": restored,
            "rerun_max_rel_diff_fp64": max(max_rel_diff(load_params(j.params_path(0)), ref_p) for j in reruns),
            "max_rel_diff_fp64": max(max_rel_diff(load_params(j.params_path(0)), ref_p) for j in reds),
            "max_rel_diff_fp64_worst_tensor": max(per_tensor(red_p, ref_p).items(), key=lambda kv: kv[1]),
            "bitwise_equal": bitwise_equal(load_params(det.params_path(0)), load_params(det_ref.params_path(0))),
            "regroup": regroup,
            "failure_free_iteration_s": iteration_s,
        }

    def restart_from_checkpoint(self) -> tuple[float, int | None, float]:
        """The conventional path: the whole job restarts (new processes) from a torch.save checkpoint;
        (seconds from the death to the end of the failed iteration, the iteration restored, the
        failed iteration's delay)."""
        ckpt = os.path.join(self.root, f"torch-save{self.n}")
        args = self.args("float64", "--ckpt", "torch-save", "--ckpt-dir", ckpt, "--ckpt-every", "1")
        # Survivors of the first launch are not told of the death (no mark_failed, long heartbeat
        # window): they cannot recover by themselves and are killed with the job, as a plain job is.
        # (--log-iterations: the killed ranks write no results; their iteration ends are read from their logs)
        first = self.job([*args, "--heartbeat-window", "600", "--log-iterations"], self.fault, spawner=self.spawner,
                         mark_failures=False)
        with first:
            while first.procs[DEAD].proc.poll() is None:
                time.sleep(0.002)
        death = float(first.store_value(f"fault/{DEAD}/ts") or "nan")
        # Relaunch every rank as new processes forked from the warm spawner, as the agent does (its
        # ranks come from the node's spawner): the same start as the runs it is compared with.
        second = self.job([*args, "--resume"], spawner=self.spawner)
        with second:
            codes = second.wait(600)
        if any(c != 0 for c in codes.values()):
            raise SystemExit(f"restarted job failed {codes}\n{second.logs()}")
        ends = _iteration_ends(second, ranks=range(WORLD))
        restored = [e["data"]["it"] for e in second.result(0)["events"] if e["kind"] == "restored"]
        delay = self.delay(_logged_iteration_ends(first), ends)
        return ends[self.p["fail_it"]] - death, restored[0] if restored else None, delay


def _latest(stamps: Iterable[tuple[int, float]]) -> dict[int, float]:
    """Iteration -> the latest of its (iteration, stamp) pairs: when the last rank completed it."""
    ends: dict[int, float] = {}
    for it, ts in stamps:
        ends[it] = max(ends.get(it, 0.0), ts)
    return ends


def _iteration_ends(job: LocalJob, incarnation: int = 1, ranks: Iterable[int] = SURVIVORS) -> dict[int, float]:
    """Iteration -> when the last of ``ranks`` completed it, from the ranks' own iteration events."""
    return _latest((e["data"]["it"], e["ts"]) for r in ranks for e in job.result(r, incarnation)["events"]
                   if e["kind"] == "iteration")


def _logged_iteration_ends(job: LocalJob) -> dict[int, float]:
    """The same for the survivors, from their ``--log-iterations`` lines (``iteration N done TS ...``),
    for ranks that were killed before writing their results."""
    def stamps(r: int) -> Iterator[tuple[int, float]]:
        with open(os.path.join(job.out_dir, f"rank{r}.1.log"), errors="replace") as fh:
            for line in fh:
                if m := LINE.match(line):
                    yield int(m[1]), float(m[2])

    return _latest(st for r in SURVIVORS for st in stamps(r))


def _range(xs: list[float]) -> list[float]:
    """[min, max] of the repetitions, for the JSON line."""
    return [round(min(xs), 4), round(max(xs), 4)]


def _bootstrap_median_ci(values: list[float], n: int = 2000) -> tuple[float, float]:
    """90 % interval of the median of ``values`` (every rank's ratios, rank by rank), resampling
    whole rounds: the ranks of one iteration wait for each other, so their ratios are not independent."""
    per_round = len(values) // WORLD
    rounds = [values[i::per_round] for i in range(per_round)]  # the WORLD ranks' ratios of one round
    rng = random.Random(0)
    meds = sorted(
        statistics.median(v for rnd in rng.choices(rounds, k=per_round) for v in rnd) for _ in range(n)
    )
    return meds[n // 20], meds[n - n // 20 - 1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model, fewer rounds (< 1 minute)")
    args = parser.parse_args()
    profile = PROFILES["quick" if args.quick else "full"]
    t0 = time.time()
    root = tempfile.mkdtemp(prefix="unicron-redistribute-")
    spawner = warm_spawner(("unicron.runtime.train", "unicron.runtime.perf"))
    try:
        bench = Bench(profile, root, spawner)
        perf = bench.perf()
        rec = bench.exactness_and_recovery()
    finally:
        spawner.close()
    k = 16 // WORLD
    print(f"profile: {'quick' if args.quick else 'full'}  model: {' '.join(profile['model'])}")
    print(f"global batch: B=16 micro-batches of 4 sequences, DP={WORLD}, k={k}; rank {DEAD} killed in iteration "
          f"{profile['fail_it']} after {profile['fail_pos']} of its {k} micro-batches")
    print(f"failure-free iteration (float64, 4 ranks on this machine): {rec['failure_free_iteration_s']:.3f} s")
    print(f"from death to the end of the iteration (median of {len(rec['redistribute_all'])} runs each, alternating):")
    print(f"  redistribute (Unicron):          {rec['redistribute_s']:.3f} s  "
          f"{[round(x, 3) for x in rec['redistribute_all']]}")
    print(f"  rerun the iteration on survivors: {rec['rerun_iteration_s']:.3f} s  "
          f"{[round(x, 3) for x in rec['rerun_all']]}")
    print(f"  restart all ranks from torch.save checkpoint (warm spawner): {rec['restart_from_ckpt_s']:.3f} s  "
          f"{[round(x, 3) for x in rec['restart_all']]} (restored iterations {rec['restored_iterations']})")
    print(f"  the failed iteration's delay (its duration minus the job's usual one): redistribute "
          f"{rec['redistribute_delay_s']:.3f} s {[round(x, 3) for x in rec['redistribute_delay_all']]}, restart "
          f"{rec['restart_delay_s']:.3f} s {[round(x, 3) for x in rec['restart_delay_all']]}")
    r = rec["regroup"]
    print(f"  regroup on rank 0: {r['seconds'] * 1000:.1f} ms (knowledge {r.get('knowledge_s', 0) * 1000:.1f} ms, "
          f"barrier {r.get('barrier_s', 0) * 1000:.1f} ms, build {r.get('build_s', 0) * 1000:.1f} ms, "
          f"agree {r.get('agree_s', 0) * 1000:.1f} ms); micro-batches taken over: {r.get('redo_mbs')}")
    print(f"exactness: float64 max rel diff {rec['max_rel_diff_fp64']:.3e} (worst single tensor "
          f"{rec['max_rel_diff_fp64_worst_tensor'][0]}: {rec['max_rel_diff_fp64_worst_tensor'][1]:.3e}); "
          f"rerun {rec['rerun_max_rel_diff_fp64']:.3e}; deterministic float32 bitwise equal: {rec['bitwise_equal']}")
    print(f"per iteration, float32, no failure ({perf['iterations_per_mode']} iterations of each kind, "
          f"{perf['det_iterations_per_mode']} for deterministic mode; medians): plain {perf['plain_s'] * 1000:.1f} ms, "
          f"scheduler {perf['scheduler_s'] * 1000:.1f} ms, deterministic {perf['deterministic_s'] * 1000:.1f} ms")
    lo, hi = perf["overhead_ci90_pct"]
    print(f"  scheduler overhead (median of paired ratios, all ranks): wall {perf['overhead_pct']:+.2f} % "
          f"(90 % bootstrap interval {lo:+.2f} .. {hi:+.2f} %), CPU {perf['overhead_cpu_pct']:+.2f} %; "
          f"ratio of medians {perf['overhead_of_medians_pct']:+.2f} %")
    own = perf["own_ms"]
    tc = perf["thread_cpu_ms"]
    print(f"  training thread's CPU per iteration (medians): plain {tc['plain']:.2f} ms, scheduler "
          f"{tc['scheduler']:.2f} ms: {perf['overhead_thread_cpu_pct']:+.2f} % (A/A {perf['aa_thread_cpu_pct']:+.2f} %)")
    alo, ahi = perf["aa_ci90_pct"]
    print(f"  A/A control (the plain loop against itself, same method): {perf['aa_control_pct']:+.2f} % "
          f"(90 % bootstrap interval {alo:+.2f} .. {ahi:+.2f} %)")
    print(f"  loop's own time per iteration (wall minus forward/backward, collective waits, optimizer; medians): "
          f"plain {own['plain']:.2f} ms, scheduler {own['scheduler']:.2f} ms, deterministic "
          f"{own['deterministic']:.2f} ms -> attributed overhead {perf['overhead_attributed_pct']:+.2f} %, "
          f"deterministic {perf['deterministic_attributed_pct']:+.2f} % of a plain iteration")
    print(f"  deterministic mode vs default: wall {perf['deterministic_overhead_pct']:+.2f} %, "
          f"CPU {perf['deterministic_overhead_cpu_pct']:+.2f} %")
    print(f"wall time {time.time() - t0:.1f} s")
    out = {
        "redistribute_s": round(rec["redistribute_s"], 4),
        "rerun_iteration_s": round(rec["rerun_iteration_s"], 4),
        "restart_from_ckpt_s": round(rec["restart_from_ckpt_s"], 4),
        "reps": profile["reps"],
        "redistribute_range_s": _range(rec["redistribute_all"]),
        "rerun_iteration_range_s": _range(rec["rerun_all"]),
        "restart_from_ckpt_range_s": _range(rec["restart_all"]),
        "speedup_vs_restart": round(rec["restart_from_ckpt_s"] / rec["redistribute_s"], 2),
        "redistribute_delay_s": round(rec["redistribute_delay_s"], 4),
        "restart_delay_s": round(rec["restart_delay_s"], 4),
        "redistribute_delay_range_s": _range(rec["redistribute_delay_all"]),
        "restart_delay_range_s": _range(rec["restart_delay_all"]),
        "delay_ratio_vs_restart": round(rec["restart_delay_s"] / rec["redistribute_delay_s"], 2),
        "speedup_vs_rerun": round(rec["rerun_iteration_s"] / rec["redistribute_s"], 2),
        "overhead_pct": round(perf["overhead_pct"], 3),
        "overhead_ci90_pct": [round(x, 3) for x in perf["overhead_ci90_pct"]],
        "overhead_cpu_pct": round(perf["overhead_cpu_pct"], 3),
        "overhead_thread_cpu_pct": round(perf["overhead_thread_cpu_pct"], 3),
        "overhead_attributed_pct": round(perf["overhead_attributed_pct"], 3),
        "aa_control_pct": round(perf["aa_control_pct"], 3),
        "deterministic_overhead_pct": round(perf["deterministic_overhead_pct"], 3),
        "max_rel_diff_fp64": rec["max_rel_diff_fp64"],
        "bitwise_equal": rec["bitwise_equal"],
        "regroup_s": round(r["seconds"], 4),
        "failure_free_iteration_s": round(rec["failure_free_iteration_s"], 4),
        "profile": "quick" if args.quick else "full",
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
