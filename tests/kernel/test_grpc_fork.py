"""A process of ours that runs gRPC threads (the etcd client) and forks children with a pre-exec hook
(the agent: ranks, sidecars, marker) must not have gRPC's fork handlers restart gRPC in the child:
close_fds then closes their descriptors before exec ("epoll_wait error: Bad file descriptor",
sometimes SIGABRT: a rank of tests/agent/test_agent.py died so, once in a full run). Importing
``unicron`` first turns the handlers off, as pytest, the agent and the CLI all do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# What the agent does: the etcd client's gRPC threads run while children are forked with a
# pre-exec hook (PDEATHSIG) and close_fds.
FORKING_WITH_GRPC = """
import subprocess, grpc
from unicron.kernel.parentdeath import preexec
channel = grpc.insecure_channel("127.0.0.1:9")
try:
    grpc.channel_ready_future(channel).result(timeout=0.3)
except grpc.FutureTimeoutError:
    pass
for _ in range(20):
    subprocess.Popen(["true"], preexec_fn=preexec(), close_fds=True).wait()
print("forked")
"""


def run(first: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    return subprocess.run([sys.executable, "-c", first + FORKING_WITH_GRPC], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


def test_children_forked_beside_grpc_threads_exec_cleanly_once_unicron_is_imported() -> None:
    """Failed before ``unicron/__init__.py`` set GRPC_ENABLE_FORK_SUPPORT (the agent module did, after
    pytest's conftest had imported grpc): 20 of 20 forks printed the handlers' messages."""
    done = run("import unicron.kernel.etcd\n")
    assert done.returncode == 0 and done.stdout.strip() == "forked", done.stderr
    assert "Bad file descriptor" not in done.stderr and "fork() handlers" not in done.stderr, done.stderr

