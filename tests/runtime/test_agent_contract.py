"""The rank <-> agent contract over the real Unix socket: what ranks report (iterations, micro-batches,
exceptions, regroups) and how they follow instructions (an injected sev3 fault, Stop). The test plays
the agent's socket side; the ranks are the real runtime."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.runtime.conftest import Runner, train_args, wait_for
from unicron.cluster.launch import LocalJob
from unicron.kernel import protocol, wire
from unicron.kernel.client import AgentClient


class FakeAgentSocket:
    """Accepts rank connections, records every message, sends instructions to a rank."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(path)
        self.server.listen(16)
        self.messages: list[tuple[int, protocol.Message]] = []
        self.conns: dict[int, wire.LineSocket] = {}
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(wire.LineSocket(sock),), daemon=True).start()

    def _serve(self, conn: wire.LineSocket) -> None:
        rank = -1
        while (line := conn.recv_line()) is not None:
            msg = protocol.parse(wire.decode(line))
            with self.lock:
                if isinstance(msg, protocol.Hello):
                    rank = msg.rank
                    self.conns[rank] = conn
                self.messages.append((rank, msg))

    def of(self, rank: int, kind: type[protocol.Message]) -> list[Any]:
        with self.lock:
            return [m for r, m in self.messages if r == rank and isinstance(m, kind)]

    def send(self, rank: int, msg: protocol.Message) -> None:
        with self.lock:
            self.conns[rank].send(msg.to_wire())

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def agent_socket(tmp_path: Path) -> Iterator[FakeAgentSocket]:
    sock = FakeAgentSocket(str(tmp_path / "agent.sock"))
    try:
        yield sock
    finally:
        sock.close()


def test_ranks_report_to_the_agent_and_follow_its_instructions(runner: Runner, agent_socket: FakeAgentSocket) -> None:
    args = train_args(0, "float32", False, "--iter-sleep", "0.02")
    env = {"UNICRON_AGENT_SOCKET": agent_socket.path}

    def drive(job: LocalJob) -> None:
        wait_for(lambda: len(agent_socket.of(1, protocol.IterEnd)) >= 2, 60, "two iterations on rank 1")
        agent_socket.send(1, protocol.InjectRaise(kind="connection_refused_reset", message="from the agent"))
        wait_for(lambda: bool(agent_socket.of(1, protocol.RegroupDone)[1:]), 60, "the reattempt regroup")
        wait_for(lambda: len(agent_socket.of(0, protocol.IterEnd)) >= 5, 60, "iterations after it")
        agent_socket.send(0, protocol.Stop(reason="test"))  # one rank told: all stop together

    done = runner.run(2, args, while_running=drive, env={0: env, 1: env})
    assert done.codes == {0: 0, 1: 0}, done.job.logs()
    for rank in (0, 1):
        hello = agent_socket.of(rank, protocol.Hello)
        assert hello and hello[0].pid > 0 and hello[0].task == "local"
        starts, ends = agent_socket.of(rank, protocol.IterStart), agent_socket.of(rank, protocol.IterEnd)
        assert ends and all(e.duration_s > 0 for e in ends)
        assert {m.index for m in agent_socket.of(rank, protocol.MicrobatchDone) if m.step == 0} == (
            {0, 1, 2, 3} if rank == 0 else {4, 5, 6, 7}
        )
        regroups = agent_socket.of(rank, protocol.RegroupDone)
        assert [r.epoch for r in regroups] == [0, 1] and all(r.ok for r in regroups)
        assert len(starts) >= len(ends)
    assert done.result(0)["iterations"] == done.result(1)["iterations"], "Stop must be agreed"
    raised = agent_socket.of(1, protocol.ExceptionReport)
    assert raised and raised[0].kind == "connection_refused_reset" and raised[0].fatal is False
    assert all(not e.fatal for e in agent_socket.of(0, protocol.ExceptionReport)), "peer errors are non-fatal"
    assert "reattempt" in agent_socket.of(1, protocol.RegroupDone)[1].detail
    assert os.path.exists(agent_socket.path)


def test_an_agents_regroup_never_takes_the_ranks_it_names_for_dead(
    runner: Runner, agent_socket: FakeAgentSocket,
) -> None:
    """A Regroup names the ranks a sev3 came from: alive. The runtime once took them for dead, for good,
    so the other rank regrouped alone and then re-proposed admitting it without end (issue 13)."""
    args = train_args(0, "float32", False, "--iter-sleep", "0.02")
    env = {"UNICRON_AGENT_SOCKET": agent_socket.path}

    def drive(job: LocalJob) -> None:
        wait_for(lambda: len(agent_socket.of(0, protocol.IterEnd)) >= 2, 60, "two iterations on rank 0")
        agent_socket.send(0, protocol.Regroup(epoch=1, members=[0, 1], failed=[1]))
        wait_for(lambda: bool(agent_socket.of(0, protocol.RegroupDone)[1:]), 60, "the agent's regroup")
        n = len(agent_socket.of(1, protocol.IterEnd))
        wait_for(lambda: len(agent_socket.of(1, protocol.IterEnd)) >= n + 5, 60, "rank 1 to train on")
        agent_socket.send(0, protocol.Stop(reason="test"))

    done = runner.run(2, args, while_running=drive, env={0: env, 1: env})
    assert done.codes == {0: 0, 1: 0}, done.job.logs()
    for rank in (0, 1):
        regroups = agent_socket.of(rank, protocol.RegroupDone)
        assert [r.epoch for r in regroups] == [0, 1], [r.detail for r in regroups]  # one regroup, no churn
        assert "members=[0, 1]" in regroups[1].detail, regroups[1].detail
    assert done.result(0)["iterations"] == done.result(1)["iterations"]


def test_a_phase_inside_a_phase_returns_to_the_outer_one(agent_socket: FakeAgentSocket) -> None:
    """The trainer fetches data in the data phase; nested in another phase, leaving it must not
    report training (which would end e.g. a regroup's pause early)."""
    client = AgentClient(rank=3, local_rank=0, socket_path=agent_socket.path).connect()
    try:
        with client.phase(protocol.PHASE_REGROUP), client.phase(protocol.PHASE_DATA):
            pass
        with client.phase(protocol.PHASE_DATA):
            pass
        deadline = time.monotonic() + 5
        while len(agent_socket.of(3, protocol.Phase)) < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        client.close()
    assert [m.name for m in agent_socket.of(3, protocol.Phase)] == [
        "regroup", "data", "regroup", "train", "data", "train"]
