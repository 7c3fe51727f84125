"""Hollow nodes split over processes (``FleetProcesses``, used by bench/scale.py): each node keeps its own
registration, lease and status record, owned by one of the fleet's processes, against a real etcd."""

from __future__ import annotations

import dataclasses
import os
import socket
import tempfile
import time
from pathlib import Path

import pytest

from unicron.cluster.etcd_server import EtcdServer
from unicron.cluster.hollow import FleetProcesses, HollowFleet, SimulatedTask, fleet_silent
from unicron.kernel import wire
from unicron.kernel.errors import StartFailed
from unicron.kernel.etcd import Store
from unicron.kernel.keyspace import Keyspace
from unicron.kernel.types import NodeInfo, RankSpec, TaskAssignment

NAMES = ["hollow0000", "hollow0001", "hollow0002", "hollow0003", "hollow0004"]


def _registered(store: Store, keys: Keyspace) -> dict[str, NodeInfo]:
    kvs, _ = store.get_prefix(keys.nodes())
    return {keys.tail(kv.key, keys.nodes()): NodeInfo.from_json(kv.value) for kv in kvs}


def _wait(pred: object, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():  # type: ignore[operator]
            return True
        time.sleep(0.1)
    return False


def test_a_fleet_over_two_processes_keeps_each_nodes_own_lease_and_records(
        etcd_server: EtcdServer, store: Store, prefix: str) -> None:
    keys = Keyspace(prefix)
    fleet = FleetProcesses(etcd_server.endpoint, 5, 2, procs=2, prefix=prefix, status_interval_s=0.2).start()
    try:
        nodes = _registered(store, keys)
        assert sorted(nodes) == NAMES and fleet.live() == NAMES
        # slices of 3 and 2 nodes, each registered by the process that owns it
        owners = [nodes[n].agent_pid for n in NAMES]
        assert owners == [fleet.pids()[0]] * 3 + [fleet.pids()[1]] * 2
        kvs, _ = store.get_prefix(keys.nodes())
        assert len({kv.lease for kv in kvs}) == 5  # a lease per node, not one per process
        assert _wait(lambda: len(store.get_prefix(keys.statuses())[0]) == 5, 5.0)

        died = fleet.kill("hollow0004")
        # its lease (TTL 3 s) is no longer refreshed: its registration goes; the others' are kept alive
        assert _wait(lambda: "hollow0004" not in _registered(store, keys), 6.0)
        time.sleep(max(0.0, died + 3.5 - time.time()))
        assert sorted(_registered(store, keys)) == NAMES[:4]
        assert fleet.live() == NAMES[:4] and fleet.connected() == 0  # no coordinator to connect to
    finally:
        fleet.stop()
    assert _registered(store, keys) == {}  # stopping revokes the live nodes' leases


def test_a_fleet_whose_process_dies_at_start_stops_its_other_processes(
        etcd_server: EtcdServer, store: Store, prefix: str, tmp_path: Path) -> None:
    """Fleet process 0 meets a node name taken (another run on this etcd) and dies: start() raised a bare
    EOFError and left process 1 running, its nodes registered, with no handle to stop it. Now the
    others are stopped and the error names the dead process and its exit code."""
    keys = Keyspace(prefix)
    store.put(keys.node("hollow0000"), NodeInfo(node="hollow0000", host="127.0.0.1", gpus=2, gpu_backend="simulated",
                                               agent_pid=os.getpid(), started_ts=time.time(),
                                               hostname=os.uname().nodename).to_json())
    fleet = FleetProcesses(etcd_server.endpoint, 4, 2, procs=2, prefix=prefix, run_dir=str(tmp_path))
    try:
        with pytest.raises(StartFailed, match=r"hollow fleet process hollow-fleet-0 \(pid \d+\) exited with 1"):
            fleet.start(timeout_s=30.0)
        assert not fleet.processes[1].is_alive()
        assert not {"hollow0002", "hollow0003"} & set(_registered(store, keys))  # process 1's, revoked
    finally:
        fleet.stop()


def test_a_hollow_survivor_of_a_one_rank_restart_keeps_its_launch_epoch() -> None:
    """Every hollow rank reported the restart's epoch, so the survivors' steps confirmed a restart whose
    relaunched rank had not run (coordinator/causes.py counts the ranks the restart launched). Each rank
    now reports its own launch epoch, as the real reconciler does."""
    a = TaskAssignment(task="t", generation=1, argv=["x"], env={}, world_size=2,
                       ranks=[RankSpec(rank=0, local_rank=0, gpu=0), RankSpec(rank=1, local_rank=1, gpu=1)],
                       store_node="n")
    sim = SimulatedTask(a, iter_s=0.001)
    sim.apply(dataclasses.replace(a, restart_epoch=1, restart_ranks=[1]))
    assert {r.rank: r.restart_epoch for r in sim.rank_statuses()} == {0: 0, 1: 1}


def test_a_stopped_hollow_fleet_leaves_no_temp_dir(
        etcd_server: EtcdServer, prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fleet given no run_dir made ``unicron-hollow-*`` and never removed it; stop() now does."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    HollowFleet(etcd_server.endpoint, 1, 2, prefix=prefix).start().stop()
    assert not list(tmp_path.glob("unicron-hollow-*"))


def test_a_starved_fleet_stamps_its_late_heartbeats(etcd_server: EtcdServer, prefix: str) -> None:
    """The fleet's one heartbeat thread serves every node of its process: when it is held up (here by its
    own lock, as by the GIL of a process answering a wide Assign), the nodes' heartbeats are late through
    no fault of the agent or the coordinator. The gap is stamped, so bench/scale.py can tell such a loss
    from the coordinator's (``fleet_silent``)."""
    fleet = HollowFleet(etcd_server.endpoint, 1, 2, prefix=prefix, heartbeat_s=0.05, late_s=0.5).start()
    ours, theirs = socket.socketpair()
    try:
        with fleet._lock:
            fleet._conns["hollow0000"] = wire.LineSocket(ours)  # its link, as the connector would make it
        assert _wait(lambda: theirs.recv(65536), 10.0)
        with fleet._lock:  # the heartbeat thread cannot take its next round's connections
            time.sleep(1.5)
            # A round that took its connections just before the lock may have sent after it was taken (a CI
            # run failed on that): the stall is measured from the fleet's own last send, read at release.
            stalled = fleet._last_send["hollow0000"]
            released = time.time()
        assert released - stalled >= 1.2, "the round in flight took the whole stall to send"

        def spanning() -> list[tuple[str, float, float]]:  # (a loaded machine may add gaps of its own)
            return [g for g in fleet.late_sends() if g[0] == "hollow0000" and g[1] <= stalled and g[2] >= released]

        assert _wait(spanning, 10.0), fleet.late_sends()  # stamped at the first send after the stall
        gaps = spanning()
        assert fleet_silent(gaps, "hollow0000", stalled + 1.1, 1.0) is not None  # its silence
        assert fleet_silent(gaps, "hollow0000", stalled + 1.1, 2.0) is None  # not the whole timeout
    finally:
        fleet.stop()
        theirs.close()
