"""Escalation end to end (paper Figure 7): every rank of a task crashes; the restart relaunches each
dead rank (widened across both nodes, one restart for the burst); the relaunched processes crash before
any iteration, so the restart fails and escalates to sev1 (node isolated on suspicion, task placed
elsewhere), and the restart budget ends the loop with the task marked failed and the reason given.
The task failed again elsewhere without progress, so the crashes were its own: every node it had
isolated is back in service. On the namespace cluster (root only)."""

from __future__ import annotations

import io
import json
import os
import sys
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

from tests.integration.hosts import require_netns
from unicron.cli.main import main as cli
from unicron.cluster.localcluster import LocalCluster


# The first process of each rank trains (reports) three iterations, then crashes; every later one
# crashes at once: progress never goes past step 2, and no restart ever makes progress.
def crasher(marks: Path) -> list[str]:
    return [sys.executable, "-c",
            "import os, sys, time\n"
            "from unicron.kernel.client import AgentClient\n"
            f"mark = os.path.join({str(marks)!r}, os.environ['RANK'])\n"
            "if os.path.exists(mark): sys.exit(4)\n"
            "open(mark, 'w').close()\n"
            "c = AgentClient.from_env().connect()\n"
            "for s in range(3):\n"
            "    with c.iteration(s): time.sleep(0.2)\n"
            "sys.exit(3)\n"]


def task(name: str) -> dict[str, Any]:
    buf = io.StringIO()
    with redirect_stdout(buf):
        cli(["tasks", "--json"])
    return next(t for t in json.loads(buf.getvalue()) if t["name"] == name)


def nodes() -> list[dict[str, Any]]:
    buf = io.StringIO()
    with redirect_stdout(buf):
        cli(["nodes", "--json"])
    return list(json.loads(buf.getvalue()))


def test_crash_loop_escalates_then_stops(tmp_path: Path) -> None:
    require_netns()
    env = {"UNICRON_RESTART_DEADLINE": "4", "UNICRON_STATUS_INTERVAL": "0.2"}
    with LocalCluster(agents=3, gpus_per_agent=2, extra_env=env, netns=True, prefork=[]) as c:  # torch-free ranks
        os.environ["UNICRON_ETCD"] = c.etcd.endpoint
        try:
            spec = tmp_path / "crash.json"
            spec.write_text(json.dumps({"name": "crash", "command": crasher(tmp_path), "min_gpus": 2,
                                        "recovery": "inprocess"}))
            assert cli(["submit", str(spec)]) == 0
            final = c.wait_for(lambda: (t := task("crash"))["phase"] in ("failed", "pending") and t, 150.0,
                               "the crash loop to end", poll_s=0.5)
            acts = [str(a["action"]) for a in c.actions()]
            assert "RestartRanks" in acts and "IsolateNode" in acts, acts
            assert acts.index("IsolateNode") > acts.index("RestartRanks")  # a failed restart escalates to sev1
            first_burst = acts[acts.index("RestartRanks"):acts.index("IsolateNode")]
            assert first_burst.count("RestartRanks") >= 2, acts  # every dead rank relaunched, not merged
            assert acts.count("Assign") >= 2  # ... and the task is placed again elsewhere
            assert final["phase"] == "failed", final  # before, every node could end isolated (pending)
            assert "MarkTaskFailed" in acts and "restart" in final["reason"]
            assert c.wait_for(lambda: all(n["state"] == "up" for n in nodes()), 10.0,
                              "every node back in service", poll_s=0.5)
        finally:
            os.environ.pop("UNICRON_ETCD", None)
