"""Control-plane scale on hollow nodes (issue 16 item 4): node-loss detection, false node losses, the
coordinator's CPU and the write of a reconfiguration spanning every node, at 1,000+ nodes.

One real etcd and the real coordinator daemon (``LocalCluster(agents=0)``); the nodes are hollow agents
(``unicron/cluster/hollow.py``: the real agent's registration, lease, status and result records, link
hello and heartbeats, with simulated GPUs and ranks), split over ``--fleet-procs`` processes (one
process's GIL could not keep 1,000 nodes' leases on time).

1. every node registers and the coordinator counts it up;
2. a task asking for every GPU of the cluster is submitted: its Assign spans every node
   (``reconfigure_write_s``: the write of that decision, from the coordinator's "decision written"
   log line, its own clock around the fenced write);
3. soak: the cluster runs with nothing injected for ``--soak-s``; ``false_node_losses`` counts the
   node-loss incidents the coordinator raised meanwhile (target 0), ``coordinator_cpu_pct`` is the
   coordinator process's CPU time (``/proc/<pid>/stat``) over the soak's wall time (target <= 50);
   a false loss is the coordinator's only if the fleet fed the node in time: one where the fleet itself
   sent the node no heartbeat for the whole timeout (its shared heartbeat thread starved: the harness,
   not the agent) counts in ``false_node_losses_fleet_late`` instead (``hollow.fleet_silent``), and
   ``fleet_late_sends`` / ``fleet_send_gap_max_s`` say how late the fleet's heartbeats ran (gaps over
   0.5 s between two sends to a node; 0.0: none);
4. ``--kills`` nodes die one at a time (their link closes, their lease is no longer refreshed) and as
   many hang (heartbeats stop, the link stays open): the clock starts at the kill, here, and stops
   at the coordinator's "incident" log line for that node (stamped after the decision's fenced write
   landed); each loss also makes the coordinator reconfigure the task across the remaining nodes.
   A fault with no incident within 30 s is a miss: it counts as inf in ``*_p50_s``, ``*_p99_s`` and
   ``*_max_s`` (null in the JSON, so a target on them fails) and in ``*_missed``; ``kills`` is how
   many faults of each mode were injected (``*_n`` the incidents found).

Run the full size under the shared lock: ``flock /tmp/unicron-heavy.lock .venv/bin/python bench/scale.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# the repository first: bench/ckpt.py would shadow the ckpt package
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from coordinator.settings import CoordinatorSettings
from coordinator.statestore import read_state
from unicron.cli.main import main as cli
from unicron.cluster.etcd_server import EtcdServer
from unicron.cluster.hollow import FleetProcesses, SendGap, fleet_silent
from unicron.cluster.localcluster import LocalCluster
from unicron.kernel.config import from_args
from unicron.kernel.errors import StoreUnavailable

SLEEPER = [sys.executable, "-c", "import time; time.sleep(3600)"]
TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int | str) -> float:
    """User + system CPU seconds of a process (``/proc/<pid>/stat`` utime + stime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def loss_figures(key: str, lat: list[float]) -> dict[str, Any]:
    """The JSON figures of one mode's losses; a missed one is inf in ``lat``, so it is in the
    percentiles (null: no finite figure) rather than left out of them."""
    def seconds(x: float) -> float | None:
        return round(x, 3) if math.isfinite(x) else None

    out: dict[str, Any] = {f"{key}_n": sum(1 for x in lat if math.isfinite(x)),
                           f"{key}_missed": sum(1 for x in lat if math.isinf(x))}
    if lat:
        out |= {f"{key}_p50_s": seconds(statistics.median(lat)), f"{key}_p99_s": seconds(pct(lat, 0.99)),
                f"{key}_max_s": seconds(max(lat))}
    return out


class LogTail:
    """The coordinator's JSON log lines, read incrementally, each with its stamp as ``ts``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.lines: list[dict[str, Any]] = []

    def poll(self) -> list[dict[str, Any]]:
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        new = []
        for raw in data[:end].splitlines():
            try:
                rec = json.loads(raw)
            except ValueError:
                continue
            if isinstance(rec, dict) and "timestamp" in rec:
                rec["ts"] = datetime.datetime.fromisoformat(str(rec["timestamp"]).replace("Z", "+00:00")).timestamp()
                new.append(rec)
        self.lines.extend(new)
        return new

    def wait(self, pred: Any, timeout_s: float) -> dict[str, Any] | None:
        deadline = time.monotonic() + timeout_s
        found = next((r for r in self.lines if pred(r)), None)
        while found is None and time.monotonic() < deadline:
            time.sleep(0.05)
            found = next((r for r in self.poll() if pred(r)), None)
        return found


def false_losses(losses: list[dict[str, Any]], gaps: list[SendGap], timeout_s: float) -> tuple[int, list[dict[str, Any]]]:
    """``losses`` (node-loss incidents with nothing injected) split: how many are the coordinator's, and
    each one the fleet's own silence explains (``fleet_silent``: it sent the node nothing for the whole
    heartbeat timeout before the loss), with that gap. A closed connection is never the fleet's lateness."""
    blamed: list[dict[str, Any]] = []
    for r in losses:
        gap = (fleet_silent(gaps, str(r.get("node")), float(r.get("source_ts", r["ts"])), timeout_s)
               if "heartbeat timeout" in str(r.get("message", "")) else None)
        if gap is not None:
            blamed.append({"node": r.get("node"), "fleet_gap_s": round(gap, 3)})
    return len(losses) - len(blamed), blamed


