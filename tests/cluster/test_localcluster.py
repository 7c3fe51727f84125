"""The local-cluster harness's own waiting (unicron.cluster.localcluster), against a real etcd."""

from __future__ import annotations

import os
import re
import signal
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests.cluster.helpers import etcd_of_a_sigkilled_owner, gone
from unicron.cluster.etcd_server import EtcdCluster, EtcdServer
from unicron.cluster.localcluster import LocalCluster
from unicron.kernel.errors import StartFailed, StoreUnavailable
from unicron.kernel.etcd import Store
from unicron.kernel.net import free_port
from unicron.kernel.procs import STOPPED_STATES, proc_state


def test_wait_for_rides_out_an_etcd_that_stalls_and_names_it_when_it_never_answers(
    etcd_server: EtcdServer, tmp_path: Path
) -> None:
    """A stalled etcd (SIGSTOP: what a member between elections looks like to a reader) times reads
    out; the wait asks again instead of ending the run, and says what it last saw if time runs out."""
    store = Store(etcd_server.endpoint, timeout_s=0.5)
    store.put("/k", "v")
    stalls: list[StoreUnavailable] = []

    def read() -> bytes | None:
        try:
            kv = store.get("/k")
        except StoreUnavailable as exc:
            stalls.append(exc)
            raise
        return None if kv is None else kv.value

    assert etcd_server.proc is not None
    pgid = etcd_server.proc.pid

    def stop_etcd() -> None:
        """SIGSTOP, and wait until the kernel shows it stopped (delivery is not instant)."""
        os.killpg(pgid, signal.SIGSTOP)
        deadline = time.monotonic() + 10.0
        while proc_state(pgid) not in STOPPED_STATES:
            assert time.monotonic() < deadline, f"etcd not stopped: state {proc_state(pgid)}"
            time.sleep(0.01)

    harness = LocalCluster(run_dir=str(tmp_path))
    stop_etcd()
    resume = threading.Timer(3 * store.timeout_s, os.killpg, (pgid, signal.SIGCONT))
    resume.start()
    try:
        assert harness.wait_for(read, 60.0, "the key") == b"v"
        assert stalls, "etcd answered while stopped: the stall was never ridden out"
        assert harness.temporary_errors == len(stalls)
        # the timer's SIGCONT must not land in the second stall (a fresh clone's run on two pytest
        # workers: the second wait read the key)
        resume.join()
        stop_etcd()
        with pytest.raises(TimeoutError, match=r"waiting for the key \(last error: etcd get /k failed"):
            harness.wait_for(read, 2.5 * store.timeout_s, "the key")
    finally:
        resume.cancel()
        os.killpg(pgid, signal.SIGCONT)
        store.close()


def test_a_stopped_cluster_keeps_its_etcd_members_logs_with_its_own(tmp_path: Path) -> None:
    """The members' data dirs go at stop; their logs are written with the run's, and stay."""
    harness = LocalCluster(agents=0, etcd_members=3, run_dir=str(tmp_path))
    assert isinstance(harness.etcd, EtcdCluster)
    data_dirs = [Path(m.data_dir) for m in harness.etcd.members]
    harness.etcd.start()
    harness.stop()
    assert not any(d.exists() for d in data_dirs)
    for m in harness.etcd.members:
        log = (tmp_path / f"etcd-{m.name}.log").read_text()
        assert m.name in log and "raft" in log, log[:500]


def test_an_etcd_that_fails_to_start_in_a_with_block_leaves_no_data_dir(
        taken_port: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed __enter__ runs no __exit__: the data dir was left behind. Now the failed start cleans up."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    server = EtcdServer(ports=(taken_port, free_port()))
    with pytest.raises(StartFailed, match=r"etcd exited with 1: .*address already in use"), server:
        pass
    assert not os.path.exists(server.data_dir)


def test_a_failed_etcd_start_names_a_log_that_still_exists(taken_port: int, tmp_path: Path) -> None:
    """The error named etcd.log in the member's data dir, which the cluster's cleanup removed; the
    members now log into the run dir."""
    cluster = LocalCluster(agents=0, run_dir=str(tmp_path))
    assert isinstance(cluster.etcd, EtcdServer)
    cluster.etcd.client_port = taken_port
    with pytest.raises(StartFailed) as err, cluster:
        pass
    named = re.search(r"see (\S+)", str(err.value))
    assert named is not None and os.path.exists(named.group(1)), str(err.value)


def test_a_port_taken_between_its_choice_and_etcds_bind_is_replaced() -> None:
    """free_port() races other processes: an outgoing connection can take the chosen port as its
    ephemeral source port before etcd binds it (a fresh clone's run: 'bind: address already in use').
    A server whose ports were chosen for it, never reached by anyone, takes others."""
    server = EtcdServer()
    chosen = server.client_port
    with socket.create_server((server.host, chosen)):  # what the racing connection holds
        try:
            server.start()
            assert server.client_port != chosen and server.proc is not None
        finally:
            server.cleanup()


def test_wait_ready_does_not_take_another_etcd_on_its_port_for_its_own(etcd_server: EtcdServer) -> None:
    """Another etcd holds the client port free_port() chose: ours cannot bind and exits, and wait_ready
    took the other's answer for ours. Now it checks that the answering etcd has our peer URL."""
    ours = EtcdServer(ports=(etcd_server.client_port, free_port()))
    try:
        with pytest.raises(StartFailed, match=r"exited|another etcd answers"):
            ours.start()
    finally:
        ours.cleanup()


def test_a_sigkilled_owners_etcd_does_not_outlive_it(tmp_path: Path) -> None:
    """etcd (and the daemons) ran on forever after their owner was SIGKILLed; they now die with it."""
    pid = etcd_of_a_sigkilled_owner(tmp_path)
    try:
        assert gone(pid, 3.0), f"etcd pid {pid} still runs after its owner was SIGKILLed"
    finally:
        if not gone(pid, 0.0):
            os.kill(pid, signal.SIGKILL)


def test_an_agent_that_dies_at_startup_is_reported_not_waited_out(tmp_path: Path) -> None:
    """An agent that exited at start was waited out and reported as a timeout; now at once, by name."""
    cluster = LocalCluster(agents=1, gpus_per_agent=-1, prefork=[], run_dir=str(tmp_path))  # the agent exits 2
    try:
        with pytest.raises(StartFailed, match=r"agent-node0 \(pid \d+\) exited with 2 .*agent-node0\.log"):
            cluster.start(timeout_s=30.0)
    finally:
        cluster.stop()


def test_a_cluster_that_failed_to_start_puts_sigterm_back(taken_port: int, tmp_path: Path) -> None:
    """The cluster's SIGTERM handler stayed installed after the with block (here: a failed start)."""
    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    cluster = LocalCluster(agents=0, run_dir=str(tmp_path))
    assert isinstance(cluster.etcd, EtcdServer)
    cluster.etcd.client_port = taken_port
    try:
        with pytest.raises(StartFailed), cluster:
            pass
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, before)


def test_an_etcd_started_on_a_short_lived_thread_outlives_the_thread() -> None:
    """etcd dies with its owner (PDEATHSIG), which the kernel sends when the *thread* that forked it
    exits: it is forked on one long-lived thread, so a cluster started in the background runs on."""
    server = EtcdServer()
    starter = threading.Thread(target=server.start)
    starter.start()
    starter.join()
    try:
        assert server.proc is not None
        time.sleep(0.3)
        assert server.proc.poll() is None
    finally:
        server.cleanup()
