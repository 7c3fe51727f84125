"""Escalation end to end (paper Figure 7): a task whose rank keeps crashing is restarted, the failed
restart escalates to sev1 (node isolated, task placed elsewhere), and the restart budget ends the loop
with the task marked failed and the reason given."""

from __future__ import annotations

import io
import json
import os
import sys
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

from unicron.cli.main import main as cli
from unicron.cluster.localcluster import LocalCluster

# Trains (reports) three iterations, then crashes: progress never goes past step 2.
CRASHER = [sys.executable, "-c",
           "import time, sys\n"
           "from unicron.kernel.client import AgentClient\n"
           "c = AgentClient.from_env().connect()\n"
           "for s in range(3):\n"
           "    with c.iteration(s): time.sleep(0.2)\n"
           "sys.exit(3)\n"]


def task(name: str) -> dict[str, Any]:
    buf = io.StringIO()
    with redirect_stdout(buf):
        cli(["tasks", "--json"])
    return next(t for t in json.loads(buf.getvalue()) if t["name"] == name)


def actions(c: LocalCluster) -> list[str]:
    out = []
    for line in Path(c.run_dir, "coordinator.log").read_text(errors="replace").splitlines():
        if '"event": "action"' in line:
            out.append(str(json.loads(line)["action"]))
    return out


def test_crash_loop_escalates_then_stops(tmp_path: Path) -> None:
    env = {"UNICRON_RESTART_DEADLINE": "4", "UNICRON_STATUS_INTERVAL": "0.2"}
    with LocalCluster(agents=3, gpus_per_agent=2, extra_env=env) as c:
        os.environ["UNICRON_ETCD"] = c.etcd.endpoint
        try:
            spec = tmp_path / "crash.json"
            spec.write_text(json.dumps({"name": "crash", "command": CRASHER, "min_gpus": 2}))
            assert cli(["submit", str(spec)]) == 0
            final = c.wait_for(lambda: (t := task("crash"))["phase"] in ("failed", "pending") and t, 150.0,
                               "the crash loop to end", poll_s=0.5)
            acts = actions(c)
            assert "RestartRanks" in acts  # sev2: restart in place first
            assert acts.index("IsolateNode") > acts.index("RestartRanks")  # a failed restart escalates to sev1
            assert acts.count("Assign") >= 2  # ... and the task is placed again elsewhere
            if final["phase"] == "failed":
                assert "MarkTaskFailed" in acts and "restart" in final["reason"]
            else:  # every node got isolated before the budget ran out: nothing left to run on
                assert "waiting for GPUs" in final["reason"]
        finally:
            os.environ.pop("UNICRON_ETCD", None)
