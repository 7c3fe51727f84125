"""The secure variant of the local cluster, end to end: etcd with TLS, --client-cert-auth and per-role
auth, the agent link and the API on mutual TLS; an operator submits a task and it runs; a node's
certificate cannot submit, and a plaintext client gets nothing.

Where network namespaces can be made (root; CI), on the multi-host cluster with etcd as 3 members:
every certificate then has to name its holder's own address, and etcd's members talk TLS to each
other; elsewhere on loopback with one member."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from unicron.cli.main import main as cli
from unicron.cluster.localcluster import STEPPER, LocalCluster
from unicron.cluster.netns import unavailable_reason


def tasks(*extra: str) -> list[dict[str, Any]]:
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert cli(["tasks", "--json", *extra]) == 0
    out: list[dict[str, Any]] = json.loads(buf.getvalue())
    return out


def test_a_task_runs_over_tls_and_strangers_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    netns = unavailable_reason() is None
    with LocalCluster(agents=2, gpus_per_agent=1, tls=True, extra_env={"UNICRON_STATUS_INTERVAL": "0.2"},
                      netns=netns, etcd_members=3 if netns else 1, prefork=[]) as c:  # torch-free ranks
        monkeypatch.setenv("UNICRON_ETCD", c.etcd.endpoint)
        spec = tmp_path / "s1.json"
        spec.write_text(json.dumps({"name": "s1", "command": STEPPER, "min_gpus": 2}))

        assert cli(["submit", str(spec), "--timeout", "3"]) == 1  # plaintext: etcd will not talk to it
        assert "cannot reach etcd" in capsys.readouterr().err

        monkeypatch.setenv("UNICRON_TLS_DIR", c.tls_dir)
        assert cli(["submit", str(spec), "--tls-name", "node0"]) == 1
        assert "refused this certificate" in capsys.readouterr().err

        assert cli(["submit", str(spec)]) == 0  # the operator's certificate
        running = c.wait_for(lambda: next((t for t in tasks() if t["phase"] == "running" and t["step"]), None),
                             60.0, "s1 to run over TLS", poll_s=0.3)
        assert sorted(running["nodes"]) == c.node_names()
        assert sorted(c.running_ranks("s1")) == [0, 1]
        warnings = [r for r in c.coordinator_log() if str(r.get("event", "")).startswith("plaintext")]
        assert warnings == []  # the secure variant does not warn
