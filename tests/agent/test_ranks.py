"""The agent's rank server (agent/ranks.py) started and stopped in one process, as tests and in-process
agents do."""

from __future__ import annotations

import socket
import time
from pathlib import Path

from agent.ranks import RankServer
from tests.coordinator.test_link import descriptor_table_full
from unicron.kernel import protocol, wire


def test_a_stopped_rank_server_leaves_no_thread_in_accept_and_the_next_one_gets_its_ranks(tmp_path: Path) -> None:
    """A stopped agent's rank server took the connections of the next agent's in the same process:
    its thread stayed in accept() after close(), on a descriptor number the new server was given, and
    it dropped the ranks' messages as an unknown task's (seen in tests/agent/test_agent.py under load)."""
    got: list[tuple[str, str]] = []
    old = RankServer(str(tmp_path / "old.sock"), lambda sender, msg: got.append(("old", sender.task))).start()
    time.sleep(0.1)  # its thread is in accept() by now
    old.stop()
    assert not old._thread.is_alive()
    new = RankServer(str(tmp_path / "new.sock"), lambda sender, msg: got.append(("new", sender.task))).start()
    try:
        for i in range(20):
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(new.path)
                wire.LineSocket(s).send(protocol.Hello(task=f"t{i}", rank=0, local_rank=0, pid=1, generation=1).to_wire())
                deadline = time.monotonic() + 5.0
                while len(got) <= i and time.monotonic() < deadline:
                    time.sleep(0.01)
        assert got == [("new", f"t{i}") for i in range(20)]
    finally:
        new.stop()
    assert not new._thread.is_alive()


def test_rank_server_survives_a_transient_accept_error(tmp_path: Path) -> None:
    """One failed accept() (EMFILE: the agent's descriptor table full for a moment) ended the rank
    server's acceptor for good: no rank (a relaunched one included) could report to its agent again.
    Now the failure is logged and accept() retried: the rank that connected meanwhile is heard."""
    got: list[str] = []
    server = RankServer(str(tmp_path / "r.sock"), lambda sender, msg: got.append(sender.task)).start()
    s = socket.socket(socket.AF_UNIX)  # its descriptor taken before the table fills
    try:
        time.sleep(0.05)  # the acceptor is in accept()
        with descriptor_table_full():
            s.connect(server.path)  # needs no new descriptor here; the server's accept() does
            wire.LineSocket(s).send(protocol.Hello(task="t", rank=0, local_rank=0, pid=1, generation=1).to_wire())
            time.sleep(0.3)  # the acceptor's accept() fails meanwhile
        assert server._thread.is_alive(), "the rank server's acceptor exited after one EMFILE from accept()"
        deadline = time.monotonic() + 5.0
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
        assert got == ["t"]
    finally:
        s.close()
        server.stop()
