"""Issue #19 item 3, end to end: an etcd restart is no node loss.

Real etcd (one member, its own data dir), a coordinator, two agents and a two-rank gloo task (one
rank per node). etcd is SIGKILLed and, after longer than the agents' lease TTL, started again on the
same data dir and ports. The agents reach etcd through a gate the test keeps shut until etcd has
expired their leases (in the issue's probe the agents took 10-18 s to reconnect; the gate makes that
slowness certain instead of likely), while the coordinator talks to etcd directly and keeps its
lease. The agents' heartbeat links never went down, so the expiries are the outage's doing: no node
may be lost or isolated, and the task's ranks must keep running in the same processes. Before the
fix, each expiry was a sev1 node loss: both healthy nodes were isolated and the task re-planned.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from unicron.cli.main import main as cli
from unicron.cluster.localcluster import LocalCluster
from unicron.kernel.etcd import Store

WORKLOAD = [sys.executable, "-m", "unicron.runtime.workload", "--iter-time", "0.05", "--jitter", "0"]
LEASE_TTL_S = 2


class Gate:
    """A TCP forwarder to etcd that the test can shut (refusing and cutting every connection) and
    open again: the agents' network path to etcd, apart from the coordinator's."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.is_open = threading.Event()
        self.is_open.set()
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, name="gate", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            if not self.is_open.is_set():
                conn.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=1.0)
            except OSError:
                conn.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._conns += [conn, upstream]
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def shut(self) -> None:
        self.is_open.clear()
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def open(self) -> None:
        self.is_open.set()

    def close(self) -> None:
        self.shut()
        self.sock.close()


@pytest.fixture
def cluster() -> Iterator[tuple[LocalCluster, Gate]]:
    env = {"UNICRON_STATUS_INTERVAL": "0.2", "UNICRON_LEASE_TTL": str(LEASE_TTL_S),
           # the case: a coordinator that kept its own lease through the outage
           "UNICRON_LEADER_TTL": "20",
           # hang detection is not under test: a slow iteration on a loaded machine must not restart a rank
           "UNICRON_HANG_FACTOR": "100"}
    c = LocalCluster(agents=2, gpus_per_agent=1, extra_env=env, prefork=["unicron.runtime.workload"])
    gate: Gate | None = None
    try:
        c.etcd.start()
        c.store = Store(c.etcd.endpoint)
        c.start_coordinator()
        gate = Gate(c.etcd.endpoint)
        c.extra_env["UNICRON_ETCD"] = gate.endpoint  # the agents (started from here on) go through the gate
        for node in c.node_names():
            c.start_agent(node)
        for node in c.node_names():
            c.wait_registered(node)
        os.environ["UNICRON_ETCD"] = c.etcd.endpoint
        yield c, gate
    finally:
        os.environ.pop("UNICRON_ETCD", None)
        c.stop()
        if gate is not None:
            gate.close()


def nodes() -> list[dict[str, Any]]:
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert cli(["nodes", "--json"]) == 0
    out: list[dict[str, Any]] = json.loads(buf.getvalue())
    return out


def test_lease_expiries_caused_by_an_etcd_restart_are_no_node_loss(
        cluster: tuple[LocalCluster, Gate], tmp_path: Path) -> None:
    c, gate = cluster
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps({"name": "job", "command": WORKLOAD, "min_gpus": 2}))
    assert cli(["submit", str(spec)]) == 0

    def stepping() -> bool:
        now = c.running_ranks("job")
        return len(now) == 2 and all(isinstance(r.get("step"), int) and r["step"] >= 3 for r in now.values())

    c.wait_for(stepping, 60.0, "both ranks to train past step 3", poll_s=0.1)
    before = c.running_ranks("job")
    assert {r["node"] for r in before.values()} == {"node0", "node1"}, before

    t0 = time.time()
    c.etcd.kill()
    gate.shut()
    time.sleep(LEASE_TTL_S + 1.0)  # the outage: longer than the agents' lease TTL
    c.etcd.start()  # same data dir, same ports
    assert c.store is not None
    # etcd renews every lease when it starts; the agents, still shut out, let theirs expire.
    c.wait_for(lambda: not c.registered_nodes(), 30.0, "etcd to expire the agents' leases", poll_s=0.1)
    gate.open()

    def reregistered() -> bool:
        seen = {str(r.get("node")) for r in c.coordinator_log(t0)
                if r.get("event") in ("node registered", "isolated node re-registered; it stays isolated "
                                                         "until an operator undrains it")}
        return seen >= set(c.node_names())

    c.wait_for(reregistered, 30.0, "the coordinator to see both agents register again", poll_s=0.1)
    actions = [str(a["action"]) for a in c.actions(t0)]
    assert actions == [], actions  # no isolation, no re-plan, no restart
    lost = [i for i in c.incidents() if i.detected_ts >= t0 and i.kind.value == "lost_connection"]
    assert lost == [], lost
    assert {n["node"]: n["state"] for n in nodes()} == {"node0": "up", "node1": "up"}, nodes()

    def trains_on() -> bool:
        now = c.running_ranks("job")
        return len(now) == 2 and all(isinstance(r.get("step"), int) and r["step"] > before[k]["step"] + 5
                                     for k, r in now.items() if k in before)

    c.wait_for(trains_on, 30.0, "the ranks to train on", poll_s=0.1)
    assert {k: r["pid"] for k, r in c.running_ranks("job").items()} == {k: r["pid"] for k, r in before.items()}
