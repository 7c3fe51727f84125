"""Coordinator high availability: a running standby takes over from a SIGKILLed leader within the
leadership lease's TTL + 1 s, running ranks undisturbed and a pending action carried out exactly
once; a partitioned leader (namespace cluster) is fenced: none of its writes land and it exits."""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import redirect_stdout

import pytest

from coordinator.daemon import EXIT_DEPOSED
from unicron.cli.main import main as cli
from unicron.cluster.localcluster import LocalCluster
from unicron.cluster.netns import unavailable_reason
from unicron.kernel.procs import pid_alive
from unicron.kernel.types import ErrorKind

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]
LEADER_TTL_S = 3
FENCE_S = 4.0  # the agent's default (UNICRON_FENCE)


@pytest.fixture(scope="module", params=["loopback", "netns"])
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    netns = request.param == "netns"
    if netns and (reason := unavailable_reason()) is not None:
        pytest.skip(f"namespace cluster unavailable: {reason}")
    c = LocalCluster(agents=2, gpus_per_agent=2, netns=netns, coordinators=2,
                     extra_env={"UNICRON_LEADER_TTL": str(LEADER_TTL_S)})
    c.start()
    os.environ["UNICRON_ETCD"] = c.etcd.endpoint
    try:
        spec = tmp_path_factory.mktemp("spec") / "t.json"
        spec.write_text(json.dumps({"name": "keep", "command": SLEEPER, "min_gpus": 2}))
        assert cli(["submit", str(spec)]) == 0
        c.wait_for(lambda: settled(c), 60.0, "the task's ranks")
        yield c
    finally:
        os.environ.pop("UNICRON_ETCD", None)
        c.stop()


def settled(c: LocalCluster) -> bool:
    """The task runs on every GPU the coordinator gave it (no reconfiguration under way)."""
    buf = io.StringIO()
    with redirect_stdout(buf):
        if cli(["tasks", "--json"]) != 0:
            return False
    tasks = json.loads(buf.getvalue())
    return bool(tasks) and tasks[0]["gpus"] >= 2 and len(pids(c)) == tasks[0]["gpus"]


def pids(c: LocalCluster) -> dict[int, int]:
    return {r: int(v["pid"]) for r, v in c.running_ranks("keep").items()}


def kill_leader(c: LocalCluster) -> tuple[int, float]:
    """SIGKILL the leader; wait for the standby's takeover, which must come within TTL + 1 s by the
    standby's own clock. Returns the standby's index and the takeover's duration."""
    old = c.leader_index()
    standby = 1 - old
    os.kill(c.coordinators[old].pid, signal.SIGKILL)
    t_kill = time.time()
    ts = c.wait_for(lambda: c.elected_at(standby, t_kill), LEADER_TTL_S + 10.0, "the standby to lead")
    assert ts - t_kill <= LEADER_TTL_S + 1.0, f"takeover took {ts - t_kill:.2f} s"
    assert c.leader_pid() == c.coordinators[standby].pid
    c.restart_coordinator(old)
    return standby, ts - t_kill


def announced(c: LocalCluster) -> set[str]:
    """The link addresses under coordinators/ (where agents look for the leader while etcd is down)."""
    assert c.store is not None
    kvs, _ = c.store.get_prefix(c.keys.coordinators())
    return {json.loads(kv.value)["link"] for kv in kvs}


def test_a_standby_takes_over_from_a_killed_leader_with_ranks_undisturbed(cluster: LocalCluster) -> None:
    before = pids(cluster)
    assert cluster.store is not None
    leader_key = cluster.store.get(cluster.keys.leader())
    assert leader_key is not None
    killed = json.loads(leader_key.value)["link"]
    cluster.wait_for(lambda: len(announced(cluster)) == 2 and killed in announced(cluster), 10.0,
                     "both coordinators announced")
    t0 = time.time()
    kill_leader(cluster)
    time.sleep(2.0)  # the agents re-link to the new leader meanwhile
    assert pids(cluster) == before
    assert [i for i in cluster.incidents() if i.detected_ts >= t0] == []
    # the killed one's entry went with its lease; the restarted one (at another port) announced itself
    cluster.wait_for(lambda: killed not in announced(cluster) and len(announced(cluster)) == 2,
                     LEADER_TTL_S + 10.0, "the killed coordinator's announcement to expire")


def test_an_action_pending_at_the_leaders_death_is_carried_out_once(cluster: LocalCluster) -> None:
    before = pids(cluster)
    victim_rank, victim_pid = max(before.items())
    t0 = time.time()
    # A rank dies and, before the leader can act on it, the leader dies: the action is pending.
    os.kill(victim_pid, signal.SIGKILL)
    kill_leader(cluster)

    def restarted() -> bool:
        now = pids(cluster)
        return victim_rank in now and now[victim_rank] != victim_pid and settled(cluster)
    cluster.wait_for(restarted, 60.0, "the killed rank to be restarted")
    time.sleep(2.0)  # a second restart, if one were coming, would be under way by now
    # Counted where it happens: the agents' rank starts. The coordinators' action lines can miss one:
    # a leader killed after its fenced write landed but before it logged the action.
    starts = [r for n in cluster.node_names() for r in cluster.agent_log(n, t0)
              if r.get("event") == "rank started" and r.get("rank") == victim_rank]
    assert len(starts) == 1, starts  # exactly once, by whichever leader decided it
    restarts = [a for i in cluster.coordinators for a in cluster.actions(t0, i)
                if a["action"] in ("RestartRanks", "RestartTask", "Assign")]
    assert len(restarts) <= 1, restarts
    incidents = [i for i in cluster.incidents() if i.detected_ts >= t0 - 1]
    assert [i.kind for i in incidents] == [ErrorKind.EXITED_ABNORMALLY], incidents


