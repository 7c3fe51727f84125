"""How late agents' heartbeats get while their ranks start and train, with the agent above its ranks'
CPU priority (the default, ``UNICRON_AGENT_NICE=-10``, ranks at 0) against agents at the ranks'
priority (``UNICRON_AGENT_NICE=0``), in the same runs.

Why: a fresh-clone test run lost a healthy node to the coordinator's 1 s heartbeat timeout while six
ranks imported Megatron on the 2-core machine; instrumented runs of that test beside two busy loops
then showed the agent's heartbeat thread waiting up to 0.37 s in the CPU run queue
(``unicron/kernel/priority.py``).

Each repetition is one cluster as production runs it: real etcd, the coordinator, four agents with two
simulated GPUs each, and one ``unicron.runtime.train`` task of 8 real gloo ranks (TP=2 x DP=4,
Megatron-core) started by the agents, each agent's warm spawner importing Megatron meanwhile (the
default; the ranks are exec'd until it is ready): on this machine 8 ranks and 4 spawners on 2 cores,
the load under which the node was lost. Two agents run at
nice 0 (the baseline), two at the default; which two alternates between repetitions, so hosting the
task's store (rank 0) is not always one side's. Measured where it happens: every interval between two
heartbeats an agent sent (its ``unicron_agent_heartbeat_interval_seconds`` histogram, 0.1 s nominal),
from the cluster's start until every rank is past step 5 and 5 s more. Counted: intervals over 0.2 s
(2x nominal) and over 0.3 s, the largest bucket reached; node losses at the coordinator. And the
cause itself, read from the kernel at the end of each run: every agent thread's time spent runnable
but not running (``/proc/<pid>/task/<tid>/schedstat``), per time slice it ran (the mean wait for a
CPU each time it woke; threads that ended before the reading are not in it). ``--busy`` CPU-bound
processes (default 2, at the ranks' priority) run beside the cluster, standing in for data-loader
workers and everything else on a loaded node: without them this machine showed a late interval only
now and then, too few to compare.

    .venv/bin/python bench/agent_priority.py [--quick] [--busy N]

The figure can fail: ``runq_ratio`` (the baseline agents' mean run-queue wait per slice over the
prioritised ones', medians over the repetitions) near 1 means the priority did not reach the
scheduler; ``late_ratio`` (intervals over 0.2 s, summed) near or below 1 means it did not shorten
heartbeat gaps. Both sides share each run's load; the baseline's
agents also compete with the prioritised ones (a few % CPU), a small bias against the baseline.
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from prometheus_client.parser import text_string_to_metric_families

from unicron.cli.main import main as cli
from unicron.cluster.localcluster import LocalCluster

AGENTS, GPUS, TP = 4, 2, 2
LATE_S = 0.2  # 2x nominal
VERY_LATE_S = 0.3
STEPS = 5
TAIL_S = 5.0
ARGS = ["--iter-sleep", "0.1", "--layers", "2", "--hidden", "32", "--heads", "4", "--seq", "16", "--vocab", "64",
        "--dtype", "float64", "--global-batch-size", "32", "--micro-batch-size", "4"]
METRIC = "unicron_agent_heartbeat_interval_seconds"


def intervals(url: str) -> dict[float, float]:
    """The agent's heartbeat-interval histogram: upper bound -> cumulative count."""
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    out: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == METRIC:
            for s in family.samples:
                if s.name == f"{METRIC}_bucket":
                    out[float(s.labels["le"])] = s.value
    return out


def sample(hist: dict[float, float], pid: int) -> Sample:
    total = hist[float("inf")]
    largest = next(b for b in sorted(hist) if hist[b] == total)
    return int(total), int(total - hist[LATE_S]), int(total - hist[VERY_LATE_S]), largest, runq_per_slice(pid)


#: one agent: intervals, over LATE_S, over VERY_LATE_S, largest bucket reached, run-queue wait (s) per slice
Sample = tuple[int, int, int, float, float]


def runq_per_slice(pid: int) -> float:
    """Seconds the process's live threads waited for a CPU, per time slice they ran (schedstat)."""
    wait_ns = slices = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            _, wait, runs = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
        except (OSError, ValueError):
            continue  # the thread ended
        wait_ns, slices = wait_ns + int(wait), slices + int(runs)
    return wait_ns / 1e9 / max(1, slices)


