"""Transition time per recovery kind (paper §6, Figure 9) against what users run today, on the real
system: etcd, a coordinator, two agents with 2 simulated GPUs each, one task of the real training
runtime (a small Megatron-core GPT on gloo, ``min_gpus`` 2, ``max_gpus`` 4: 4 ranks on both nodes).

Each node is a host of its own (a network namespace with one IP, as every daemon of
``LocalCluster(netns=True)``), the topology production runs: since 2026-11-28. ``--loopback`` puts
everything on 127.0.0.1 as before. On one address a survivor cannot be cut off from a lost node
(``PeersLost``, :mod:`unicron.runtime.hostloss`: its address is the survivor's own), so a
``reconfigure`` there waits for the killed ranks' sockets to close, i.e. for the kernel to tear the
killed processes down (40-260 ms on this 2-core machine, probed), which a survivor on another host is
not made to wait for.

Every figure is read from the ranks' own clocks: each rank prints ``iteration N done TS pid P dp D``
as it commits an iteration (``--log-iterations``), and the benchmark reads those lines from the ranks'
logs. A fault is raised *inside* an iteration, ``OFFSET`` of an iteration's time after the previous
one committed (read from those lines); the clock starts at the fault and stops at the first iteration
**completed** afterwards by a process of the configuration the task settles in, at that
configuration's data-parallel size:

* ``reattempt`` (sev3): a rank raises "connection reset" (``unicron inject``; the rank takes an
  injected fault between two micro-batches, so it lands inside the iteration); clock from the rank's
  own raise stamp (its exception report's ``ts``, the incident's ``source_ts``), and it stops only at
  an iteration no earlier than the one the rank raised in (the incident's ``step``): a fault delivered
  after an iteration's last micro-batch started is raised in the next one, and the iteration it
  never touched completes normally (before 2026-11-28 the clock started at the agent's delivery
  stamp and could stop there: 0.055 s, under one iteration);
* ``restart`` (sev2): a rank is SIGKILLed; the clock stops when the *restarted* rank has rejoined
  and completed an iteration;
* ``reconfigure`` (sev1, shrink): a node's agent is SIGKILLed (its ranks die with it); the task goes on
  on the other node (DP 2). The node is one that does not host the task's store;
* ``reconfigure_store``: the same, for the node that hosts the store (its sidecar dies with the agent):
  the store moves to the survivor's node, which had kept a spare sidecar listening
  (``UNICRON_SPARE_STORES``; ``--no-spare-stores`` turns that off, so the move starts a sidecar);
  ``store_move_ratio`` is its median over ``reconfigure``'s, both from the same run;
* ``grow`` (node join): the agent comes back and is undrained (a node isolated after a sev1 stays
  out until an operator undrains it); clock from the undrain's answer until the first iteration
  completed at DP 4;
* ``baseline_restart``: the same runtime as a ``recovery: "restart"`` task (torchrun's
  ``--max-restarts`` semantics: any rank's failure stops every rank and relaunches the whole job
  through the same agents and warm spawner, with a fresh store), ``--ckpt torch-save --ckpt-every 10
  --stop-snapshot off`` (Megatron's periodic checkpoints, no save on stop); a rank is SIGKILLed
  ``BASE_AFTER`` iterations after a checkpoint (+ the same in-iteration offset); the clock stops at the
  first iteration the relaunched job completes (the recompute of the iterations since the
  checkpoint is then still ahead of it: ``baseline_caught_up_s`` is until it completed the fault's
  iteration again).

``iteration_s``: per kind, the task's median iteration time before the fault and in the configuration
it settled in: a transition's clock stops at an iteration's end, so it includes that iteration's own
work (a reconfigure's survivors compute the lost ranks' share too), and it scales with it.
``*_full_rate_s``: until the iteration rate is back to >= 90 % of the new configuration's steady rate
(the median interval of the last iterations of the window after recovery): the first completed
iteration from which the next 3 intervals are all within it. ``iterations_redone``: iterations that had
completed before the fault and were computed again (last completed + 1 - the first index completed
after recovery). ``projected_*``: a separate, labelled projection adding the recompute a 30-minute
checkpoint interval costs on average (15 min) to the baseline; never mixed into measured figures.

    .venv/bin/python bench/transition.py [--quick] [--reps N] [--no-in-place] [--no-spare-stores] [--loopback]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import itertools

from unicron.cli.main import main as cli
from unicron.cluster.localcluster import LocalCluster
from unicron.kernel.inject import Injection, request
from unicron.kernel.types import ErrorKind, StoreAddress

TASK, BASE = "bench", "base"
#: where inside an iteration a fault lands: this fraction of the mean iteration time after the
#: previous iteration committed
OFFSET = 0.4
#: the baseline's checkpoint interval (iterations) and where after a checkpoint its fault lands
BASE_EVERY, BASE_AFTER = 10, 5
#: the paper's checkpoint interval (30 min): a restart recomputes half of it on average
PROJECTED_RECOMPUTE_S = 15 * 60.0
FULL_RATE = 0.9
LINE = re.compile(r"^iteration (\d+) done ([\d.]+) pid (\d+) dp (\d+)")


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Done:
    it: int
    ts: float
    pid: int
    dp: int
    rank: int


class IterLog:
    """Every ``iteration N done`` line of a task's ranks (their logs are appended across launches)."""

    def __init__(self, run_dir: str, task: str) -> None:
        self.dir = Path(run_dir, "logs", task)
        self.lines: list[Done] = []
        self._pos: dict[str, int] = {}

    def poll(self) -> list[Done]:
        for path in sorted(self.dir.glob("rank*.log")) if self.dir.exists() else []:
            rank = int(path.stem[4:])
            with open(path, "rb") as fh:
                fh.seek(self._pos.get(path.name, 0))
                data = fh.read()
            end = data.rfind(b"\n") + 1
            self._pos[path.name] = self._pos.get(path.name, 0) + end
            for raw in data[:end].decode(errors="replace").splitlines():
                if m := LINE.match(raw):
                    self.lines.append(Done(int(m[1]), float(m[2]), int(m[3]), int(m[4]), rank))
        return self.lines

    def after(self, t0: float) -> list[Done]:
        return [d for d in self.poll() if d.ts > t0]

    def last_before(self, t0: float) -> int:
        return max((d.it for d in self.poll() if d.ts <= t0), default=-1)


