"""A job on the in-place API end to end: real etcd, a coordinator, two agents (one rank each) and
``examples/pretrain_mlp.py`` (a plain PyTorch MLP through ``unicron.runtime.pretrain``) submitted with
``"recovery": "inprocess"``. One rank is SIGKILLed mid-run: only that rank is relaunched (a new pid), it
rejoins the running job and trains again, and the survivor is the same process throughout (no
restart of the job, no reconfiguration)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from unicron.cli.main import main as cli
from unicron.cluster.localcluster import LocalCluster

ROOT = Path(__file__).resolve().parents[2]


def test_a_killed_rank_of_an_api_job_is_relaunched_alone_and_rejoins(tmp_path: Path) -> None:
    env = {"UNICRON_STATUS_INTERVAL": "0.2", "UNICRON_RESTART_DEADLINE": "60"}
    with LocalCluster(agents=2, gpus_per_agent=1, extra_env=env) as c:
        os.environ["UNICRON_ETCD"] = c.etcd.endpoint
        try:
            spec = tmp_path / "mlp.json"
            command = [sys.executable, str(ROOT / "examples" / "pretrain_mlp.py"), "--iterations", "0",
                       "--iter-sleep", "0.05", "--global-batch-size", "16", "--micro-batch-size", "4"]
            spec.write_text(json.dumps({"name": "mlp", "command": command, "min_gpus": 2, "recovery": "inprocess",
                                        "env": {"PYTHONPATH": str(ROOT)}}))  # this checkout's unicron
            assert cli(["submit", str(spec)]) == 0

            def stepping(least: int) -> bool:
                ranks = c.running_ranks("mlp")
                return len(ranks) == 2 and all(isinstance(r.get("step"), int) and r["step"] >= least
                                               for r in ranks.values())

            c.wait_for(lambda: stepping(5), 120.0, "both ranks to train", poll_s=0.2)
            before = c.running_ranks("mlp")
            victim, survivor = before[1], before[0]
            t0 = time.time()
            os.kill(int(victim["pid"]), signal.SIGKILL)

            def rejoined() -> bool:
                back = c.running_ranks("mlp").get(1)
                return back is not None and back["pid"] != victim["pid"] and isinstance(back.get("step"), int)

            c.wait_for(rejoined, 180.0, "the relaunched rank to rejoin and train", poll_s=0.2)
            top = max(int(r["step"]) for r in c.running_ranks("mlp").values())
            c.wait_for(lambda: stepping(top + 3), 60.0, "both ranks to train on together", poll_s=0.2)
            assert c.running_ranks("mlp")[0]["pid"] == survivor["pid"], "the survivor must not be restarted"
            acts = [str(a["action"]) for a in c.actions(t0)]
            assert "RestartRanks" in acts, acts
            assert "RestartTask" not in acts and "Assign" not in acts, acts
        finally:
            os.environ.pop("UNICRON_ETCD", None)
