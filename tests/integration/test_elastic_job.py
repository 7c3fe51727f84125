"""An elastic stock job end to end (issue 14 item 2): real etcd, a coordinator, three agents (one GPU
each) and ``examples/stock_gloo_ckpt.py`` with ``"min_gpus": 2, "max_gpus": 3``. Its third node's agent
is killed (the node is lost, sev1): the job is relaunched on the two nodes left at world size 2, as the
next attempt (TORCHELASTIC_RESTART_COUNT 1), resumes from its checkpoint and finishes."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from unicron.cli.main import main as cli
from unicron.cluster.localcluster import LocalCluster

ROOT = Path(__file__).resolve().parents[2]
STEPS = 16
START = re.compile(r"^start rank (\d+) pid (\d+) restart_count (\d+) resume_step (\d+)$")
STEP = re.compile(r"^step (\d+) rank (\d+)/(\d+) ")


def test_a_lost_node_relaunches_an_elastic_job_at_a_smaller_world_size(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"UNICRON_STATUS_INTERVAL": "0.2", "UNICRON_RESTART_DEADLINE": "30"}
    with LocalCluster(agents=3, gpus_per_agent=1, extra_env=env, prefork=["unicron.runtime.workload"]) as c:
        monkeypatch.setenv("UNICRON_ETCD", c.etcd.endpoint)
        spec = tmp_path / "elastic.json"
        spec.write_text(json.dumps({
            "name": "elastic", "min_gpus": 2, "max_gpus": 3, "recovery": "restart",
            "command": [sys.executable, str(ROOT / "examples" / "stock_gloo_ckpt.py"), "--steps", str(STEPS),
                        "--step-time", "0.4", "--ckpt-dir", str(tmp_path / "ckpt")],
            "env": {"UNICRON_PROGRESS_REGEX": r"^step (?P<iteration>\d+) "},
        }))
        assert cli(["submit", str(spec)]) == 0

        def lines(rank: int) -> list[str]:
            path = Path(c.run_dir, "logs", "elastic", f"rank{rank}.log")
            return path.read_text(errors="replace").splitlines() if path.exists() else []

        def worlds(rank: int) -> list[tuple[int, int]]:
            """(step, world size) of each step line of ``rank``."""
            return [(int(m[1]), int(m[3])) for line in lines(rank) if (m := STEP.match(line))]

        c.wait_for(lambda: all(len(worlds(r)) >= 3 for r in range(3)), 60.0, "three steps at world size 3",
                   poll_s=0.1)
        assert {w for r in range(3) for _, w in worlds(r)} == {3}  # max_gpus: the whole cluster
        node = str(c.running_ranks("elastic")[2]["node"])
        c.agents[node].kill()  # the node is gone; its rank dies with its agent
        c.agents[node].wait()
        c.wait_for(lambda: lines(0) and lines(0)[-1] == "done rank 0", 90.0, "the job to finish at world size 2",
                   poll_s=0.2)
        for rank in (0, 1):
            starts = [(int(m[3]), int(m[4])) for line in lines(rank) if (m := START.match(line))]
            assert starts[0] == (0, 0) and starts[-1][0] == 1, starts  # relaunched once, as attempt 1
            text = lines(rank)
            second = max(i for i, line in enumerate(text) if START.match(line))
            killed_at = max(int(m[1]) for line in text[:second] if (m := STEP.match(line)))  # attempt 0's last
            # from its checkpoint: at most the step in flight, which rank 0 may have saved before the
            # barrier that the dead rank never reached (so its line was never printed)
            assert 0 < starts[-1][1] <= killed_at + 2, (starts, killed_at)
            after = [w for s, w in worlds(rank)[len(worlds(rank)) - (STEPS - starts[-1][1]):]]
            assert set(after) == {2} and worlds(rank)[-1] == (STEPS - 1, 2), worlds(rank)
        assigns = [a for a in c.actions() if a["action"] == "Assign"]
        assert [a.get("world_size") for a in assigns][-1] == 2, assigns
        assert c.node_state(node) in ("lost", "isolated")
