"""The agent link end to end: real etcd, a coordinator, three agents and gloo ranks.

Issue 19 item 13: a forged hello on the coordinator's link port (one line of TCP, then close) must
not take the node down. Issue 19 item 6: ``kill -TERM`` on an agent (``systemctl stop``) is a planned
stop: the agent says goodbye, the coordinator drains the node (its task moves to the others) with no
sev1 incident and no isolation, and the node is back in service once its agent registers again.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from coordinator import decision as d
from coordinator.statestore import read_state
from unicron.cli.main import main as cli
from unicron.cluster.localcluster import LocalCluster
from unicron.kernel.types import ErrorKind, Incident, Severity

WORKLOAD = [sys.executable, "-m", "unicron.runtime.workload", "--iter-time", "0.05", "--jitter", "0.1"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    # the stand-in workload (one fixed gloo world) cannot change its membership in place: a move relaunches it
    env = {"UNICRON_STATUS_INTERVAL": "0.2", "UNICRON_IN_PLACE_RESIZE": "0"}
    c = LocalCluster(agents=3, gpus_per_agent=2, extra_env=env,
                     prefork=["unicron.runtime.workload"])
    c.start()
    os.environ["UNICRON_ETCD"] = c.etcd.endpoint
    spec = tmp_path_factory.mktemp("spec") / "wl.json"
    spec.write_text(json.dumps({"name": "wl", "command": WORKLOAD, "min_gpus": 2}))
    try:
        assert cli(["submit", str(spec)]) == 0
        yield c
    finally:
        os.environ.pop("UNICRON_ETCD", None)
        c.stop()


def core(c: LocalCluster) -> d.CoreState:
    assert c.store is not None
    state, _, _ = read_state(c.store, c.keys)
    assert state is not None
    return state


def running_ranks(c: LocalCluster, generation: int) -> dict[str, int]:
    """node -> how many of the task's ranks of ``generation`` run there and report steps."""
    out: dict[str, int] = {}
    for n in c.node_names():
        for r in (c.agent_status(n) or {}).get("ranks", []):
            if (r.get("task") == "wl" and r.get("state") == "running" and r.get("generation") == generation
                    and isinstance(r.get("step"), int)):
                out[n] = out.get(n, 0) + 1
    return out


def wait_running(c: LocalCluster, timeout_s: float = 120.0) -> d.TaskEntry:
    def ready() -> d.TaskEntry | None:
        t = core(c).tasks.get("wl")
        if t is None or t.phase is not d.TaskPhase.RUNNING:
            return None
        placed = {n: len(r) for n, r in t.placement.items() if r}
        return t if placed and running_ranks(c, t.generation) == placed else None

    entry: d.TaskEntry = c.wait_for(ready, timeout_s, "the task to run on its placement", poll_s=0.2)
    return entry


def bad_incidents(c: LocalCluster, after: float) -> list[Incident]:
    return [i for i in c.incidents() if i.detected_ts >= after
            and (i.severity is Severity.SEV1 or i.kind is ErrorKind.LOST_CONNECTION)]


def leader_link(c: LocalCluster) -> tuple[str, int]:
    assert c.store is not None
    kv = c.store.get(c.keys.leader())
    assert kv is not None
    host, _, port = str(json.loads(kv.value)["link"]).rpartition(":")
    return host, int(port)


def test_forged_hello_does_not_take_a_node_down(cluster: LocalCluster) -> None:
    before = wait_running(cluster)
    victim = sorted(n for n, r in before.placement.items() if r)[0]
    t0 = time.time()
    for _ in range(3):  # the exact line of issue 19 item 13, then a guessed token
        for line in (json.dumps({"type": "hello", "node": victim}),
                     json.dumps({"type": "hello", "node": victim, "token": "guess"})):
            with socket.create_connection(leader_link(cluster)) as s:
                s.sendall(line.encode() + b"\n")
    time.sleep(3.0)  # far past the heartbeat timeout and any loss the close could have caused
    assert bad_incidents(cluster, t0) == []
    state = core(cluster)
    assert state.nodes[victim].status is d.NodeState.UP
    after = state.tasks["wl"]
    assert (after.generation, after.phase) == (before.generation, d.TaskPhase.RUNNING)
    assert any(str(r.get("event", "")).startswith("link hello refused") for r in cluster.coordinator_log(t0))


def test_planned_agent_stop_is_a_drain_not_a_failure(cluster: LocalCluster) -> None:
    before = wait_running(cluster)
    placed = sorted(n for n, r in before.placement.items() if r)
    assert len(placed) >= 2, before.placement  # the task must have somewhere else to go
    victim = placed[-1]
    t0 = time.time()
    proc = cluster.agents[victim]
    proc.send_signal(signal.SIGTERM)  # what systemctl stop does
    assert proc.wait(timeout=30) == 0

    def moved() -> d.TaskEntry | None:
        t = core(cluster).tasks["wl"]
        return t if t.generation > before.generation and not t.placement.get(victim) else None

    cluster.wait_for(moved, 30.0, f"the task to be re-planned off {victim}", poll_s=0.2)
    after = wait_running(cluster)
    assert victim not in after.placement or not after.placement[victim]
    state = core(cluster)
    assert state.nodes[victim].status is d.NodeState.DRAINED, state.nodes[victim]
    assert "stopped on purpose" in state.nodes[victim].reason
    time.sleep(2.0)  # the revoked lease's delete has long arrived; it must not be a loss either
    assert bad_incidents(cluster, t0) == []
    assert core(cluster).nodes[victim].status is d.NodeState.DRAINED

    # The agent comes back: a normal join, and the planned stop's drain is lifted.
    cluster.start_agent(victim)
    cluster.wait_registered(victim)
    cluster.wait_for(lambda: core(cluster).nodes[victim].status is d.NodeState.UP, 30.0,
                     f"{victim} back in service")
    wait_running(cluster)
    assert bad_incidents(cluster, t0) == []
    assert cluster.store is not None and cluster.store.get(cluster.keys.drain(victim)) is None


def test_an_operators_drain_outlives_a_planned_stop(cluster: LocalCluster) -> None:
    before = wait_running(cluster)
    victim = sorted(n for n, r in before.placement.items() if r)[-1]
    assert cli(["drain", victim]) == 0
    cluster.wait_for(lambda: not core(cluster).tasks["wl"].placement.get(victim), 30.0, f"the task off {victim}")
    t0 = time.time()
    proc = cluster.agents[victim]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    cluster.start_agent(victim)
    cluster.wait_registered(victim)
    time.sleep(1.0)
    state: Any = core(cluster)
    assert state.nodes[victim].status is d.NodeState.DRAINED  # only undrain ends an operator's drain
    assert state.nodes[victim].reason == "drained by an operator"
    assert bad_incidents(cluster, t0) == []
    assert cli(["undrain", victim]) == 0
    cluster.wait_for(lambda: core(cluster).nodes[victim].status is d.NodeState.UP, 30.0, f"{victim} undrained")
