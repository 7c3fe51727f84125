"""Transition time per recovery action (paper §6, Figure 9) against a full restart from a checkpoint.

One task of the real training runtime (a small Megatron-core GPT on gloo, 4 ranks on 2 of 3 agents,
2 simulated GPUs each) under the real coordinator. For each action the benchmark injects the fault
and measures the time until the task completes its next iteration:

* ``reattempt`` (sev3): a rank raises "connection reset"; the ranks regroup in place.
* ``restart`` (sev2): a rank is SIGKILLed; the survivors finish the iteration by redistributing its
  micro-batches, and the coordinator restarts that rank, which rejoins. ``restart_rejoined_s`` is the
  time until the restarted rank is back and training.
* ``reconfigure`` (sev1): the agent of a node running ranks is SIGKILLed; the node is isolated and the
  task is placed again (new processes) and resumes from its newest checkpoint.
* ``baseline_restart`` (same run): the whole task is stopped and submitted again, every process new,
  resuming from its last ``torch.save`` checkpoint — what torchrun and Megatron do. Its time counts the
  iterations computed again since that checkpoint, until the task is past the failed iteration. Its
  processes, like every rank's, are forked from the agents' warm spawner (``agent/prefork.py``), which
  torchrun does not have: if anything, this baseline is faster than torchrun's.

Iteration progress is read from the agents' status, written every 0.1 s here. ``iterations_redone``:
iterations completed before the fault that had to be computed again (the fault's iteration minus the
checkpoint the new processes restored; 0 where the running ranks keep their state).

    .venv/bin/python bench/transition.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from unicron.cli.main import main as cli
from unicron.cluster.localcluster import LocalCluster
from unicron.kernel.inject import Injection, request
from unicron.runtime.checkpoint import TorchSaveCheckpointer

TASK = "bench"
# torch.save every 20 iterations (~5 s of training here): the baseline, and a reconfigured task, resume
# from the newest snapshot and recompute the iterations since, as a restart from Megatron's periodic
# checkpoints does (the paper's baseline). Where in the interval a fault lands is not controlled, so
# iterations_redone (median) shows what each figure paid for.
CKPT_EVERY = 20
MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32, "vocab_size": 128,
         "global_batch_size": 32, "micro_batch_size": 4}


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Bench:
    def __init__(self, c: LocalCluster, spec_dir: str) -> None:
        self.c = c
        self.spec_path = os.path.join(spec_dir, "task.json")
        self.ckpt_dir = os.path.join(spec_dir, "ckpt")
        command = [sys.executable, "-m", "unicron.runtime.train", "--iterations", "0", "--iter-sleep", "0.05",
                   "--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--vocab", "128",
                   "--global-batch-size", "32", "--micro-batch-size", "4",
                   "--ckpt", "torch-save", "--ckpt-dir", self.ckpt_dir,
                   "--ckpt-every", str(CKPT_EVERY), "--resume"]
        with open(self.spec_path, "w") as f:
            json.dump({"name": TASK, "command": command, "min_gpus": 4, "model": MODEL}, f)

    def ranks(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for n in self.c.node_names():
            st = self.c.agent_status(n) or {}
            out += [r | {"node": n} for r in st.get("ranks", [])
                    if r.get("task") == TASK and r.get("state") == "running"]
        return out

    def steps(self) -> list[int]:
        return [int(r["step"]) for r in self.ranks() if isinstance(r.get("step"), int)]

    def healthy(self, min_step: int = 3) -> bool:
        steps = self.steps()
        return len(steps) == 4 and min(steps) >= min_step and len(self.ranks()) == 4

    def settle(self, timeout: float = 300.0) -> None:
        """Wait until all 4 ranks run and step together, a few iterations past the last checkpoint."""
        start = max(self.steps(), default=0)
        self.c.wait_for(lambda: self.healthy(start + 3), timeout, "the task to train on 4 ranks", poll_s=0.1)

    def wait_next_iteration(self, past: int, timeout: float = 300.0) -> float:
        self.c.wait_for(lambda: max(self.steps(), default=-1) > past, timeout, f"an iteration past {past}",
                        poll_s=0.02)
        return time.time()

    def newest_checkpoint(self) -> int:
        """The iteration a restart resumes from: the newest snapshot of the (TP=1) task's one shard."""
        held = TorchSaveCheckpointer(self.ckpt_dir, rank=0).held()
        return held[-1] if held else 0

    def submit(self) -> None:
        assert cli(["submit", self.spec_path]) == 0

    # --- actions ---------------------------------------------------------------------------------

    def reattempt(self) -> tuple[float, int]:
        victim = self.ranks()[0]
        step = max(self.steps())
        assert self.c.store is not None
        ans = request(self.c.store, self.c.keys, victim["node"],
                      Injection.from_dict({"fault": "raise", "kind": "connection_refused_reset", "task": TASK, "rank": victim["rank"]}))
        t0 = float(ans.executed_ts or 0.0)
        return self.wait_next_iteration(step) - t0, 0

    def restart(self) -> tuple[float, float, int]:
        victim = self.ranks()[-1]
        step = max(self.steps())
        t0 = time.time()
        os.kill(int(victim["pid"]), signal.SIGKILL)
        next_it = self.wait_next_iteration(step) - t0
        # The agent shows a restarted rank with its predecessor's last step until the new process
        # reports one, and that may be past ``step`` (read from a status up to 0.1 s old): only a step
        # beyond both counts as rejoined. A new process takes seconds to start, so this read is stale.
        stale = max([int(r["step"]) for r in self.ranks() if r["rank"] == victim["rank"]
                     and isinstance(r.get("step"), int)], default=step)

        def rejoined() -> bool:
            back = [r for r in self.ranks() if r["rank"] == victim["rank"] and r["pid"] != victim["pid"]]
            return bool(back) and isinstance(back[0].get("step"), int) and back[0]["step"] > max(step, stale)

        self.c.wait_for(rejoined, 300.0, "the restarted rank to rejoin", poll_s=0.05)
        return next_it, time.time() - t0, 0

    def reconfigure(self) -> tuple[float, int]:
        node = self.ranks()[0]["node"]
        step = max(self.steps())
        gen = max(int(r.get("generation") or 0) for r in self.ranks())
        t0 = time.time()
        os.kill(self.c.agents[node].pid, signal.SIGKILL)

        def resumed() -> list[int] | None:
            new = [r for r in self.ranks() if int(r.get("generation") or 0) > gen and isinstance(r.get("step"), int)]
            return [int(r["step"]) for r in new] if len(new) == 4 else None

        self.c.wait_for(resumed, 300.0, "the reconfigured task", poll_s=0.05)
        resume_from = self.newest_checkpoint()  # restored by the new processes; the next save is 20 away
        done = self.wait_next_iteration(step)
        self.c.agents[node].wait()
        self.c.start_agent(node)  # the node comes back (a join: the task may be placed again)
        self.c.wait_registered(node)
        return done - t0, max(0, step - resume_from)

    def baseline_restart(self) -> tuple[float, int]:
        step = max(self.steps())
        t0 = time.time()
        assert cli(["cancel", TASK]) == 0
        self.c.wait_for(lambda: not self.ranks(), 60.0, "the task's processes to stop", poll_s=0.05)
        resume_from = self.newest_checkpoint()  # nothing writes until the task is submitted again
        self.submit()
        done = self.wait_next_iteration(step)
        return done - t0, max(0, step - resume_from)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="one repetition per action")
    args = ap.parse_args()
    reps = 1 if args.quick else 5
    results: dict[str, list[float]] = {k: [] for k in
                                       ("reattempt", "restart", "restart_rejoined", "reconfigure", "baseline_restart")}
    redone: dict[str, list[int]] = {k: [] for k in ("reattempt", "restart", "reconfigure", "baseline_restart")}
    env = {"UNICRON_STATUS_INTERVAL": "0.1", "UNICRON_WARMUP_ITERATIONS": "5"}
    with LocalCluster(agents=3, gpus_per_agent=2, extra_env=env) as c:
        os.environ["UNICRON_ETCD"] = c.etcd.endpoint
        b = Bench(c, tempfile.mkdtemp(prefix="unicron-transition-"))
        b.submit()
        b.settle()
        for i in range(reps):
            s, n = b.reattempt()
            results["reattempt"].append(s)
            redone["reattempt"].append(n)
            b.settle()
            s, full, n = b.restart()
            results["restart"].append(s)
            results["restart_rejoined"].append(full)
            redone["restart"].append(n)
            b.settle()
            s, n = b.reconfigure()
            results["reconfigure"].append(s)
            redone["reconfigure"].append(n)
            b.settle()
            s, n = b.baseline_restart()
            results["baseline_restart"].append(s)
            redone["baseline_restart"].append(n)
            b.settle()
            progress(f"rep {i}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in results.items()))
    med = {k: round(statistics.median(v), 3) for k, v in results.items()}
    for k, v in results.items():
        print(f"{k:>17}: median {med[k]:.3f} s  all {[round(x, 3) for x in v]}  redone {redone.get(k, '-')}")
    out = {
        "repetitions": reps,
        "reattempt_s": med["reattempt"],
        "restart_s": med["restart"],
        "restart_rejoined_s": med["restart_rejoined"],
        "reconfigure_s": med["reconfigure"],
        "baseline_restart_s": med["baseline_restart"],
        "restart_speedup": round(med["baseline_restart"] / med["restart"], 2),
        "restart_rejoined_speedup": round(med["baseline_restart"] / med["restart_rejoined"], 2),
        "iterations_redone": {k: statistics.median(v) for k, v in redone.items()},
        "checkpoint_every": CKPT_EVERY,
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
