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


def submit(c: LocalCluster, tmp_path: Path) -> dict[int, dict[str, object]]:
    """The in-place task on every node, its ranks with the long collective timeout; once they step."""
    command = [sys.executable, "-m", "unicron.runtime.train", "--iterations", "0", *ARGS,
               "--collective-timeout", str(COLLECTIVE_TIMEOUT_S), "--regroup-timeout", str(2 * COLLECTIVE_TIMEOUT_S),
               "--out-dir", str(tmp_path / "out")]
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps({"name": "job", "command": command, "min_gpus": 1,
                                "env": {"UNICRON_LOG_LEVEL": "INFO"}}))  # the ranks' cut lines, in their agents' logs
    assert cli(["submit", str(spec)]) == 0
    return stepping(c, {0, 1, 2}, 3, timeout=120.0)


def partition_and_expect_the_survivors_to_go_on(c: LocalCluster, victims: list[str],
                                                before: dict[int, dict[str, object]]) -> None:
    survivors = {r: v for r, v in before.items() if v["node"] not in victims}
    t0 = time.time()
    for victim in victims:
        c.partition(victim)
    try:
        past = max(int(v.get("step") or 0) for v in c.running_ranks("job").values())  # in lockstep with the victims
        after = stepping(c, set(survivors), past + 3, timeout=90.0)
    finally:
        for victim in victims:
            c.heal(victim)
    assert {r: v["pid"] for r, v in after.items()} == {r: v["pid"] for r, v in survivors.items()}, "a survivor restarted"
    actions = [str(a["action"]) for a in c.actions(t0)]
    assert "ResizeInPlace" in actions and not {"Assign", "RestartTask"} & set(actions), actions
    for node in {v["node"] for v in survivors.values()}:
        text = (Path(c.run_dir) / f"agent-{node}.log").read_text(errors="replace")
        cuts = [line for line in text.splitlines() if "cut the connections to a lost host" in line]
        for victim in victims:
            assert any(c.host_ip(victim) in line for line in cuts), f"{node}'s rank did not cut {victim}: {cuts}"


@pytest.mark.slow
def test_survivors_cut_a_partitioned_peer_off_instead_of_waiting_for_their_collective_timeout(
        cluster: LocalCluster, tmp_path: Path) -> None:
    before = submit(cluster, tmp_path)
    victim = next(n for n in cluster.node_names() if n != store_node(cluster))
    partition_and_expect_the_survivors_to_go_on(cluster, [victim], before)


@pytest.mark.slow
def test_a_survivor_cuts_off_the_store_node_and_another_node_partitioned_together(
        cluster: LocalCluster, tmp_path: Path) -> None:
    """The moved store never had the other node's ranks: the survivor cuts them from the hosts it read
    at its epoch's barrier (before, it looked them up in the moved store, found none and waited out
    its collective timeout)."""
    before = submit(cluster, tmp_path)
    stored = store_node(cluster)
    other = next(n for n in cluster.node_names() if n != stored)
    partition_and_expect_the_survivors_to_go_on(cluster, [stored, other], before)
