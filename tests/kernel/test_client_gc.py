"""The rank client reports full garbage collections while training as the ``gc`` phase, over a real
Unix socket, without ever waiting for the socket inside the collector."""

from __future__ import annotations

import gc
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from unicron.kernel import protocol, wire
from unicron.kernel.client import AgentClient


class Agent:
    """The agent's end of one rank's socket: every message it receives, in order."""

    def __init__(self, path: str) -> None:
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(path)
        self.server.listen(1)
        self.messages: list[protocol.Message] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        conn = wire.LineSocket(self.server.accept()[0])
        while (line := conn.recv_line()) is not None:
            self.messages.append(protocol.parse(wire.decode(line)))

    def phases(self) -> list[str]:
        return [m.name for m in self.messages if isinstance(m, protocol.Phase)]

    def wait_for(self, n: int) -> list[protocol.Message]:
        deadline = time.monotonic() + 10.0
        while len(self.messages) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        return list(self.messages)

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[AgentClient, Agent]]:
    gc.disable()  # only the collections a test makes: an automatic one would add messages
    agent = Agent(str(tmp_path / "agent.sock"))
    client = AgentClient(rank=0, local_rank=0, task="t", socket_path=str(tmp_path / "agent.sock")).connect()
    agent.wait_for(1)  # the hello
    yield client, agent
    client.close()
    agent.close()
    gc.enable()


def test_a_full_collection_while_training_is_the_gc_phase_and_nothing_else_is(
        pair: tuple[AgentClient, Agent]) -> None:
    client, agent = pair
    gc.collect(0)  # a young generation: too short to matter, not reported
    gc.collect()
    msgs = agent.wait_for(3)
    assert agent.phases() == ["gc", "train"]
    start, end = msgs[1], msgs[2]
    assert isinstance(start, protocol.Phase) and isinstance(end, protocol.Phase) and start.ts <= end.ts
    with client.phase(protocol.PHASE_DATA):  # a data wait already stops the hang clock
        gc.collect()
    assert agent.wait_for(5) and agent.phases() == ["gc", "train", "data", "train"]
    with client.phase(protocol.PHASE_COLLECTIVE):  # training time to the hang clock: reported, back to it
        gc.collect()
    assert agent.wait_for(9) and agent.phases()[4:] == ["collective", "gc", "collective", "train"]
    client.close()
    assert client._on_gc not in gc.callbacks  # no callback outlives its client


def test_the_collector_never_waits_for_a_busy_socket_and_a_missed_end_goes_before_the_next_message(
        pair: tuple[AgentClient, Agent]) -> None:
    client, agent = pair
    conn = client._conn
    assert conn is not None
    with conn._send_lock:  # another send in flight: the start is not reported
        gc.collect()
    client.microbatch_done(1, 0)
    assert [type(m) for m in agent.wait_for(2)[1:]] == [protocol.MicrobatchDone]
    # a start sent, the end finding the socket busy: it is sent before the next message, with its time
    client._on_gc("start", {"generation": 2})  # as the collector calls it
    with conn._send_lock:
        t0 = time.time()
        client._on_gc("stop", {"generation": 2})
        t1 = time.time()
    assert len(agent.wait_for(3)) == 3 and agent.phases() == ["gc"]
    client.microbatch_done(1, 1)
    msgs = agent.wait_for(5)
    end = msgs[3]
    assert isinstance(end, protocol.Phase) and end.name == "train" and t0 <= end.ts <= t1
    assert isinstance(msgs[4], protocol.MicrobatchDone) and msgs[4].index == 1


def test_a_held_back_end_is_dropped_once_the_next_collection_starts(pair: tuple[AgentClient, Agent]) -> None:
    # the next start ends the earlier wait on the agent's side; the old end sent after it would close
    # the new collection's wait early
    client, agent = pair
    conn = client._conn
    assert conn is not None
    client._on_gc("start", {"generation": 2})
    with conn._send_lock:
        client._on_gc("stop", {"generation": 2})
    client._on_gc("start", {"generation": 2})
    client._on_gc("stop", {"generation": 2})
    client.microbatch_done(1, 0)
    msgs = agent.wait_for(5)  # in order: the microbatch comes after anything sent before it
    assert agent.phases() == ["gc", "gc", "train"]
    assert [type(m) for m in msgs[1:]] == [protocol.Phase] * 3 + [protocol.MicrobatchDone]


def test_a_process_the_rank_forked_says_nothing_on_the_ranks_connection(pair: tuple[AgentClient, Agent]) -> None:
    """Agent review: a DataLoader worker forked by the rank inherits its socket and its gc hook; its
    full collections sent phases the agent took for the rank's own (a `train` phase in the middle of
    a checkpoint restarted the hang clock and reported a hang)."""
    import os

    client, agent = pair
    pid = os.fork()
    if pid == 0:  # the worker: collections, and what it might send through the inherited client
        try:
            gc.collect()
            client.send(protocol.Phase(name=protocol.PHASE_TRAIN))
        finally:
            os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    with client.phase(protocol.PHASE_CHECKPOINT):
        pass
    got = agent.wait_for(3)
    assert agent.phases() == [protocol.PHASE_CHECKPOINT, protocol.PHASE_TRAIN], got
    assert client.enabled  # the rank's own connection is untouched
