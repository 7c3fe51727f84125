"""The whole agent -> coordinator contract end to end (issue #12 item 3): real etcd, a coordinator and
agents running the control-plane workload.

* every rank of a task exits 0 -> TaskFinished -> its GPUs go to a pending task;
* a reconcile that fails (a command that cannot start) -> ActionFailed at once, not at a deadline;
  the task ends failed with the reason and no node is isolated.
"""

from __future__ import annotations

import io
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from unicron.cli.main import main as cli
from unicron.cluster.localcluster import LocalCluster

RESTART_DEADLINE_S = 60.0


def workload(iterations: int) -> list[str]:
    return [sys.executable, "-m", "unicron.runtime.workload", "--iter-time", "0.05", "--jitter", "0",
            "--iterations", str(iterations)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """One cluster for the module (a start costs seconds): each test leaves it with no task."""
    env = {"UNICRON_STATUS_INTERVAL": "0.2", "UNICRON_RESTART_DEADLINE": str(int(RESTART_DEADLINE_S))}
    with LocalCluster(agents=2, gpus_per_agent=2, extra_env=env, prefork=["unicron.runtime.workload"]) as c:
        os.environ["UNICRON_ETCD"] = c.etcd.endpoint
        try:
            yield c
        finally:
            os.environ.pop("UNICRON_ETCD", None)


def submit(tmp: Path, spec: dict[str, Any]) -> None:
    path = tmp / f"{spec['name']}.json"
    path.write_text(json.dumps(spec))
    assert cli(["submit", str(path)]) == 0


def listing(what: str) -> list[dict[str, Any]]:
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert cli([what, "--json"]) == 0
    out: list[dict[str, Any]] = json.loads(buf.getvalue())
    return out


def task(name: str) -> dict[str, Any]:
    return next(t for t in listing("tasks") if t["name"] == name)


def test_a_finished_task_releases_its_gpus_to_a_pending_one(cluster: LocalCluster, tmp_path: Path) -> None:
    # "first" needs every GPU; "second" waits for them
    submit(tmp_path, {"name": "first", "command": workload(40), "min_gpus": 4})
    cluster.wait_for(lambda: task("first")["phase"] in ("reconfiguring", "running"), 60.0, "first to be placed")
    submit(tmp_path, {"name": "second", "command": workload(0), "min_gpus": 4})
    assert task("second")["phase"] == "pending"
    cluster.wait_for(lambda: task("first")["phase"] == "finished", 90.0, "first to finish", poll_s=0.2)
    cluster.wait_for(lambda: task("second")["gpus"] == 4, 60.0, "second to get the GPUs", poll_s=0.2)

    def second_runs() -> bool:
        st = [cluster.agent_status(n) or {} for n in cluster.node_names()]
        return sum(1 for s in st for r in s.get("ranks", [])
                   if r.get("task") == "second" and r.get("state") == "running") == 4
    cluster.wait_for(second_runs, 60.0, "second's ranks to run", poll_s=0.2)
    assert all(n["state"] == "up" for n in listing("nodes"))
    assert cli(["cancel", "second"]) == 0  # its GPUs go back to the pool for the next test
    cluster.wait_for(lambda: task("second")["phase"] == "cancelled", 30.0, "second to be cancelled")


def test_a_command_that_cannot_start_fails_the_task_at_once(cluster: LocalCluster, tmp_path: Path) -> None:
    t0 = time.monotonic()
    submit(tmp_path, {"name": "broken", "command": ["/nonexistent/binary"], "min_gpus": 2})
    final = cluster.wait_for(lambda: (t := task("broken"))["phase"] == "failed" and t, RESTART_DEADLINE_S,
                             "the task to fail", poll_s=0.2)
    took = time.monotonic() - t0
    assert took < RESTART_DEADLINE_S / 3, took  # by the agents' results, not by a deadline
    assert "cannot start" in final["reason"], final
    assert all(n["state"] == "up" for n in listing("nodes")), listing("nodes")
