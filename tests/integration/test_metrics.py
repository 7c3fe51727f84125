"""Metrics and recovery cost end to end (issue 17 items 3-4): a real etcd, coordinator and agents
serving /metrics; a rank SIGKILLed (a real fault) becomes a sev2 incident whose restart is recorded
with its Eq. 1 cost, in etcd, in the CLI and in the scraped metrics; the Grafana dashboard queries
only metrics the daemons export."""

from __future__ import annotations

import io
import json
import os
import re
import time
import urllib.request
from collections.abc import Iterator
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from unicron.cli.main import main as cli
from unicron.cluster.localcluster import STEPPER, LocalCluster
from unicron.kernel.inject import Injection, request
from unicron.kernel.types import ErrorKind, Incident, Severity

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "unicron.json"
TIMEOUT_S = 30.0


SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created"),
            "gauge": ("",), "summary": ("_count", "_sum"), "unknown": ("",)}


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    c = LocalCluster(agents=2, gpus_per_agent=1, metrics=True, extra_env={"UNICRON_STATUS_INTERVAL": "0.2"},
                     prefork=[])  # torch-free ranks
    c.start()
    os.environ["UNICRON_ETCD"] = c.etcd.endpoint
    try:
        yield c
    finally:
        os.environ.pop("UNICRON_ETCD", None)
        c.stop()


def scrape(c: LocalCluster, who: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """sample name -> [(labels, value)]; every name a family declares is a key (possibly empty)."""
    with urllib.request.urlopen(c.metrics_url(who), timeout=5.0) as reply:
        text = reply.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for suffix in SUFFIXES.get(family.type, ("",)):
            out.setdefault(family.name + suffix, [])
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    return sum(v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))


def cli_json(*argv: str) -> Any:
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert cli([*argv, "--json"]) == 0
    return json.loads(buf.getvalue())


def test_dashboard_queries_only_exported_metrics(cluster: LocalCluster) -> None:
    exported = set(scrape(cluster, "coordinator"))
    for node in cluster.node_names():
        exported |= set(scrape(cluster, node))
    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
    referenced = {m for e in exprs for m in re.findall(r"\bunicron_[a-z0-9_]+", e)}
    assert len(referenced) >= 15, referenced
    missing = sorted(referenced - exported)
    assert not missing, f"the dashboard queries metrics no daemon exports: {missing}"


def test_killed_rank_restart_is_costed_and_counted(cluster: LocalCluster, tmp_path: Path) -> None:
    spec = tmp_path / "m1.json"
    spec.write_text(json.dumps({"name": "m1", "command": STEPPER, "min_gpus": 1, "recovery": "inprocess"}))
    assert cli(["submit", str(spec)]) == 0
    task = cluster.wait_for(
        lambda: next((t for t in cli_json("tasks") if t["name"] == "m1" and t["phase"] == "running"
                      and t["step"] is not None), None), TIMEOUT_S, "m1 to run", poll_s=0.3)
    node = task["nodes"][0]
    before = scrape(cluster, "coordinator")
    sev2 = {"severity": "sev2", "kind": ErrorKind.EXITED_ABNORMALLY.value}

    assert cluster.store is not None
    t0 = time.time()
    answer = request(cluster.store, cluster.keys, node, Injection.from_dict({"fault": "kill-rank", "task": "m1"}))
    assert answer.ok, answer.detail

    def restarted() -> Incident | None:
        found = [i for i in cluster.incidents() if i.detected_ts >= t0 and i.kind is ErrorKind.EXITED_ABNORMALLY]
        return found[0] if found and found[0].transition_s is not None else None

    inc: Incident = cluster.wait_for(restarted, TIMEOUT_S, "the restart's incident to be costed", poll_s=0.2)
    print(f"sev2 restart costed: detection_s={inc.detection_s:.4f} transition_s={inc.transition_s:.3f} "
          f"sub_healthy_s={inc.sub_healthy_s}")
    assert inc.severity is Severity.SEV2 and inc.action == "restart" and inc.tasks == ["m1"]
    assert inc.detection_s is not None and 0 < inc.detection_s < TIMEOUT_S
    assert inc.transition_s is not None and 0 < inc.transition_s < TIMEOUT_S
    assert inc.sub_healthy_s == 0.0  # the restarted rank runs on the GPU it had
    assert inc.action_ts is not None and inc.recovered_ts == pytest.approx(inc.action_ts + inc.transition_s)

    shown = next(i for i in cli_json("incidents") if i["incident_id"] == inc.incident_id)
    assert shown["transition_s"] == inc.transition_s
    costed = next(t for t in cli_json("tasks") if t["name"] == "m1")
    assert costed["incidents"] >= 1 and costed["recovery_s"] >= round(inc.recovery_s, 3) > 0

    after = scrape(cluster, "coordinator")
    assert value(after, "unicron_incidents_total", **sev2) == value(before, "unicron_incidents_total", **sev2) + 1
    assert value(after, "unicron_transition_seconds_count", action="restart") >= 1
    assert value(after, "unicron_detection_seconds_count", action="restart") >= 1
    assert value(after, "unicron_task_recovery_seconds_total", task="m1") >= inc.recovery_s - 1e-6
    assert value(after, "unicron_task_gpus", task="m1") >= 1
    assert value(after, "unicron_nodes", state="up") == 2
    assert set(lab["node"] for lab, _ in after["unicron_heartbeat_age_seconds"]) == set(cluster.node_names())
    assert value(after, "unicron_leader") == 1
    agent = scrape(cluster, node)
    assert value(agent, "unicron_agent_rank_restarts_total", task="m1") >= 1
    assert value(agent, "unicron_agent_reports_total", kind=ErrorKind.EXITED_ABNORMALLY.value) >= 1
    assert value(agent, "unicron_agent_report_queue_depth") == 0
