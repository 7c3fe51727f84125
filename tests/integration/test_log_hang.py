"""docs/jobs.md's second way, end to end: real etcd, a coordinator, an agent, and the documented spec
``examples/megatron_log.json`` (a job that prints Megatron-LM's progress lines and nothing else Unicron
reads). SIGSTOPped, it is detected as hung from its lines alone (a ``task_hang`` incident recorded by
the coordinator), and under ``recovery: "restart"`` it is stopped and relaunched as the next attempt."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from unicron.cli.main import main as cli
from unicron.cluster.localcluster import LocalCluster
from unicron.kernel.types import DetectionMethod, ErrorKind

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "examples" / "megatron_log.json"


def test_the_documented_megatron_log_job_is_detected_hung_when_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the spec's paths are relative to the agent's directory, the repository
    name = json.loads(SPEC.read_text())["name"]
    with LocalCluster(agents=1, gpus_per_agent=1, extra_env={"UNICRON_STATUS_INTERVAL": "0.2"}) as c:
        monkeypatch.setenv("UNICRON_ETCD", c.etcd.endpoint)
        assert cli(["submit", str(SPEC)]) == 0
        log = Path(c.run_dir, "logs", name, "rank0.log")

        def lines() -> list[str]:
            return log.read_text(errors="replace").splitlines() if log.exists() else []

        # the agent arms hang detection after its warm-up (5 iterations) and 5 samples
        c.wait_for(lambda: len(lines()) >= 12, 60.0, "the job's progress lines", poll_s=0.05)
        rank = c.running_ranks(name)[0]
        pid, last = int(rank["pid"]), len(lines())
        t0 = time.time()
        os.kill(pid, signal.SIGSTOP)
        inc = c.wait_incident(lambda i: i.kind is ErrorKind.TASK_HANG and i.task == name, timeout_s=30.0, after=t0)
        assert inc.method is DetectionMethod.STATISTICAL_MONITORING and inc.rank == 0
        assert inc.step is not None and last - 1 <= inc.step <= last + 1  # the iteration of its last line
        assert "mean iteration time 0.200 s" in inc.message  # Megatron's own elapsed time per iteration
        # Restarted as a whole: the stopped process is gone and a new one prints from iteration 1 again.
        c.wait_for(lambda: (r := c.running_ranks(name).get(0)) and int(r["pid"]) != pid, 30.0, "the relaunched rank")
        c.wait_for(lambda: any(" iteration        1/" in line for line in lines()[last:]), 30.0,
                   "the relaunched job's first line")
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        acts = [a["action"] for a in c.actions(t0)]
        assert acts.count("RestartTask") == 1 and "IsolateNode" not in acts, acts


def test_the_docs_show_the_example_specs_as_they_are() -> None:
    # docs/jobs.md quotes each example spec that the end-to-end tests run: they must not drift apart.
    text = (ROOT / "docs" / "jobs.md").read_text()
    blocks = [json.loads(b.split("```", 1)[0]) for b in text.split("```json\n")[1:]]
    for name in ("stock_gloo_ckpt.json", "megatron_log.json"):
        assert f"`examples/{name}`" in text
        assert json.loads((ROOT / "examples" / name).read_text()) in blocks, name