def one_run(rep: int, workdir: Path) -> tuple[list[Sample], list[Sample], int]:
    """One cluster: the baseline agents' samples, the prioritised agents' samples, node losses."""
    baseline = {f"node{i}" for i in range(AGENTS) if i % 2 == rep % 2}
    env = {"UNICRON_STATUS_INTERVAL": "0.2"}
    node_env = {n: {"UNICRON_AGENT_NICE": "0"} for n in baseline}
    out: dict[str, list[Sample]] = {"baseline": [], "priority": []}
    with LocalCluster(agents=AGENTS, gpus_per_agent=GPUS, extra_env=env, metrics=True, node_env=node_env) as c:
        os.environ["UNICRON_ETCD"] = c.etcd.endpoint
        for node, proc in c.agents.items():  # the two sides really run as said
            want = 0 if node in baseline or os.geteuid() != 0 else -10
            assert os.getpriority(os.PRIO_PROCESS, proc.pid) == want, (node, want)
        spec = workdir / f"job{rep}.json"
        command = [sys.executable, "-m", "unicron.runtime.train", "--iterations", "0", "--tp", str(TP), *ARGS,
                   "--out-dir", str(workdir / f"out{rep}")]
        spec.write_text(json.dumps({"name": "job", "command": command, "min_gpus": TP, "tp_size": TP}))
        assert cli(["submit", str(spec)]) == 0

        def stepping() -> bool:
            now = c.running_ranks("job")
            return len(now) == AGENTS * GPUS and all(int(r.get("step") or 0) > STEPS for r in now.values())

        c.wait_for(stepping, 300.0, f"{AGENTS * GPUS} ranks past step {STEPS}", poll_s=0.2)
        time.sleep(TAIL_S)
        for node in c.node_names():
            got = sample(intervals(c.metrics_url(node)), c.agents[node].pid)
            out["baseline" if node in baseline else "priority"].append(got)
        losses = sum(1 for r in c.coordinator_log() if r.get("event") == "node lost")
        store = next(r["node"] for r in c.running_ranks("job").values() if int(r["rank"]) == 0)
        print(f"rep {rep}: baseline {sorted(baseline)} {out['baseline']}, priority {out['priority']}, "
              f"store on {store}, node losses {losses}", file=sys.stderr, flush=True)
        os.environ.pop("UNICRON_ETCD", None)
    return out["baseline"], out["priority"], losses


def side(samples: list[list[Sample]]) -> dict[str, object]:
    """Per repetition: the side's intervals over LATE_S, as a fraction of its intervals; overall."""
    fractions = [sum(a[1] for a in rep) / max(1, sum(a[0] for a in rep)) for rep in samples]
    runq = [statistics.mean(a[4] for a in rep) * 1e3 for rep in samples]
    return {
        "runq_ms_per_slice_p50": round(statistics.median(runq), 3),
        "runq_ms_per_slice_range": [round(min(runq), 3), round(max(runq), 3)],
        "late_fraction_p50": round(statistics.median(fractions), 5),
        "late_fraction_range": [round(min(fractions), 5), round(max(fractions), 5)],
        "late_intervals": sum(a[1] for rep in samples for a in rep),
        "very_late_intervals": sum(a[2] for rep in samples for a in rep),
        "intervals": sum(a[0] for rep in samples for a in rep),
        "largest_bucket_s": max(a[3] for rep in samples for a in rep),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one repetition (full: five)")
    ap.add_argument("--busy", type=int, default=2, help="CPU-bound processes running beside the cluster")
    args = ap.parse_args()
    reps = 1 if args.quick else 5
    t0 = time.monotonic()
    runs = []
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for rep in range(reps):
                runs.append(one_run(rep, Path(tmp)))
    finally:
        for p in busy:
            p.kill()
            p.wait()
    runq_b = statistics.median(statistics.mean(a[4] for a in r[0]) for r in runs)
    runq_p = statistics.median(statistics.mean(a[4] for a in r[1]) for r in runs)
    late_b = sum(a[1] for r in runs for a in r[0])
    late_p = sum(a[1] for r in runs for a in r[1])
    result = {
        "bench": "agent_priority", "reps": reps, "busy": args.busy, "late_s": LATE_S, "very_late_s": VERY_LATE_S,
        "baseline_nice0": side([r[0] for r in runs]),
        "priority_nice-10": side([r[1] for r in runs]),
        "runq_ratio": round(runq_b / runq_p, 2) if runq_p else None,
        "late_ratio": round(late_b / late_p, 2) if late_p else None,
        "node_losses": sum(r[2] for r in runs),
        "wall_s": round(time.monotonic() - t0, 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
