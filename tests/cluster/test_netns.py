"""The namespace network of the local-cluster harness: hosts reach each other over the bridge, a
partition cuts one off and healing brings it back, and a crashed owner's network is removed by the
next one. Root only (skipped with the reason otherwise)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.helpers import etcd_of_a_sigkilled_owner, gone
from unicron.cluster.netns import Network, cleanup_stale, unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=f"netns: {unavailable_reason()}")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LISTEN = ("import socket,sys; s=socket.create_server((sys.argv[1], 7000)); print('up', flush=True);"
          " [s.accept()[0].close() for _ in iter(int, 1)]")
CONNECT = "import socket,sys; socket.create_connection((sys.argv[1], 7000), timeout=1.0).close()"


@pytest.fixture
def net() -> Iterator[Network]:
    n = Network().create()
    try:
        yield n
    finally:
        n.destroy()


def reaches(net: Network, src: str, ip: str) -> bool:
    return subprocess.run(net.wrap(src, [sys.executable, "-c", CONNECT, ip]), capture_output=True).returncode == 0


def test_hosts_reach_each_other_and_a_partition_cuts_one_off(net: Network) -> None:
    a, b = net.add("a"), net.add("b")
    assert a.ip != b.ip and "127.0.0.1" not in (a.ip, b.ip)
    server = subprocess.Popen(net.wrap("b", [sys.executable, "-c", LISTEN, b.ip]), stdout=subprocess.PIPE)
    try:
        assert server.stdout is not None and server.stdout.readline() == b"up\n"
        assert reaches(net, "a", b.ip)
        assert not reaches(net, "a", "127.0.0.1")  # a's loopback is a's own: nothing listens there
        net.partition("b")
        assert not reaches(net, "a", b.ip)
        net.heal("b")
        assert reaches(net, "a", b.ip)
    finally:
        server.kill()
        server.wait()


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_a_crashed_owners_network_is_removed_by_the_next_one() -> None:
    code = ("import os; from unicron.cluster.netns import Network; n = Network().create(); n.add('a');"
            " print(n.bridge, *[h.ns for h in n.hosts.values()], flush=True); os.kill(os.getpid(), 9)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": ROOT})
    bridge, ns = out.stdout.split()
    assert ns in namespaces()  # SIGKILLed: its atexit cleanup never ran
    assert cleanup_stale() >= 1
    assert ns not in namespaces()
    assert subprocess.run(["ip", "link", "show", bridge], capture_output=True).returncode != 0


def test_the_next_network_removes_a_sigkilled_owners_processes_with_its_namespaces(tmp_path: Path) -> None:
    """``ip netns delete`` only drops a namespace's name: a dead owner's daemons ran on inside, reached by
    nobody. The stale cleanup now kills the processes in each namespace first."""
    pid = etcd_of_a_sigkilled_owner(tmp_path, netns=True)
    try:
        cleanup_stale()
        assert gone(pid, 3.0), f"etcd pid {pid} of the dead owner still runs after cleanup_stale()"
    finally:
        if not gone(pid, 0.0):
            os.kill(pid, signal.SIGKILL)
