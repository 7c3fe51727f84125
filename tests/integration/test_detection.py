"""Every Table 1 detection path end to end: real etcd, coordinator, agents and gloo ranks.

One cluster serves the module (starting it costs seconds); each test restarts the workload at a new
generation when it needs healthy ranks, and picks its own incident by time and kind.

The cases whose path crosses hosts (exceptions by severity, a rank or an agent killed, checkpoint
replicas) are plain functions here, run on the namespace cluster by test_netns.py (once, not twice).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from unicron.cluster.localcluster import LocalCluster
from unicron.kernel.inject import Injection, request
from unicron.kernel.types import DetectionMethod, ErrorKind, Incident, Severity

WORKLOAD = [sys.executable, "-m", "unicron.runtime.workload", "--iter-time", "0.05", "--jitter", "0.1"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    # the loopback cases run the gloo workload only (the training runtime's cases are in test_netns)
    # statuses every 0.2 s: the cases wait on them (the default 1 s only adds latency to each wait)
    c = LocalCluster(agents=3, gpus_per_agent=2, extra_env={"UNICRON_WARMUP_ITERATIONS": "3",
                                                            "UNICRON_STATUS_INTERVAL": "0.2"},
                     prefork=["unicron.runtime.workload"])
    c.start()
    try:
        yield c
    finally:
        c.stop()


_generation = [0]


def run_workload(cluster: LocalCluster, nodes: list[str], argv: list[str] | None = None) -> None:
    _generation[0] += 1
    cluster.assign_task("t1", argv or WORKLOAD, nodes, ranks_per_node=2, generation=_generation[0])

    def stepping() -> bool:
        st = [cluster.agent_status(n) for n in nodes]
        # Only this generation's ranks count: the previous one's may linger in a status not yet rewritten.
        steps = [r.get("step") for s in st if s and s.get("generation") == _generation[0]
                 for r in s.get("ranks", []) if r.get("state") == "running"]
        # Past the hang detector's warm-up (3 iterations) and its minimum of 5 samples, with margin.
        return len(steps) == 2 * len(nodes) and all(isinstance(x, int) and x >= 12 for x in steps)

    cluster.wait_for(stepping, 60.0, "the workload to pass its warm-up", poll_s=0.1)


def inject(cluster: LocalCluster, node: str, **req: object) -> float:
    assert cluster.store is not None
    answer = request(cluster.store, cluster.keys, node, Injection.from_dict(dict(req)))
    assert answer.ok, answer.detail
    return float(answer.executed_ts or 0.0)


def expect(cluster: LocalCluster, after: float, kind: ErrorKind, severity: Severity,
           method: DetectionMethod, timeout_s: float = 20.0) -> Incident:
    inc = cluster.wait_incident(lambda i: i.kind is kind, timeout_s=timeout_s, after=after)
    assert inc.severity is severity, inc
    assert inc.method is method, inc
    return inc


def exception_propagation_each_severity(cluster: LocalCluster) -> None:
    run_workload(cluster, ["node0", "node1"])
    for kind, sev in ((ErrorKind.CONNECTION_REFUSED_RESET, Severity.SEV3), (ErrorKind.CUDA_ERROR, Severity.SEV2),
                      (ErrorKind.ECC_ERROR, Severity.SEV1)):
        t0 = inject(cluster, "node1", fault="raise", kind=kind.value, rank=2)
        inc = expect(cluster, t0, kind, sev, DetectionMethod.EXCEPTION_PROPAGATION)
        assert (inc.node, inc.task, inc.rank) == ("node1", "t1", 2)
        assert inc.detected_ts - t0 < 5.0
        run_workload(cluster, ["node0", "node1"])


def rank_killed_is_process_supervision_sev2(cluster: LocalCluster) -> None:
    run_workload(cluster, ["node0", "node1"])
    t0 = inject(cluster, "node0", fault="kill-rank", rank=1)
    inc = expect(cluster, t0 - 0.5, ErrorKind.EXITED_ABNORMALLY, Severity.SEV2, DetectionMethod.PROCESS_SUPERVISION)
    assert inc.rank == 1 and "signal 9" in inc.message


def test_stall_is_a_task_hang(cluster: LocalCluster) -> None:
    run_workload(cluster, ["node0", "node1"])
    t0 = inject(cluster, "node0", fault="stall", rank=0)
    inc = expect(cluster, t0, ErrorKind.TASK_HANG, Severity.SEV2, DetectionMethod.STATISTICAL_MONITORING)
    assert inc.task == "t1"


def _phases(cluster: LocalCluster) -> dict[int, str | None]:
    """The last phase of each rank of the current generation of task t1, as node0's and node1's statuses say."""
    st = [cluster.agent_status(n) for n in ("node0", "node1")]
    return {r["rank"]: r.get("phase") for s in st if s and s.get("generation") == _generation[0] for r in s["ranks"]}


def hang_rank_3(cluster: LocalCluster, tp: int, phases: dict[int, str | None]) -> list[Incident]:
    """Rank 3 (on node1) hangs in its compute with its process running; returns the task's hang
    incidents once every rank's report arrived, after the statuses showed ``phases``."""
    # 0.5 s iterations: the hang threshold (3x) leaves the statuses (every 0.2 s) time to show the
    # peers in the collective before their reports arrive, as 1 s statuses do for real iterations
    run_workload(cluster, ["node0", "node1"],
                 [*WORKLOAD[:3], "--iter-time", "0.5", "--jitter", "0.1", "--tp", str(tp)])
    t0 = inject(cluster, "node1", fault="slow", rank=3, delay_s=600.0, iterations=1)
    cluster.wait_for(lambda: _phases(cluster) == phases, 20.0, f"the statuses to show the phases {phases}")

    def hangs() -> list[Incident]:
        return [i for i in cluster.incidents() if i.detected_ts >= t0 and i.kind is ErrorKind.TASK_HANG
                and i.task == "t1"]

    # one report per rank: rank 3's own and its three peers'
    found: list[Incident] = cluster.wait_for(lambda: len(got := hangs()) >= 4 and got, 30.0,
                                             "every rank's hang report")
    return found


