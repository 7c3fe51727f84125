"""The fault-injection round trip's leftovers (real etcd)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from unicron.cluster.etcd_server import EtcdServer
from unicron.kernel.etcd import Store
from unicron.kernel.inject import REQUEST_LEASE_TTL_S
from unicron.kernel.keyspace import Keyspace

ASKER = """
import sys
from unicron.kernel.etcd import Store
from unicron.kernel.inject import Fault, Injection, request
from unicron.kernel.keyspace import Keyspace
request(Store(sys.argv[1]), Keyspace(sys.argv[2]), "ghost", Injection(fault=Fault.KILL_RANK, task="t", rank=0),
        timeout_s=600.0)
"""


def test_the_request_of_an_asker_killed_while_waiting_expires_with_it(etcd_server: EtcdServer, prefix: str) -> None:
    """``unicron inject`` SIGKILLed while it waited left its request in etcd: the node's agent executed
    it whenever it next started. The request now lives under the asker's lease."""
    store, keys = Store(etcd_server.endpoint), Keyspace(prefix)
    asker = subprocess.Popen([sys.executable, "-c", ASKER, etcd_server.endpoint, prefix])
    try:
        deadline = time.monotonic() + 30.0
        while not store.get_prefix(keys.injections("ghost"))[0]:
            assert asker.poll() is None and time.monotonic() < deadline, "the request never appeared"
            time.sleep(0.05)
        asker.send_signal(signal.SIGKILL)
        asker.wait()
        deadline = time.monotonic() + REQUEST_LEASE_TTL_S + 5.0
        while store.get_prefix(keys.injections("ghost"))[0]:
            assert time.monotonic() < deadline, "the dead asker's request outlived its lease"
            time.sleep(0.2)
    finally:
        asker.kill()
        store.close()
