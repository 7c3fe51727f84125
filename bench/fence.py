"""How long a partitioned node's ranks outlive their relaunch elsewhere, with the fence and without.

A namespace cluster (3 agents x 2 GPUs, 1 etcd, 1 coordinator, the production settings but the
fence) runs one task of 2 ranks (the chaos bench's torch-free stepper, through the agent socket). Each
repetition cuts the node that runs it off the network for ``--partition-s``, and reads every process
on the machine from /proc (environment ``UNICRON_TASK``, ``RANK``) every 0.1 s: the **overlap** runs
from the first scan that finds two live processes holding one rank identity (the old ones on the
cut-off node, the relaunched ones elsewhere) until the last of the old processes is gone (by PID: a
first version stopped at the first scan with one process per identity, and a relaunched rank's brief
absence ended one baseline repetition at 1.9 s while the old ranks still ran). Then the node is healed and
undrained, and the next repetition cuts whichever node runs the task now.

Target (``target_met``): in every fenced repetition the old processes are gone within the fence's
design bound after the cut (the link's 2 s TCP_USER_TIMEOUT + ``fence_s`` + 1 s for the checks, the
kill and the scan), and in every baseline repetition they are still there past it. It fails if the
fence acts late or not at all, or if the partition is too short to tell the two apart.

Baseline: the same cluster with ``UNICRON_FENCE=0`` (no fence), the same repetitions, in the same run.
Without the fence the overlap lasts until the partition heals, so it measures ``--partition-s``;
with it, the fence's delay after the relaunch. Both are read from /proc, not from the daemons' logs.

    flock /tmp/unicron-heavy.lock .venv/bin/python bench/fence.py [--quick] [--reps N] [--partition-s S]

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import redirect_stdout
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import chaos  # type: ignore[import-not-found,unused-ignore]  # bench/chaos.py: the stepper, /proc reader

from agent.link import UNACKED_TIMEOUT_S
from unicron.cli.main import main as cli
from unicron.cluster.localcluster import LocalCluster
from unicron.cluster.netns import unavailable_reason


def _overlap(c: LocalCluster, node: str, partition_s: float) -> tuple[float, float]:
    """Cut ``node`` off for ``partition_s``. Returns (overlap, gone): seconds from the first scan that
    found two processes holding one rank identity until the last of the partitioned node's old
    processes is gone, and seconds from the cut until then (both up to the heal if they outlive it)."""
    old = {pid for pids in chaos.rank_processes().values() for pid in pids}
    first: float | None = None
    t0 = time.monotonic()
    c.partition(node)
    try:
        while time.monotonic() - t0 < partition_s:
            now = time.monotonic()
            live = chaos.rank_processes()
            if first is None and any(len(p) > 1 for p in live.values()):
                first = now
            if first is not None and not old & {pid for pids in live.values() for pid in pids}:
                return now - first, now - t0
            time.sleep(0.1)
    finally:
        c.heal(node)
    now = time.monotonic()  # the old ones outlived the partition
    return (now - first if first is not None else 0.0), now - t0


def _rep(c: LocalCluster, partition_s: float) -> tuple[float, float]:
    c.wait_for(lambda: len(c.running_ranks("alpha")) == 2, 90.0, "alpha running on 2 ranks", poll_s=0.2)
    node = str(c.running_ranks("alpha")[0]["node"])
    overlap = _overlap(c, node, partition_s)
    c.wait_registered(node)
    c.wait_for(lambda: c.node_state(node) == "isolated", 30.0, f"{node} isolated")
    c.wait_for(lambda: not any(len(p) > 1 for p in chaos.rank_processes().values()), 30.0, "one process per rank")
    with redirect_stdout(io.StringIO()):
        assert cli(["undrain", node]) == 0
    return overlap


def measure(fence_s: float, reps: int, partition_s: float) -> list[tuple[float, float]]:
    work = Path(tempfile.mkdtemp(prefix="unicron-fence-"))
    steps = work / "steps"
    steps.mkdir()
    c = LocalCluster(agents=3, gpus_per_agent=2, netns=True,
                     extra_env={"UNICRON_FENCE": str(fence_s), "UNICRON_WARMUP_ITERATIONS": "3", "UNICRON_PREFORK": ""})
    with c:
        os.environ["UNICRON_ETCD"] = c.etcd.endpoint
        spec = work / "alpha.json"
        spec.write_text(json.dumps({"name": "alpha", "command": [sys.executable, "-c", chaos.STEPPER, str(steps)],
                                    "min_gpus": 2, "max_gpus": 2}))
        with redirect_stdout(io.StringIO()):
            assert cli(["submit", str(spec)]) == 0
        out = []
        for i in range(reps):
            overlap, gone = _rep(c, partition_s)
            out.append((round(overlap, 2), round(gone, 2)))
            print(f"fence_s={fence_s:g} rep {i + 1}/{reps}: overlap {overlap:.2f} s, old ranks gone {gone:.2f} s "
                  "after the cut", file=sys.stderr, flush=True)
        return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1 repetition each and a 10 s partition")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--partition-s", type=float, default=15.0)
    p.add_argument("--fence-s", type=float, default=4.0, help="the fence under test (the agent's default)")
    args = p.parse_args()
    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(f"fence: the namespace cluster is unavailable: {reason}")
    reps, partition_s = (1, 10.0) if args.quick else (args.reps, args.partition_s)
    t0 = time.monotonic()
    fenced = measure(args.fence_s, reps, partition_s)
    unfenced = measure(0.0, reps, partition_s)
    # The fence's design bound, from the cut: the link breaks UNACKED_TIMEOUT_S after it, the fence
    # acts fence_s later, on its second on-time check; 1 s covers the checks, the kill and the scan.
    bound_s = UNACKED_TIMEOUT_S + args.fence_s + 1.0
    result = {
        "bench": "fence", "quick": args.quick, "reps": reps, "partition_s": partition_s, "fence_s": args.fence_s,
        "overlap_fenced_s": [o for o, _ in fenced], "overlap_unfenced_s": [o for o, _ in unfenced],
        "overlap_fenced_p50_s": statistics.median(o for o, _ in fenced),
        "overlap_unfenced_p50_s": statistics.median(o for o, _ in unfenced),
        "gone_after_cut_fenced_s": [g for _, g in fenced], "gone_after_cut_unfenced_s": [g for _, g in unfenced],
        "bound_s": bound_s,
        # every fenced node's old ranks gone within the bound, every baseline's still there past it (the
        # partition was long enough to tell the two apart)
        "target_met": max(g for _, g in fenced) < bound_s < min(g for _, g in unfenced),
        "wall_s": round(time.monotonic() - t0, 1),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
