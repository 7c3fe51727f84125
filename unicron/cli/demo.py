"""The local demo (``unicron demo``): a throwaway etcd, a coordinator, three agents ("nodes") with
two simulated GPUs each, two submitted tasks of real gloo training processes, then one injected
fault of each severity. It prints each detection, the action taken and how long the task took to
make progress again, and ends with both tasks training.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import sys
import tempfile
import time
from typing import Any

from unicron.cluster.localcluster import LocalCluster
from unicron.kernel.inject import Injection, request
from unicron.kernel.tls import plaintext_warning
from unicron.kernel.types import Incident


def _say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _ranks(c: LocalCluster, task: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for n in c.node_names():
        st = c.agent_status(n)
        out += [r | {"node": n} for r in (st or {}).get("ranks", []) if r.get("task") == task]
    return out


def _running(c: LocalCluster, task: str) -> list[dict[str, Any]]:
    return [r for r in _ranks(c, task) if r.get("state") == "running"]


def _progress(c: LocalCluster, task: str) -> tuple[int, int]:
    """(generation, minimum step) over the task's running ranks; (-1, -1) if not all run."""
    ranks = [r for r in _ranks(c, task) if r.get("state") == "running"]
    steps = [r.get("step") for r in ranks]
    if not ranks or not all(isinstance(s, int) for s in steps):
        return -1, -1
    return max(int(r.get("generation") or 0) for r in ranks), min(int(s) for s in steps)  # type: ignore[arg-type]


def _wait_progress(c: LocalCluster, task: str, after_step: int, after_gen: int, timeout_s: float) -> float:
    """Wait until the task completes an iteration past ``after_step`` (or any, at a newer generation)."""
    t0 = time.time()

    def advanced() -> bool:
        gen, step = _progress(c, task)
        return (gen > after_gen and step >= 0) or (gen == after_gen and step > after_step)

    c.wait_for(advanced, timeout_s, f"task {task} to make progress", poll_s=0.2)
    return time.time() - t0


def _actions_since(c: LocalCluster, since: float) -> list[str]:
    log_path = os.path.join(c.run_dir, "coordinator.log")
    out = []
    with open(log_path, errors="replace") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("event") == "action" and rec.get("timestamp", "") >= time.strftime(
                    "%Y-%m-%dT%H:%M:%S", time.gmtime(since)):
                out.append(f"{rec.get('action')}({rec.get('task') or rec.get('node') or ''})")
    return out


def _settle(c: LocalCluster, task: str, timeout_s: float) -> None:
    """Wait until every rank of ``task`` runs and the task has moved on a few iterations."""
    _, start = _progress(c, task)
    c.wait_for(lambda: _progress(c, task)[1] >= start + 3, timeout_s, f"task {task} to settle", poll_s=0.2)


def _fault(c: LocalCluster, title: str, inject: Any, pick: Any, task: str, timeout_s: float) -> None:
    _settle(c, task, timeout_s)
    gen, step = _progress(c, task)
    _say(f"--- {title}")
    t_fault = inject()
    inc: Incident = c.wait_incident(pick, timeout_s=30.0, after=t_fault - 0.5)
    _say(f"detected {inc.severity} {inc.kind.value} on {inc.node} (rank {inc.rank}) "
         f"{1000 * (inc.detected_ts - t_fault):.0f} ms after the fault")
    took = _wait_progress(c, task, step, gen, timeout_s)
    _say(f"actions: {', '.join(_actions_since(c, t_fault)) or '(none)'}")
    _say(f"task {task} training again {time.time() - t_fault:.1f} s after the fault "
         f"(generation {_progress(c, task)[0]}); waited {took:.1f} s")


