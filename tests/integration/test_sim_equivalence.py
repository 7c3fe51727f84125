"""The simulator and the live coordinator take the same actions for the same events (issue 15).

One scenario, run both ways: a task is submitted to 3 nodes x 2 GPUs; a rank is killed (sev2); once
it recovered, the agent of a node the task runs on is killed (sev1, the node lost). Live: real
etcd, a coordinator, three agents and the task's processes (a small script reporting iterations through
the agent, so that the test stays lean), faults by SIGKILL. Simulated: ``sim.unicron.UnicronSim`` with
the same task spec and a trace of the same two failures. Compared: each action's kind, task and node.
"""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

from coordinator.tasks import parse_task_spec
from sim.costs import CostSettings
from sim.trace import Failure, Trace, node_name
from sim.unicron import UnicronSim
from sim.workload import Workload
from unicron.cli.main import main as cli
from unicron.cluster.localcluster import LocalCluster

MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32, "vocab_size": 128,
         "global_batch_size": 32, "micro_batch_size": 4}
# Steps count from the wall clock, so a relaunched rank reports a step past the fault (which is what
# confirms a restart) without a checkpoint.
JOB = [sys.executable, "-c",
       "import time\n"
       "from unicron.kernel.client import AgentClient\n"
       "c = AgentClient.from_env().connect()\n"
       "while True:\n"
       "    s = int(time.time() * 10)\n"
       "    with c.iteration(s): time.sleep(0.1)\n"]
SPEC: dict[str, Any] = {"name": "job", "command": JOB, "min_gpus": 2, "model": MODEL, "recovery": "inprocess"}
NODES, GPUS = 3, 2
HOUR = 3600.0

Step = tuple[str, str | None, str | None]  # action kind, task, node


def _key(kind: str, task: object, node: object) -> Step:
    return kind, task if isinstance(task, str) else None, node if isinstance(node, str) else None


def simulated(restart_node: int, lost_node: int) -> list[Step]:
    spec = parse_task_spec(SPEC, None, gpus_per_node=GPUS)
    workload = Workload("equivalence", [spec], NODES, GPUS)
    failures = (Failure(HOUR, node_name(restart_node), 0, 2, "exited_abnormally"),
                Failure(2 * HOUR, node_name(lost_node), 0, 1, "lost_connection", repair_s=100 * HOUR))
    sim = UnicronSim(workload, Trace("equivalence", 3 * HOUR, NODES, GPUS, failures), CostSettings())
    sim.run()
    live_name = {node_name(i): f"node{i}" for i in range(NODES)}  # the harness names nodes node0...
    return [_key(type(a).__name__, getattr(a, "task", None), live_name.get(getattr(a, "node", None) or ""))
            for a in sim.actions_log]


def _actions(c: LocalCluster) -> list[Step]:
    return [_key(str(a["action"]), a.get("task"), a.get("node")) for a in c.actions()]


def _task(name: str) -> dict[str, Any]:
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert cli(["tasks", "--json"]) == 0
    return next(t for t in json.loads(buf.getvalue()) if t["name"] == name)


def _ranks(c: LocalCluster) -> dict[int, dict[str, Any]]:
    return c.running_ranks("job")


def _progressing(c: LocalCluster, after: float) -> bool:
    ranks = _ranks(c)
    return bool(ranks) and all(isinstance(r.get("step"), int) and r["step"] > after * 10 for r in ranks.values())


def test_the_simulator_and_the_live_coordinator_take_the_same_actions(tmp_path: Path) -> None:
    env = {"UNICRON_STATUS_INTERVAL": "0.2", "UNICRON_RESTART_DEADLINE": "30"}
    with LocalCluster(agents=NODES, gpus_per_agent=GPUS, extra_env=env, prefork=[]) as c:  # torch-free ranks
        os.environ["UNICRON_ETCD"] = c.etcd.endpoint
        try:
            spec = tmp_path / "job.json"
            spec.write_text(json.dumps(SPEC))
            t0 = time.time()
            assert cli(["submit", str(spec)]) == 0
            c.wait_for(lambda: _progressing(c, t0), 60.0, "the task to run", poll_s=0.2)
            # sev2: a rank killed; wait until its relaunch reports progress
            victim = min(_ranks(c).values(), key=lambda r: (r["node"], r["rank"]))
            t1 = time.time()
            os.kill(int(victim["pid"]), signal.SIGKILL)
            c.wait_for(lambda: any(a[0] == "RestartRanks" for a in _actions(c)), 30.0, "the restart", poll_s=0.2)
            c.wait_for(lambda: (r := _ranks(c).get(victim["rank"])) and r["pid"] != victim["pid"]
                       and _progressing(c, t1), 60.0, "the restarted rank to train", poll_s=0.2)
            time.sleep(1.0)  # the coordinator confirms the restart from the next status
            # sev1: a node of the task (its last, by name) loses its agent
            lost = max(r["node"] for r in _ranks(c).values())
            t2 = time.time()
            os.kill(c.agents[lost].pid, signal.SIGKILL)
            c.wait_for(lambda: _ranks(c) and lost not in {r["node"] for r in _ranks(c).values()}
                       and _progressing(c, t2), 90.0, "the task to run without the lost node", poll_s=0.2)
            live = _actions(c)
            # `unicron tasks` shows what the planner now uses: the reconfiguration's measured transition
            # and the FLOP/s the ranks achieve (model FLOPs per step x the steps per second they report)
            row = c.wait_for(lambda: (t := _task("job"))["transition_s"] is not None
                             and t["achieved_flops"] is not None and t, 30.0, "measured planner inputs", poll_s=0.5)
            assert 0 < row["transition_s"] < 90 and row["achieved_flops"] > 0
        finally:
            os.environ.pop("UNICRON_ETCD", None)
    sim = simulated(int(victim["node"].removeprefix("node")), int(lost.removeprefix("node")))
    assert live == sim, f"live {live}\nsim  {sim}"
    kinds = [k for k, _, _ in live]
    # the lost node is not rank 0's: the task shrinks in place (a ResizeInPlace, not a second Assign)
    assert kinds.count("Assign") + kinds.count("ResizeInPlace") >= 2 and "RestartRanks" in kinds
    assert "IsolateNode" in kinds