def up_nodes(c: LocalCluster) -> int:
    assert c.store is not None
    try:
        state, _, _ = read_state(c.store, c.keys)
    except StoreUnavailable:
        return -1  # etcd busy (at 1,000 nodes the join's writes can hold it past the 2 s deadline)
    return sum(1 for e in state.nodes.values() if e.status.value == "up") if state is not None else 0


def task_phase(c: LocalCluster, task: str) -> str | None:
    assert c.store is not None
    try:
        state, _, _ = read_state(c.store, c.keys)
    except StoreUnavailable:
        return None
    entry = state.tasks.get(task) if state is not None else None
    return entry.phase.value if entry is not None else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="100 nodes, a 15 s soak, 3 kills + 3 hangs")
    ap.add_argument("--nodes", type=int, default=None, help="hollow nodes (default 1000; --quick 100)")
    ap.add_argument("--gpus", type=int, default=8, help="simulated GPUs per node")
    ap.add_argument("--soak-s", type=float, default=None, help="soak seconds (default 600; --quick 15)")
    ap.add_argument("--kills", type=int, default=None, help="nodes killed, and as many hung (default 10; --quick 3)")
    ap.add_argument("--seed", type=int, default=16)
    ap.add_argument("--fleet-procs", type=int, default=None,
                    help="processes the hollow nodes are split over (default one per 250 nodes)")
    args = ap.parse_args()
    n = args.nodes or (100 if args.quick else 1000)
    procs = args.fleet_procs or math.ceil(n / 250)
    if procs < 1 or n < procs:
        ap.error(f"--fleet-procs: between 1 and --nodes ({n}), got {procs}")
    soak_s = args.soak_s if args.soak_s is not None else (15.0 if args.quick else 600.0)
    kills = args.kills if args.kills is not None else (3 if args.quick else 10)
    rng = random.Random(args.seed)
    t_start = time.time()

    def progress(msg: str) -> None:
        print(f"[{time.time() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    # a SIGTERM (timeout(1)) unwinds through the finally below: etcd and the coordinator are stopped
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    c = LocalCluster(agents=0, gpus_per_agent=args.gpus)
    c.start()
    fleet: FleetProcesses | None = None
    out: dict[str, Any] = {"bench": "scale", "quick": args.quick, "nodes": n, "gpus_per_node": args.gpus,
                           "fleet_procs": procs}
    try:
        assert c.coordinator is not None
        pid = c.coordinator.pid
        tail = LogTail(Path(c.run_dir) / "coordinator.log")
        os.environ["UNICRON_ETCD"] = c.etcd.endpoint
        fleet = FleetProcesses(c.etcd.endpoint, n, args.gpus, procs, run_dir=c.run_dir).start()
        etcd_proc = c.etcd.proc if isinstance(c.etcd, EtcdServer) else None
        progress(f"{n} hollow nodes registered")
        c.wait_for(lambda: up_nodes(c) == n, 300.0, "the coordinator to count every node", poll_s=0.5)
        c.wait_for(lambda: fleet is not None and fleet.connected() == n, 120.0, "every link", poll_s=0.5)
        out["join_s"] = round(time.time() - t_start, 1)
        progress("every node up in the coordinator; submitting a task over every GPU")

        with tempfile.NamedTemporaryFile("w", suffix=".json") as spec:
            json.dump({"name": "wide", "command": SLEEPER, "min_gpus": 1, "recovery": "inprocess"}, spec)
            spec.flush()
            # the coordinator may still be digesting the join of every node: its API answers late
            assert cli(["submit", "--timeout", "120", spec.name]) == 0
        wrote = tail.wait(lambda r: r.get("event") == "decision written" and r.get("decision") == "TaskSubmitted",
                          120.0)
        refused = next((r for r in tail.lines if r.get("event") in ("input refused; dropped",
                                                                   "handler failed; input dropped")), None)
        out["reconfigure_write_s"] = wrote["write_s"] if wrote else None
        out["reconfigure_ops"] = wrote["ops"] if wrote else None
        if refused is not None:
            out["reconfigure_error"] = str(refused.get("error", refused.get("exception", "")))[:200]
        if refused is None:
            with contextlib.suppress(TimeoutError):
                c.wait_for(lambda: task_phase(c, "wide") == "running", 120.0, "the task to run", poll_s=0.5)
        out["task_phase"] = task_phase(c, "wide")
        progress(f"task placed: {out.get('reconfigure_write_s')} s write, phase {task_phase(c, 'wide')}")

        # --- soak: nothing injected ---------------------------------------------------------
        tail.poll()
        fleet_pids: list[int | str] = ["self", *fleet.pids()]
        etcd_pid = etcd_proc.pid if etcd_proc is not None else None

        def cpu_now() -> tuple[float, float, float]:
            return (cpu_s(pid), sum(cpu_s(p) for p in fleet_pids),
                    cpu_s(etcd_pid) if etcd_pid is not None else 0.0)
        load0, (cpu0, own0, etcd0), t0 = loadavg(), cpu_now(), time.time()
        time.sleep(soak_s)
        (cpu1, own1, etcd1), t1 = cpu_now(), time.time()
        tail.poll()
        losses = [r for r in tail.lines if r.get("event") == "incident" and r.get("kind") == "lost_connection"
                  and t0 <= r["ts"] <= t1]
        # before the soak (the join and the task's placement over every node): false too, said apart
        before = [r for r in tail.lines if r.get("event") == "incident" and r.get("kind") == "lost_connection"
                  and r["ts"] < t0]
        # the harness's own lateness is not the coordinator's: a loss the fleet's silence explains is apart
        gaps = fleet.late_sends()
        timeout_s = from_args(CoordinatorSettings).heartbeat_timeout_s
        out[f"false_node_losses_{int(soak_s)}s"], late_soak = false_losses(losses, gaps, timeout_s)
        out["false_node_losses_before_soak"], late_before = false_losses(before, gaps, timeout_s)
        out["false_node_losses_fleet_late"] = late_before + late_soak
        out["fleet_late_sends"] = len(gaps)
        out["fleet_send_gap_max_s"] = round(max((b - a for _, a, b in gaps), default=0.0), 3)
        out["coordinator_cpu_pct"] = round(100 * (cpu1 - cpu0) / (t1 - t0), 1)
        out["hollow_process_cpu_pct"] = round(100 * (own1 - own0) / (t1 - t0), 1)  # the fleet and the bench
        out["etcd_cpu_pct"] = round(100 * (etcd1 - etcd0) / (t1 - t0), 1)
        out["loadavg_1m"] = [load0, loadavg()]
        progress(f"soak {soak_s:.0f}s: {out[f'false_node_losses_{int(soak_s)}s']} false node losses "
                 f"({len(out['false_node_losses_fleet_late'])} more the fleet's lateness explains), coordinator CPU "
                 f"{out['coordinator_cpu_pct']}%, hollow process {out['hollow_process_cpu_pct']}%")

        # --- node losses ----------------------------------------------------------------------
        for mode in ("kill", "hang"):
            lat: list[float] = []
            for _ in range(kills):
                node = rng.choice(fleet.live())
                time.sleep(1.0 + rng.random())
                died = fleet.kill(node) if mode == "kill" else fleet.hang(node)
                # after the fault only: a node may have had a loss before (one of the full run's kills
                # matched its node's loss at the wide placement and read -617 s)
                rec = tail.wait(lambda r, node=node, died=died: r.get("event") == "incident" and r.get("node") == node
                                and r.get("kind") == "lost_connection" and r["ts"] >= died, 30.0)
                if rec is None:
                    progress(f"{mode} {node}: no node-loss incident within 30 s")
                lat.append(math.inf if rec is None else rec["ts"] - died)
            out["kills"] = kills
            out |= loss_figures("node_loss" if mode == "kill" else "node_hang", lat)
            progress(f"{mode}: {[round(x, 3) for x in lat]}")
        writes = [r for r in tail.lines if r.get("event") == "decision written" and int(r.get("ops", 0)) > 127]
        out["wide_writes"] = len(writes)
        if writes:
            out["wide_write_s_median"] = round(statistics.median(float(r["write_s"]) for r in writes), 3)
        lost_all = [r for r in tail.lines if r.get("event") == "incident" and r.get("kind") == "lost_connection"]
        out["coordinator_log_mb"] = round(tail.offset / 1e6, 1)
        out["node_loss_incidents_total"] = len(lost_all)
    finally:
        os.environ.pop("UNICRON_ETCD", None)
        if fleet is not None:
            fleet.stop()
        c.stop()
    out["wall_s"] = round(time.time() - t_start, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