def test_a_rank_hung_in_compute_is_blamed_not_the_peers_waiting_for_it(cluster: LocalCluster) -> None:
    """A GPU hang: the process runs (no SIGSTOP for its agent to see) but never reaches the all-reduce,
    and every agent finds its ranks hung. Each peer's report must name the hung rank, which the
    statuses show outside the collective, and not the peer (coordinator.causes.hang_culprit)."""
    hangs = hang_rank_3(cluster, 1, {0: "collective", 1: "collective", 2: "collective", 3: "train"})
    assert {(i.node, i.rank) for i in hangs} == {("node1", 3)}, hangs
    peers = [i for i in hangs if "has not joined the collective (phase train" in i.message]
    assert {m.split("reported on ")[1].split(";")[0] for m in (i.message for i in peers)} == {
        "node0 for rank 0", "node0 for rank 1", "node1 for rank 2"}


def test_a_rank_hung_in_compute_with_tensor_parallelism_names_its_node(cluster: LocalCluster) -> None:
    """The same hang with TP = 2 (ranks 2 and 3 on node1 one group, all-reducing halfway through their
    compute): rank 3's partner waits in that all-reduce, in the compute phase, and looks as hung as
    rank 3, in its peers' statuses and in its own report. No report may name the partner alone (it was
    restarted, the task stayed stuck and the restart deadline isolated the node): each names node1,
    whose ranks of the task then all restart."""
    hangs = hang_rank_3(cluster, 2, {0: "collective", 1: "collective", 2: "train", 3: "train"})
    assert {(i.node, i.rank) for i in hangs} == {("node1", None)}, hangs
    assert all("ranks 2 and 3' processes have not joined the collective" in i.message for i in hangs)


def test_simulated_xid_is_sev1(cluster: LocalCluster) -> None:
    run_workload(cluster, ["node0", "node1"])
    t0 = inject(cluster, "node1", fault="xid", code=79, gpu=1)
    inc = expect(cluster, t0, ErrorKind.GPU_DRIVER_ERROR, Severity.SEV1, DetectionMethod.EXCEPTION_PROPAGATION)
    assert (inc.node, inc.gpu, inc.rank) == ("node1", 1, 3)


def test_uninstrumented_stderr_is_matched(cluster: LocalCluster) -> None:
    argv = [sys.executable, "-c",
            "import sys,time; print('RuntimeError: CUDA error: an illegal memory access was encountered',"
            " file=sys.stderr, flush=True); time.sleep(60)"]
    t0 = time.time()
    _generation[0] += 1
    cluster.assign_task("t2", argv, ["node2"], ranks_per_node=1, generation=_generation[0])
    inc = expect(cluster, t0, ErrorKind.ILLEGAL_MEMORY_ACCESS, Severity.SEV2, DetectionMethod.EXCEPTION_PROPAGATION)
    assert inc.node == "node2"


