"""How close agents' heartbeat intervals come to the coordinator's heartbeat timeout while a task's
ranks start and train on a loaded node: the margin behind "no false node loss".

Why: a fresh-clone test run lost a healthy node to the coordinator's 1 s heartbeat timeout
(``UNICRON_HEARTBEAT_TIMEOUT``) while six ranks and three warm spawners imported Megatron on the 2-core
machine. This measures how often, and how far, heartbeats come late under that kind of load.

Each repetition is one cluster as production runs it: real etcd, the coordinator, four agents with two
simulated GPUs each (default settings: a heartbeat every 0.1 s, the warm spawner on), and one
``unicron.runtime.train`` task of 8 real gloo ranks (TP=2 x DP=4, Megatron-core) started by the
agents, each agent's spawner importing Megatron meanwhile: 8 ranks and 4 spawners on 2 cores.
``--busy`` CPU-bound processes (default 2) run beside it, standing in for data-loader workers and
everything else on a loaded node. Measured where it happens: every interval between two heartbeats
an agent sent (its ``unicron_agent_heartbeat_interval_seconds`` histogram), from the cluster's start
until every rank is past step 5 and 5 s more; and node losses at the coordinator.

    .venv/bin/python bench/heartbeat_margin.py [--quick] [--busy N]

The figure can fail: ``largest_bucket_s`` (the upper bound of the largest histogram bucket any
interval reached) at or above the timeout, or any node loss. Buckets, not exact maxima: 1.0 means an
interval in (0.5, 1.0] s. ``sched_autogroup`` is the kernel's setting during the run, which changed
the tail here (``scripts/test.sh`` turns it off). The last line is one JSON object.
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

from coordinator.settings import CoordinatorSettings
from unicron.cli.main import main as cli
from unicron.cluster.localcluster import LocalCluster

AGENTS, GPUS, TP = 4, 2, 2
STEPS = 5
TAIL_S = 5.0
OVER_S = (0.2, 0.3, 0.5, 1.0)
ARGS = ["--iter-sleep", "0.1", "--layers", "2", "--hidden", "32", "--heads", "4", "--seq", "16", "--vocab", "64",
        "--dtype", "float64", "--global-batch-size", "32", "--micro-batch-size", "4"]
METRIC = "unicron_agent_heartbeat_interval_seconds"


def histogram(url: str) -> dict[float, float]:
    """The agent's heartbeat-interval histogram: upper bound -> cumulative count."""
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return {float(s.labels["le"]): s.value for family in text_string_to_metric_families(text)
            if family.name == METRIC for s in family.samples if s.name == f"{METRIC}_bucket"}


def one_run(rep: int, workdir: Path) -> tuple[list[dict[float, float]], int]:
    """One cluster: each agent's histogram, and the node losses the coordinator logged."""
    with LocalCluster(agents=AGENTS, gpus_per_agent=GPUS, extra_env={"UNICRON_STATUS_INTERVAL": "0.2"},
                      metrics=True) as c:
        os.environ["UNICRON_ETCD"] = c.etcd.endpoint
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
        hists = [histogram(c.metrics_url(node)) for node in c.node_names()]
        losses = sum(1 for r in c.coordinator_log() if r.get("event") == "node lost")
        os.environ.pop("UNICRON_ETCD", None)
    print(f"rep {rep}: {[summary([h]) for h in hists]}, node losses {losses}", file=sys.stderr, flush=True)
    return hists, losses


def largest_bucket(hists: list[dict[float, float]]) -> float:
    """The upper bound of the largest bucket any of ``hists`` reached."""
    return max(next(b for b in sorted(h) if h[b] == h[float("inf")]) for h in hists)


def summary(hists: list[dict[float, float]]) -> dict[str, object]:
    total = sum(h[float("inf")] for h in hists)
    return {"intervals": int(total), **{f"over_{s}_s": int(sum(h[float("inf")] - h[s] for h in hists))
                                        for s in OVER_S}, "largest_bucket_s": largest_bucket(hists)}


def sched_autogroup() -> int | None:
    """kernel.sched_autogroup_enabled (None where the kernel has no autogroup): with it on, the agents'
    threads waited up to 0.7 s for a CPU here, with it off at most 32 ms (bench/RESULTS.md)."""
    try:
        return int(Path("/proc/sys/kernel/sched_autogroup_enabled").read_text())
    except (OSError, ValueError):
        return None


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
    timeout_s = CoordinatorSettings().heartbeat_timeout_s
    per_rep = [largest_bucket(h) for h, _ in runs]
    whole = summary([h for hists, _ in runs for h in hists])
    result = {
        "bench": "heartbeat_margin", "reps": reps, "busy": args.busy, "heartbeat_timeout_s": timeout_s,
        "sched_autogroup": sched_autogroup(), **whole,
        "largest_bucket_per_rep_s": per_rep,
        "largest_bucket_p50_s": statistics.median(per_rep),
        "node_losses": sum(n for _, n in runs),
        "wall_s": round(time.monotonic() - t0, 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