class Bench:
    def __init__(self, c: LocalCluster, work: str, window: int) -> None:
        self.c, self.work, self.window = c, work, window
        self.logs = {t: IterLog(c.run_dir, t) for t in (TASK, BASE)}
        self.period = float("nan")  # the task's iteration time read before the last fault

    # --- tasks -----------------------------------------------------------------------------------

    def submit(self, name: str) -> None:
        ck = os.path.join(self.work, f"ck-{name}")
        command = [sys.executable, "-m", "unicron.runtime.train", "--iterations", "0", "--iter-sleep", "0.05",
                   "--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--vocab", "128",
                   "--global-batch-size", "32", "--micro-batch-size", "4", "--log-iterations", "--resume"]
        # no model description: the planner takes throughput as linear in GPUs, so the task gets every
        # GPU up to max_gpus (with MODEL it kept the task on one node's 2 GPUs)
        spec: dict[str, Any] = {"name": name, "min_gpus": 2, "max_gpus": 4}
        if name == TASK:  # Unicron: in-memory checkpoints (local, peer, remote), snapshots on stop
            command += ["--ckpt", "memory", "--ckpt-dir", ck, "--ckpt-every", "20"]
        else:  # today's job: periodic torch.save, nothing saved on stop, the whole job restarted
            command += ["--ckpt", "torch-save", "--ckpt-dir", ck, "--ckpt-every", str(BASE_EVERY),
                        "--stop-snapshot", "off"]
            spec["recovery"] = "restart"
        spec["command"] = command
        path = os.path.join(self.work, f"{name}.json")
        with open(path, "w") as f:
            json.dump(spec, f)
        assert cli(["submit", path]) == 0

    def ranks(self, name: str) -> dict[int, dict[str, Any]]:
        return self.c.running_ranks(name)

    def settle(self, name: str, world: int, timeout: float = 240.0) -> None:
        """``world`` ranks run (one generation), and each of their processes completed 3 iterations."""
        def ok() -> bool:
            ranks = self.ranks(name)
            if len(ranks) != world:
                return False
            pids = {int(r["pid"]) for r in ranks.values()}
            seen: dict[int, int] = {}
            for d in self.logs[name].poll():
                if d.pid in pids and d.dp == world:
                    seen[d.pid] = seen.get(d.pid, 0) + 1
            return len(seen) == world and min(seen.values()) >= 3
        self.c.wait_for(ok, timeout, f"{name} to train on {world} ranks", poll_s=0.1)

    def iter_time(self, name: str) -> float:
        ts = sorted({d.it: d.ts for d in self.logs[name].poll()}.items())[-8:]
        return statistics.median(b[1] - a[1] for a, b in itertools.pairwise(ts))

    def at_offset(self, name: str, it: int | None = None) -> int:
        """Sleep until OFFSET of an iteration after iteration ``it`` (default: the next) committed;
        returns the index of the iteration the fault will land in."""
        log, period = self.logs[name], self.iter_time(name)
        start = max((d.it for d in log.poll()), default=-1)
        target = it if it is not None else start + 1
        self.c.wait_for(lambda: any(d.it == target for d in log.poll()), 120.0, f"iteration {target}", poll_s=0.005)
        committed = min(d.ts for d in log.poll() if d.it == target)
        self.period = period
        delay = committed + OFFSET * period - time.time()
        if delay < 0:  # read too late (the machine is busy): take the next iteration
            return self.at_offset(name, target + 1)
        time.sleep(delay)
        return target + 1

    # --- measuring -------------------------------------------------------------------------------

    def measure(self, name: str, t0: float, world: int, new_pids: set[int] | None = None,
                window: int = 0, from_step: int = 0) -> dict[str, float]:
        """Wait for the window of iterations after ``t0`` of the settled configuration, none before
        iteration ``from_step`` (the one the fault hit); the figures."""
        log, window = self.logs[name], max(window, self.window)

        def final() -> list[Done]:
            pids = {int(r["pid"]) for r in self.ranks(name).values()} if len(self.ranks(name)) == world else set()
            return [d for d in log.after(t0) if d.pid in pids and d.dp == world and d.it >= from_step]

        self.c.wait_for(lambda: len({d.it for d in final()}) >= window, 300.0,
                        f"{window} iterations of {name} at dp {world}", poll_s=0.1)
        mine = final()
        stop_on = [d for d in mine if new_pids is None or d.pid in new_pids] or mine
        first = min(stop_on, key=lambda d: d.ts)
        by_it = sorted({d.it: min(x.ts for x in mine if x.it == d.it) for d in mine}.items())
        times = [ts for _, ts in by_it]
        intervals = [b - a for a, b in itertools.pairwise(times)]
        steady = statistics.median(intervals[-max(3, len(intervals) // 2):])
        full = times[-1]
        for i in range(len(intervals) - 2):
            if all(x <= steady / FULL_RATE for x in intervals[i : i + 3]):
                full = times[i]
                break
        redone = max(0, log.last_before(t0) + 1 - min(d.it for d in mine))
        return {"s": first.ts - t0, "full_rate_s": max(full, first.ts) - t0, "redone": redone,
                "iteration_before_s": self.period, "iteration_after_s": steady}

    # --- kinds -----------------------------------------------------------------------------------

    def reattempt(self) -> dict[str, float]:
        victim = min(self.ranks(TASK).items())[1]
        assert self.c.store is not None
        self.at_offset(TASK)
        kind = ErrorKind.CONNECTION_REFUSED_RESET
        ans = request(self.c.store, self.c.keys, str(victim["node"]),
                      Injection.from_dict({"fault": "raise", "kind": kind.value, "task": TASK, "rank": victim["rank"]}))
        # the rank raises only between two micro-batches, possibly in the next iteration: the clock
        # starts at its own raise stamp and stops at an iteration the fault touched, not at the delivery
        raised = self.c.wait_incident(lambda i: i.kind is kind and i.task == TASK and i.rank == victim["rank"],
                                      timeout_s=30.0, after=float(ans.executed_ts or 0.0))
        return self.measure(TASK, raised.source_ts, 4, from_step=raised.step or 0)

    def restart(self) -> dict[str, float]:
        rank, victim = max(self.ranks(TASK).items())
        before = {int(r["pid"]) for r in self.ranks(TASK).values()}
        self.at_offset(TASK)
        t0 = time.time()
        os.kill(int(victim["pid"]), signal.SIGKILL)
        def relaunched() -> int | None:
            r = self.ranks(TASK).get(rank)
            return int(r["pid"]) if r is not None and int(r["pid"]) not in before else None

        pid = self.c.wait_for(relaunched, 120.0, "the rank's relaunch", poll_s=0.05)
        return self.measure(TASK, t0, 4, new_pids={pid})

    def store_node(self) -> str:
        assert self.c.store is not None
        kv = self.c.store.get(self.c.keys.store(TASK))
        assert kv is not None
        return StoreAddress.from_json(kv.value).node

    def spare_listening(self, node: str, since: float) -> None:
        """Wait for ``node``'s spare store sidecar (a torch import), started once the task's ranks
        stepped after a grow named the node: a fault in production comes long after that, the bench's
        next one within seconds (it would meet the import, or a spare still starting)."""
        self.c.wait_for(lambda: any(r.get("event") == "store sidecar listening" for r in self.c.agent_log(node, since)),
                        60.0, f"{node}'s spare store", poll_s=0.1)

    def other_node(self, than: str) -> str:
        """A node running ranks of the task other than ``than`` (2 nodes here: the other one)."""
        return min({str(r["node"]) for r in self.ranks(TASK).values()} - {than})

    def reconfigure(self, store: bool = False) -> tuple[dict[str, float], str]:
        """Kill a node's agent: the store's node with ``store``, else another."""
        hosting = self.store_node()
        node = hosting if store else self.other_node(hosting)
        self.at_offset(TASK)
        t0 = time.time()
        os.kill(self.c.agents[node].pid, signal.SIGKILL)
        out = self.measure(TASK, t0, 2)
        self.c.agents[node].wait()
        return out, node

    def grow(self, node: str) -> dict[str, float]:
        """The lost node comes back. The coordinator keeps a node isolated after a sev1 until an
        operator undrains it: the join is the undrain (its answer starts the clock)."""
        started = time.time()
        self.c.start_agent(node)
        self.c.wait_registered(node)
        # a node that joins runs a warm agent: wait for its spawner's socket (torch imported), or the
        # spawner's import would be counted as the transition
        sock = Path(self.c.run_dir, f"{node}.pf")
        self.c.wait_for(lambda: sock.exists() and sock.stat().st_ctime > started, 120.0, "the spawner", poll_s=0.1)
        self.period = self.iter_time(TASK)  # at DP 2
        assert cli(["undrain", node]) == 0
        t0 = time.time()
        return self.measure(TASK, t0, 4)

    def baseline(self) -> dict[str, float]:
        log = self.logs[BASE]
        last = max(d.it for d in log.poll())
        ckpt = (last // BASE_EVERY + 1) * BASE_EVERY  # the next checkpoint: saved after iteration ckpt-1
        # iterations ckpt .. ckpt+BASE_AFTER-1 complete after the checkpoint; the fault lands in the next
        fault_it = self.at_offset(BASE, ckpt + BASE_AFTER - 1)
        victim = max(self.ranks(BASE).values(), key=lambda r: int(r["rank"]))
        t0 = time.time()
        os.kill(int(victim["pid"]), signal.SIGKILL)
        out = self.measure(BASE, t0, 4, window=BASE_AFTER + 3)  # past the fault's iteration (caught up)
        pids = {int(r["pid"]) for r in self.ranks(BASE).values()}
        caught = min((d.ts for d in log.after(t0) if d.it >= fault_it and d.pid in pids), default=float("nan"))
        out["caught_up_s"] = caught - t0
        return out


def summary(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="one repetition per kind, a shorter window")
    ap.add_argument("--reps", type=int, default=0, help="repetitions per kind (default 5; --quick 1)")
    ap.add_argument("--no-in-place", action="store_true",
                    help="turn off the coordinator's in-place resize (UNICRON_IN_PLACE_RESIZE=0): every move is "
                         "a new generation, for comparison")
    ap.add_argument("--no-spare-stores", action="store_true",
                    help="no spare store sidecars (UNICRON_SPARE_STORES=0): a moved store starts one, for comparison")
    ap.add_argument("--loopback", action="store_true",
                    help="every node on 127.0.0.1 (no network namespaces, no root needed), for comparison")
    args = ap.parse_args()
    reps = args.reps or (1 if args.quick else 5)
    window = 5 if args.quick else 16
    kinds = ("reattempt", "restart", "reconfigure", "reconfigure_store", "grow", "baseline_restart")
    res: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    env = {"UNICRON_STATUS_INTERVAL": "0.1", "UNICRON_WARMUP_ITERATIONS": "5",
           "UNICRON_IN_PLACE_RESIZE": "0" if args.no_in_place else "1",
           "UNICRON_SPARE_STORES": "0" if args.no_spare_stores else "1"}
    spares = not args.no_in_place and not args.no_spare_stores
    started = time.time()
    with LocalCluster(agents=2, gpus_per_agent=2, extra_env=env, netns=not args.loopback) as c:
        os.environ["UNICRON_ETCD"] = c.etcd.endpoint
        b = Bench(c, tempfile.mkdtemp(prefix="unicron-transition-"), window)
        since = time.time()
        b.submit(TASK)
        b.settle(TASK, 4)
        if spares:
            b.spare_listening(b.other_node(b.store_node()), since)
        progress("unicron task training")
        for i in range(reps):
            res["reattempt"].append(b.reattempt())
            b.settle(TASK, 4)
            res["restart"].append(b.restart())
            b.settle(TASK, 4)
            for store in (False, True):
                r, node = b.reconfigure(store)
                res["reconfigure_store" if store else "reconfigure"].append(r)
                b.settle(TASK, 2)
                since = time.time()
                res["grow"].append(b.grow(node))  # the node comes back as the store's successor
                if spares:
                    b.spare_listening(node, since)
                if store and i + 1 == reps:
                    break  # the grow's window already ran at DP 4 on these processes
                b.settle(TASK, 4)
            progress(f"rep {i}: " + ", ".join(f"{k} {v[-1]['s']:.3f}" for k, v in res.items() if v))
        assert cli(["cancel", TASK]) == 0
        c.wait_for(lambda: not b.ranks(TASK), 60.0, "the task to stop", poll_s=0.1)
        b.submit(BASE)
        b.settle(BASE, 4)
        progress("baseline task training")
        for i in range(reps):
            res["baseline_restart"].append(b.baseline())
            b.settle(BASE, 4)
            progress(f"baseline rep {i}: {res['baseline_restart'][-1]}")
        cli(["cancel", BASE])
    med = {k: statistics.median(x["s"] for x in v) for k, v in res.items()}
    for k, v in res.items():
        print(f"{k:>17}: {summary([x['s'] for x in v])}  full_rate {summary([x['full_rate_s'] for x in v])}  "
              f"redone {[int(x['redone']) for x in v]}")
    caught = [x["caught_up_s"] for x in res["baseline_restart"]]
    print(f"baseline caught up with the fault's iteration: {summary(caught)}")
    base = med["baseline_restart"]
    out: dict[str, Any] = {"repetitions": reps, "quick": args.quick, "in_place": not args.no_in_place,
                           "hosts": "loopback" if args.loopback else "netns",
                           "wall_s": round(time.time() - started, 1)}
    for k in kinds:
        out[f"{k}_s"] = round(med[k], 3)
        out[f"{k}_full_rate_s"] = round(statistics.median(x["full_rate_s"] for x in res[k]), 3)
        out[f"{k}_range_s"] = [summary([x["s"] for x in res[k]])["min"], summary([x["s"] for x in res[k]])["max"]]
    out["baseline_caught_up_s"] = round(statistics.median(caught), 3)
    # each kind's figure next to the task's iteration time before the fault and in the configuration it
    # settled in: a transition ends at an iteration's end, so part of it is that iteration's own work
    out["iteration_s"] = {k: [round(statistics.median(x[f"iteration_{w}_s"] for x in res[k]), 3)
                              for w in ("before", "after")] for k in kinds}
    out["reconfigure_speedup"] = round(base / med["reconfigure"], 2)
    out["spare_stores"] = spares
    out["store_move_ratio"] = round(med["reconfigure_store"] / med["reconfigure"], 2)
    out["restart_speedup"] = round(base / med["restart"], 2)
    out["grow_speedup"] = round(base / med["grow"], 2)
    out["iterations_redone"] = {k: statistics.median(x["redone"] for x in res[k]) for k in kinds}
    out["projection_note"] = "projected_* add 15 min (half a 30-min checkpoint interval) of recompute to the baseline"
    out["projected_baseline_restart_s"] = round(base + PROJECTED_RECOMPUTE_S, 1)
    out["projected_reconfigure_speedup"] = round((base + PROJECTED_RECOMPUTE_S) / med["reconfigure"], 1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