def test_a_partitioned_leader_is_fenced_and_exits(cluster: LocalCluster) -> None:
    if cluster.net is None:
        pytest.skip("partitions need the namespace cluster")
    before = pids(cluster)
    old = cluster.leader_index()
    standby = 1 - old
    t0 = time.time()
    cluster.partition(f"coord{old}")
    try:
        cluster.wait_for(lambda: cluster.elected_at(standby, t0), LEADER_TTL_S + 10.0, "the standby to lead")
        # Cut off, the old leader lost every agent's heartbeat and tried to act on it; it could not.
        time.sleep(2.0)
    finally:
        cluster.heal(f"coord{old}")
    # Back on the network, its first write is refused (its fencing token is stale): it stops.
    code = cluster.coordinators[old].wait(timeout=30.0)
    assert code == EXIT_DEPOSED
    lost = [i for i in cluster.incidents() if i.kind is ErrorKind.LOST_CONNECTION and i.detected_ts >= t0]
    assert lost == [], lost  # none of the deposed leader's "node lost" decisions landed
    assert all(cluster.node_state(n) == "up" for n in cluster.node_names())
    assert pids(cluster) == before
    cluster.restart_coordinator(old)


def test_a_stopped_leader_loses_its_links_to_the_standby_that_takes_over(cluster: LocalCluster) -> None:
    """A leader SIGSTOPped (a hung host) keeps its links up: its kernel acknowledges every heartbeat. The
    standby takes over when the leadership lease lapses, and the agents, watching the leader key, link
    to it. Before, they heartbeated the stopped leader until it came back, and the new leader had no
    link to see a node die by. Continued, the old leader finds itself deposed and exits."""
    if cluster.net is None:
        pytest.skip("one run is enough: a stop is a process fault, the namespace cluster is the real network")
    before = pids(cluster)
    old = cluster.leader_index()
    standby = 1 - old
    stopped = cluster.coordinators[old].pid
    t0 = time.time()
    os.kill(stopped, signal.SIGSTOP)
    try:
        cluster.wait_for(lambda: cluster.elected_at(standby, t0), LEADER_TTL_S + 10.0, "the standby to lead")

        def linked() -> set[str]:
            return {r["node"] for r in cluster.coordinator_log(t0, standby) if r.get("event") == "link connected"}
        cluster.wait_for(lambda: linked() == set(cluster.node_names()), 10.0, "every agent linked to the new leader")
    finally:
        os.kill(stopped, signal.SIGCONT)
    assert cluster.coordinators[old].wait(timeout=30.0) == EXIT_DEPOSED
    assert pids(cluster) == before
    assert [i for i in cluster.incidents() if i.detected_ts >= t0] == []
    cluster.restart_coordinator(old)


def test_an_etcd_outage_right_after_a_takeover_fences_nothing(cluster: LocalCluster) -> None:
    """Chaos seed 97's double fault: the leader is killed (every agent's link breaks with it), the
    standby takes over, and the whole of etcd goes down just after. Agents that had not read the new
    leader key yet found no coordinator without etcd: every node fenced its ranks after ``fence_s`` and
    the task was relaunched. Now they try every coordinator they saw announced, and the new leader (the
    only one that welcomes them) is found without etcd: no rank dies."""
    before = pids(cluster)
    old = cluster.leader_index()
    standby = 1 - old
    os.kill(cluster.coordinators[old].pid, signal.SIGKILL)
    t_kill = time.time()
    cluster.wait_for(lambda: any(r.get("event") == "coordinator leading"
                                 for r in cluster.coordinator_log(t_kill, standby)),
                     LEADER_TTL_S + 10.0, "the standby to lead", poll_s=0.02)
    cluster.etcd.kill()
    t_down = time.time()
    try:
        # past the fence (counted from the agents' last lease renewal) and its two checks
        while time.time() < t_down + FENCE_S + 3.0 and all(pid_alive(p) for p in before.values()):
            time.sleep(0.1)
        alive = {r: pid_alive(p) for r, p in before.items()}
    finally:
        cluster.etcd.start()
    fenced = [r for n in cluster.node_names() for r in cluster.agent_log(n, t_kill) if r.get("logger") == "agent.fence"]
    assert all(alive.values()) and fenced == [], (alive, fenced)
    linked = {r["node"] for r in cluster.coordinator_log(t_kill, standby) if r.get("event") == "link connected"}
    assert linked == set(cluster.node_names()), linked  # whether before or after etcd went down
    cluster.wait_for(lambda: settled(cluster), 60.0, "the task's records readable again")
    cluster.restart_coordinator(old)
    assert pids(cluster) == before
    assert [i for i in cluster.incidents() if i.detected_ts >= t_down] == []
