"""The task set and the decisions survive a coordinator restart; the agents are not disturbed."""

from __future__ import annotations

import io
import json
import os
import signal
import sys
from contextlib import redirect_stdout
from typing import Any

from unicron.cli.main import main as cli
from unicron.cluster.localcluster import LocalCluster

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


def tasks_json() -> list[dict[str, Any]]:
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert cli(["tasks", "--json"]) == 0
    return list(json.loads(buf.getvalue()))


def rank_pids(c: LocalCluster) -> dict[int, int]:
    out: dict[int, int] = {}
    for n in c.node_names():
        for r in (c.agent_status(n) or {}).get("ranks", []):
            if r.get("state") == "running":
                out[int(r["rank"])] = int(r["pid"])
    return out


def test_task_set_survives_a_coordinator_restart(tmp_path: Any) -> None:
    with LocalCluster(agents=3, gpus_per_agent=2, prefork=[]) as c:  # sleeper ranks: no spawner to warm
        os.environ["UNICRON_ETCD"] = c.etcd.endpoint
        try:
            spec = tmp_path / "t.json"
            spec.write_text(json.dumps({"name": "keep", "command": SLEEPER, "weight": 1.5, "min_gpus": 2}))
            assert cli(["submit", str(spec)]) == 0
            c.wait_for(lambda: (t := tasks_json()) and t[0]["gpus"] >= 2 and len(rank_pids(c)) == t[0]["gpus"],
                       60.0, "all the task's processes")
            before, pids = tasks_json(), rank_pids(c)
            assert c.coordinator is not None and c.store is not None
            old_leader = c.store.get(c.keys.leader())
            os.kill(c.coordinator.pid, signal.SIGKILL)
            c.coordinator.wait()
            c.wait_for(lambda: c.store.get(c.keys.leader()) is None, 15.0, "the old leadership to expire")  # type: ignore[union-attr]
            c.start_coordinator()
            new_leader = c.store.get(c.keys.leader())
            assert new_leader is not None and old_leader is not None
            assert new_leader.create_revision != old_leader.create_revision  # a new fencing token
            after = c.wait_for(lambda: tasks_json() or None, 30.0, "the new leader's task list")
            assert [(t["name"], t["weight"], t["generation"], t["gpus"]) for t in after] == \
                [(t["name"], t["weight"], t["generation"], t["gpus"]) for t in before]
            assert rank_pids(c) == pids  # the agents kept their ranks: nothing was re-placed
        finally:
            os.environ.pop("UNICRON_ETCD", None)
