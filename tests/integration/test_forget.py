"""``unicron forget`` end to end: real etcd, a coordinator, two agents and a task of sleeping ranks.

A node retired for good (its agent killed, the node isolated by the lost link) kept ``assign/<node>``,
``results/<node>`` and ``state/nodes/<node>`` for ever, and ``unicron nodes`` listed it (review
reproduction). ``unicron forget`` removes them; a live node is refused in one line.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator import decision as d
from coordinator.statestore import read_state
from unicron.cli.main import main as cli
from unicron.cluster.localcluster import LocalCluster

SLEEPER = [sys.executable, "-c", "import time; time.sleep(3600)"]  # a stock command: no runtime, no torch


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    c = LocalCluster(agents=2, gpus_per_agent=2, extra_env={"UNICRON_STATUS_INTERVAL": "0.2"})
    c.start()
    os.environ["UNICRON_ETCD"] = c.etcd.endpoint
    try:
        yield c
    finally:
        os.environ.pop("UNICRON_ETCD", None)
        c.stop()


def core(c: LocalCluster) -> d.CoreState:
    assert c.store is not None
    state, _, _ = read_state(c.store, c.keys)
    assert state is not None
    return state


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_forget_removes_a_dead_node_and_refuses_a_live_one(cluster: LocalCluster, tmp_path: Path) -> None:
    spec = tmp_path / "sleeper.json"
    spec.write_text(json.dumps({"name": "sleeper", "command": SLEEPER, "min_gpus": 2}))
    assert run_cli("submit", str(spec))[0] == 0

    def running() -> d.TaskEntry | None:
        t = core(cluster).tasks.get("sleeper")
        return t if t is not None and t.phase is d.TaskPhase.RUNNING else None

    entry = cluster.wait_for(running, 60.0, "the task to run", poll_s=0.2)
    victim = next(n for n, r in entry.placement.items() if r)
    other = next(n for n in cluster.node_names() if n != victim)
    store, keys = cluster.store, cluster.keys
    assert store is not None
    victim_keys = (keys.assignment(victim), keys.result(victim), keys.state_node(victim))
    cluster.wait_for(lambda: all(store.get(k) is not None for k in victim_keys), 30.0, f"{victim}'s records")

    # a live node: refused, in one line saying what to do, and nothing changes
    code, out, err = run_cli("forget", victim)
    assert (code, out) == (1, "") and err == f"unicron forget: node {victim} is up; drain it and stop its agent first\n"
    assert victim in core(cluster).nodes

    # the node's agent dies for good: its link's loss isolates it, the task moves to the other node
    proc = cluster.agents[victim]
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    cluster.wait_for(lambda: core(cluster).nodes[victim].status is d.NodeState.ISOLATED, 30.0, f"{victim} isolated")
    cluster.wait_for(lambda: victim not in cluster.registered_nodes(), 30.0, f"{victim}'s lease to expire")
    cluster.wait_for(lambda: (t := running()) is not None and set(t.placement) == {other}, 60.0,
                     f"the task to run on {other}", poll_s=0.2)
    code, out, _ = run_cli("nodes", "--json")
    assert code == 0 and {r["node"]: r["state"] for r in json.loads(out)}[victim] == "isolated"

    code, out, err = run_cli("forget", victim)
    assert code == 0, err
    assert out.strip() == f"forgot node {victim}"
    assert [k for k in victim_keys if store.get(k) is not None] == []
    code, out, _ = run_cli("nodes", "--json")
    assert code == 0 and [r["node"] for r in json.loads(out)] == [other]
    assert victim not in core(cluster).nodes and running() is not None
    code, _, err = run_cli("forget", victim)  # gone: nothing left to forget
    assert code == 1 and err.count("\n") == 1 and f"no node '{victim}'" in err
