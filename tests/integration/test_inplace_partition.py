"""A partitioned node that does not host the task's store, end to end on the namespace cluster (every
node a host of its own; root only, skipped otherwise): the coordinator resizes the task in place around
it, the agents name its ranks lost to the survivors (``PeersLost``), and the survivors cut their
connections to its host (:mod:`unicron.runtime.hostloss`) and go on in their own processes.

A cut-off host answers nothing, so before the cut the survivors sat in their collective with its rank
until the collective timeout. The ranks here run with a 300 s one, so within the test's wait only the
cut can get them past it (the resize soak's partitions took 30.5 s, its 30 s timeout, before).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.hosts import require_netns
from tests.integration.test_inplace import ARGS, stepping, store_node
from unicron.cli.main import main as cli
from unicron.cluster.localcluster import LocalCluster

#: longer than any wait below: a survivor past the partition got there by the cut
COLLECTIVE_TIMEOUT_S = 300


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    require_netns()
    with LocalCluster(agents=3, gpus_per_agent=1, netns=True, extra_env={"UNICRON_STATUS_INTERVAL": "0.2"}) as c:
        os.environ["UNICRON_ETCD"] = c.etcd.endpoint
        try:
            yield c
        finally:
            os.environ.pop("UNICRON_ETCD", None)


@pytest.mark.slow
def test_survivors_cut_a_partitioned_peer_off_instead_of_waiting_for_their_collective_timeout(
        cluster: LocalCluster, tmp_path: Path) -> None:
    c = cluster
    command = [sys.executable, "-m", "unicron.runtime.train", "--iterations", "0", *ARGS,
               "--collective-timeout", str(COLLECTIVE_TIMEOUT_S), "--regroup-timeout", str(2 * COLLECTIVE_TIMEOUT_S),
               "--out-dir", str(tmp_path / "out")]
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps({"name": "job", "command": command, "min_gpus": 1,
                                "env": {"UNICRON_LOG_LEVEL": "INFO"}}))  # the ranks' cut lines, in their agents' logs
    assert cli(["submit", str(spec)]) == 0
    before = stepping(c, {0, 1, 2}, 3, timeout=120.0)
    victim = next(n for n in c.node_names() if n != store_node(c))
    lost = next(r for r, v in before.items() if v["node"] == victim)
    survivors = {r: v for r, v in before.items() if r != lost}
    t0 = time.time()
    c.partition(victim)
    try:
        past = max(int(v.get("step") or 0) for v in c.running_ranks("job").values())  # in lockstep with the victim
        after = stepping(c, set(survivors), past + 3, timeout=90.0)
    finally:
        c.heal(victim)
    assert {r: v["pid"] for r, v in after.items()} == {r: v["pid"] for r, v in survivors.items()}, "a survivor restarted"
    actions = [str(a["action"]) for a in c.actions(t0)]
    assert "ResizeInPlace" in actions and not {"Assign", "RestartTask"} & set(actions), actions
    victim_ip = c.host_ip(victim)
    for node in {v["node"] for v in survivors.values()}:
        text = (Path(c.run_dir) / f"agent-{node}.log").read_text(errors="replace")
        cuts = [line for line in text.splitlines() if "cut the connections to a lost host" in line]
        assert any(victim_ip in line for line in cuts), f"{node}'s rank did not cut {victim_ip}: {cuts}"