def run_demo(secure: bool = False) -> int:
    env = {"UNICRON_REATTEMPT_DEADLINE": "15", "UNICRON_RESTART_DEADLINE": "60", "UNICRON_WARMUP_ITERATIONS": "5"}
    with tempfile.TemporaryDirectory(prefix="unicron-demo-") as spec_dir, \
            LocalCluster(agents=3, gpus_per_agent=2, extra_env=env, tls=secure) as c:
        _say(f"cluster up: etcd {c.etcd.endpoint}, nodes {', '.join(c.registered_nodes())}; logs in {c.run_dir}")
        os.environ["UNICRON_ETCD"] = c.etcd.endpoint
        if secure:
            # the CLI below acts as the operator: DIR/operator.crt (--tls-name's default)
            os.environ["UNICRON_TLS_DIR"] = c.tls_dir
            _say(f"secure: mutual TLS on etcd (client-cert-auth, per-role auth), the link and the API; "
                 f"certificates in {c.tls_dir}")
        else:
            _say(plaintext_warning("this demo's etcd, agent link and API", flag="scripts/demo.sh --tls"))
        from unicron.cli.main import main as cli

        for name, weight in (("alpha", 1.5), ("beta", 1.0)):
            # A small Megatron-core GPT on CPU/gloo (unicron train's default model).
            command = [sys.executable, "-m", "unicron.runtime.train", "--iterations", "0", "--iter-sleep", "0.05",
                       # the model of the spec's model description below
                       "--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--vocab", "128",
                       "--global-batch-size", "32", "--micro-batch-size", "4"]
            path = os.path.join(spec_dir, f"{name}.json")
            # The model description is the command's model: the planner allocates only counts
            # whose data-parallel size divides the 8 micro-batches (2 or 4 GPUs here).
            model = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
                     "vocab_size": 128, "global_batch_size": 32, "micro_batch_size": 4}
            with open(path, "w") as f:
                json.dump({"name": name, "command": command, "weight": weight, "min_gpus": 2, "model": model}, f)
            cli(["submit", path])
        for name in ("alpha", "beta"):
            c.wait_for(functools.partial(lambda n: _progress(c, n)[1] >= 8, name), 240.0, f"{name} to train",
                       poll_s=0.5)
        cli(["tasks"])
        assert c.store is not None
        store, keys = c.store, c.keys

        def sev3() -> float:
            r = _running(c, "alpha")[0]
            ans = request(store, keys, r["node"], Injection.from_dict({"fault": "raise", "kind": "connection_refused_reset",
                                                   "task": "alpha", "rank": r["rank"]}))
            return float(ans.executed_ts or 0.0)

        def sev2() -> float:
            r = _running(c, "alpha")[-1]
            os.kill(int(r["pid"]), signal.SIGKILL)
            return time.time()

        lost: list[str] = []

        def sev1() -> float:
            node = _running(c, "beta")[0]["node"]
            lost.append(node)
            os.kill(c.agents[node].pid, signal.SIGKILL)
            return time.time()

        timeout = 240.0
        _fault(c, "sev3: a rank raises 'connection reset' (the runtime regroups in place)", sev3,
               lambda i: i.kind.value == "connection_refused_reset", "alpha", timeout)
        _fault(c, "sev2: a rank is SIGKILLed (restart that rank; it rejoins from a replica)", sev2,
               lambda i: i.kind.value == "exited_abnormally", "alpha", timeout)
        _fault(c, "sev1: a node's agent is SIGKILLed (isolate the node, reconfigure both tasks)", sev1,
               lambda i: i.kind.value == "lost_connection", "beta", timeout)
        cli(["tasks"])
        _say(f"--- node {lost[0]} repaired: its agent starts again; it stays isolated until the operator "
             "returns it to service (undrain), which is a reconfiguration trigger (④)")
        c.start_agent(lost[0])
        c.wait_registered(lost[0])
        cli(["undrain", lost[0]])
        c.wait_for(lambda: c.node_state(lost[0]) == "up", timeout, f"node {lost[0]} to be up", poll_s=0.2)
        for name in ("alpha", "beta"):
            gen, step = _progress(c, name)
            _wait_progress(c, name, step, gen, timeout)
        _say(f"node {lost[0]} is back in the pool; the planner's allocation after the undrain:")
        cli(["tasks"])
        cli(["nodes"])
        cli(["incidents", "--limit", "15"])
        _say("cluster healthy, both tasks training; stopping")
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("demo", help="run the local self-healing demo (throwaway etcd, coordinator, 3 agents)")
    p.add_argument("--tls", action="store_true",
                   help="the secure variant: a cluster CA, etcd with TLS and per-role auth, mutual TLS everywhere")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    return run_demo(secure=args.tls)
