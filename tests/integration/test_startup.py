"""Daemons started before etcd: a clear message naming the endpoint and the fix, retries with
backoff, and normal operation once etcd comes up."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

from unicron.cluster.etcd_server import EtcdServer
from unicron.kernel.etcd import Store
from unicron.kernel.keyspace import Keyspace


def _wait(pred, timeout: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return False


def test_daemons_wait_for_etcd_with_a_clear_message() -> None:
    server = EtcdServer()  # ports chosen, not started yet
    run_dir = tempfile.mkdtemp(prefix="unicron-startup-")
    env = {**os.environ, "UNICRON_ETCD": server.endpoint, "UNICRON_RUN_DIR": run_dir, "UNICRON_PREFIX": "/s"}
    logs = {name: open(os.path.join(run_dir, f"{name}.log"), "w+") for name in ("agent", "coordinator")}  # noqa: SIM115
    procs = [
        subprocess.Popen([sys.executable, "-m", "coordinator.main"], env=env, stderr=logs["coordinator"]),
        subprocess.Popen([sys.executable, "-m", "agent.main", "--node", "n1", "--gpu-backend", "simulated"],
                         env=env, stderr=logs["agent"]),
    ]
    try:
        def said_unreachable(name: str) -> bool:
            with open(os.path.join(run_dir, f"{name}.log")) as f:
                text = f.read()
            return "etcd unreachable; retrying" in text and server.endpoint in text and "UNICRON_ETCD" in text

        assert _wait(lambda: said_unreachable("agent") and said_unreachable("coordinator"), 60.0)
        for name in ("agent", "coordinator"):  # no --tls-dir: one warning line says so (issue 17)
            with open(os.path.join(run_dir, f"{name}.log")) as f:
                assert len([ln for ln in f if '"plaintext: anyone who can reach' in ln and "--tls-dir" in ln]) == 1
        assert all(p.poll() is None for p in procs)
        server.start()
        store = Store(server.endpoint)
        keys = Keyspace("/s")
        assert _wait(lambda: store.get(keys.node("n1")) is not None and store.get(keys.leader()) is not None, 30.0)
        store.close()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=15)
        for f in logs.values():
            f.close()
        server.cleanup()