def test_agent_survives_malformed_socket_messages(cluster: LocalCluster) -> None:
    path = os.path.join(cluster.run_dir, "node2.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(path)
        s.sendall(b"not json\n{\"type\": \"nope\"}\n[1,2]\n{\"type\":\"iter_end\",\"step\":\"x\"}\n" + b"x" * 100)
    time.sleep(0.3)
    assert cluster.agents["node2"].poll() is None
    t0 = inject(cluster, "node2", fault="xid", code=48, gpu=0)
    expect(cluster, t0, ErrorKind.ECC_ERROR, Severity.SEV1, DetectionMethod.EXCEPTION_PROPAGATION)


def test_garbage_in_etcd_is_skipped(cluster: LocalCluster) -> None:
    assert cluster.store is not None
    cluster.store.put(cluster.keys.report("node2", "garbage1"), b"\xff{not json")
    cluster.store.put(cluster.keys.report("node2", "garbage2"), json.dumps({"kind": "bogus"}))
    cluster.store.put(cluster.keys.node("ghost"), "[]")
    cluster.wait_for(lambda: cluster.store.get(cluster.keys.report("node2", "garbage2")) is None, 10.0,  # type: ignore[union-attr]
                     "the coordinator to delete the garbage report")
    assert cluster.coordinator is not None and cluster.coordinator.poll() is None
    t0 = inject(cluster, "node2", fault="xid", code=74, gpu=1)
    expect(cluster, t0, ErrorKind.NVLINK_ERROR, Severity.SEV1, DetectionMethod.EXCEPTION_PROPAGATION)


def test_etcd_restart_keeps_ranks_and_loses_no_report(cluster: LocalCluster) -> None:
    run_workload(cluster, ["node0", "node1"])
    pids_before = {r["pid"] for r in cluster.agent_status("node0")["ranks"]}  # type: ignore[index]
    cluster.etcd.stop()
    # A fault while etcd is down: the report must wait in the agent and arrive after the restart.
    os.kill(next(iter(pids_before)), signal.SIGKILL)
    t_kill = time.time()
    time.sleep(1.0)
    cluster.etcd.start()
    inc = cluster.wait_incident(lambda i: i.kind is ErrorKind.EXITED_ABNORMALLY and i.node == "node0",
                                timeout_s=30.0, after=t_kill)
    assert inc.source_ts <= inc.detected_ts
    cluster.wait_for(lambda: set(cluster.registered_nodes()) >= {"node0", "node1", "node2"}, 20.0, "re-registration")
    assert all(p.poll() is None for p in cluster.agents.values())


def test_silenced_node_is_lost_by_heartbeat(cluster: LocalCluster) -> None:
    proc = cluster.agents["node2"]
    t0 = time.time()
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        inc = expect(cluster, t0, ErrorKind.LOST_CONNECTION, Severity.SEV1, DetectionMethod.NODE_HEALTH)
        assert inc.node == "node2" and "heartbeat" in inc.message
        assert inc.detected_ts - t0 < 3.0
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    # Its lease expired meanwhile: the agent notices, re-registers and re-links.
    cluster.wait_for(lambda: "node2" in cluster.registered_nodes(), 20.0, "node2 to re-register")
    time.sleep(0.5)


def killed_agent_is_lost_by_connection_close(cluster: LocalCluster) -> None:
    proc = cluster.agents["node2"]
    t0 = time.time()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    inc = expect(cluster, t0, ErrorKind.LOST_CONNECTION, Severity.SEV1, DetectionMethod.NODE_HEALTH)
    assert inc.node == "node2" and "connection closed" in inc.message
    assert inc.detected_ts - t0 < 1.0
    cluster.start_agent("node2")
    cluster.wait_registered("node2")


def test_exception_handled_in_place_is_recorded_as_handled(cluster: LocalCluster) -> None:
    # A rank that recovered by itself (the runtime's in-place regroup) reports fatal=False.
    argv = [sys.executable, "-c",
            "import time; from unicron.kernel.client import AgentClient; c = AgentClient.from_env().connect();"
            "c.report_exception(ConnectionResetError('peer reset during all-reduce'), fatal=False);"
            "time.sleep(60)"]
    t0 = time.time()
    _generation[0] += 1
    cluster.assign_task("t3", argv, ["node2"], ranks_per_node=1, generation=_generation[0])
    inc = expect(cluster, t0, ErrorKind.CONNECTION_REFUSED_RESET, Severity.SEV3, DetectionMethod.EXCEPTION_PROPAGATION)
    assert inc.handled and inc.task == "t3"


def agents_host_checkpoint_replica_servers(cluster: LocalCluster) -> None:
    from ckpt.replica import ReplicaClient

    assert cluster.store is not None
    for node in ("node0", "node1"):
        info = json.loads(cluster.store.get(cluster.keys.node(node)).value)  # type: ignore[union-attr]
        assert info["replica_addr"], info
        assert ReplicaClient(info["replica_addr"], timeout_s=5.0).list("no-such-job") == []


def in_memory_snapshots_are_replicated_to_the_ring_peer(cluster: LocalCluster, tmp_path: Path) -> None:
    from ckpt.replica import ReplicaClient

    argv = [sys.executable, "-m", "unicron.runtime.train", "--iterations", "0", "--iter-sleep", "0.05",
            "--ckpt", "memory", "--ckpt-dir", str(tmp_path), "--ckpt-every", "2"]
    _generation[0] += 1
    cluster.assign_task("ck", argv, ["node0"], ranks_per_node=2, generation=_generation[0])
    assert cluster.store is not None
    peer = json.loads(cluster.store.get(cluster.keys.node("node1")).value)["replica_addr"]  # type: ignore[union-attr]
    client = ReplicaClient(peer, timeout_s=5.0)
    held = cluster.wait_for(lambda: {s.rank for s in client.list("ck")} == {0, 1} and client.list("ck"), 120.0,
                            "both ranks' snapshots on node1's replica server", poll_s=0.5)
    assert all(s.iteration >= 2 for s in held)
