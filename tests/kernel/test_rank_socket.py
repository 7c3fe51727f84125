"""The rank socket's line protocol (``unicron.kernel.wire``) and the rank client's reports
(``unicron.kernel.client``) against the agent's rank server."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.ranks import RankServer
from tests.kernel.test_etcd import _wait
from unicron.kernel import protocol, wire
from unicron.kernel.client import AgentClient
from unicron.kernel.errors import InvalidRecord
from unicron.kernel.inject import MAX_SLOW_ITERATIONS, Fault, Injection


def test_an_over_long_line_is_skipped_whole_not_read_as_a_message_from_its_tail() -> None:
    """``recv_line`` drops its buffer once it holds more than MAX_LINE bytes without a newline, but
    then goes on reading mid-line: the rest of the over-long line up to its newline comes back as the
    next "line". The agent's rank server skips the InvalidRecord and parses that tail, so a peer's
    tail is taken as a message (here a complete ``stop``; JSON allows leading whitespace)."""
    a, b = socket.socketpair()
    reader = wire.LineSocket(b)
    sent = threading.Thread(
        target=a.sendall,
        args=(b" " * (wire.MAX_LINE + 300_000) + b'{"type":"stop","reason":"tail"}\n' + b'{"type":"hb"}\n',),
        daemon=True,
    )
    sent.start()
    try:
        with pytest.raises(InvalidRecord):
            while True:  # the over-long line is refused ...
                reader.recv_line()
        nxt = reader.recv_line()  # ... and the next line is the next message, not the refused line's tail
        assert nxt == b'{"type":"hb"}', f"got the over-long line's tail as a message: {wire.decode(nxt or b'{}')}"
    finally:
        a.close()
        b.close()
        sent.join(5.0)


def test_an_exception_with_a_long_message_still_reaches_the_agent(tmp_path: Path) -> None:
    """``report_exception`` cuts the traceback to 8,000 characters but sends ``message`` (``str(exc)``)
    whole. An exception whose text is over 1 MiB (a repr of a large tensor or dict, a long shape
    list) makes a line the agent refuses (wire.MAX_LINE): the rank's exception report is lost, and the
    agent learns of the failure only from the exit, classified as a plain abnormal exit."""
    got: list[protocol.Message] = []
    server = RankServer(str(tmp_path / "a.sock"), lambda sender, msg: got.append(msg)).start()
    client = AgentClient(rank=0, local_rank=0, task="t", socket_path=str(tmp_path / "a.sock")).connect()
    try:
        try:
            raise RuntimeError("CUDA error: an illegal memory access was encountered " + "x" * (2 << 20))
        except RuntimeError as exc:
            client.report_exception(exc)
        client.send(protocol.IterStart(step=7))  # a later message, to know the agent read past it
        assert _wait(lambda: any(isinstance(m, protocol.IterStart) for m in got), timeout=5.0)
        assert any(isinstance(m, protocol.ExceptionReport) for m in got), [m.TYPE for m in got]
    finally:
        client.close()
        server.stop()




def test_an_exception_whose_str_raises_is_still_reported() -> None:
    class Unprintable(RuntimeError):
        def __str__(self) -> str:
            raise ValueError("str broke")

    from unicron.kernel.client import _one_line

    assert _one_line(Unprintable()) == "Unprintable: <exception str() failed>"


@pytest.fixture
def connected(tmp_path: Path) -> Iterator[tuple[AgentClient, wire.LineSocket]]:
    """A rank's client connected to the agent's end of a real Unix socket."""
    path = str(tmp_path / "agent.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    client = AgentClient(rank=0, local_rank=0, task="t", socket_path=path).connect()
    agent = wire.LineSocket(listener.accept()[0])
    try:
        yield client, agent
    finally:
        client.close()
        agent.close()
        listener.close()


def test_inject_slow_with_a_large_iteration_count_does_not_kill_the_instruction_reader(
        connected: tuple[AgentClient, wire.LineSocket]) -> None:
    """The rank's reader expanded an InjectSlow into ``[msg] * iterations``: a large count was a
    MemoryError on that thread, which died, and the rank never again got Stop, Regroup, Leave or
    StoreMoved. Now the slowdown is one (delay, iterations left) entry counted down per iteration, and
    an Injection record (what 'unicron inject slow --iterations' writes) refuses a count over the bound."""
    client, agent = connected
    assert isinstance(protocol.parse(wire.decode(agent.recv_line() or b"")), protocol.Hello)
    agent.send(protocol.InjectSlow(delay_s=0.0, iterations=2**62).to_wire())
    agent.send(protocol.Stop(reason="operator").to_wire())
    got = client.next_instruction(timeout=3.0)
    assert isinstance(got, protocol.Stop), f"the rank's reader died on the inject: next instruction {got!r}"
    client.check_injected()
    client.check_injected()
    assert list(client._pending_slow) == [(0.0, 2**62 - 2)]
    with pytest.raises(InvalidRecord, match=r"Injection.iterations: 1000001 is not in \[1, 1000000\]"):
        Injection(fault=Fault.SLOW, iterations=MAX_SLOW_ITERATIONS + 1)


def test_an_injected_delay_out_of_range_is_clamped_not_the_ranks_end(
    connected: tuple[AgentClient, wire.LineSocket], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before: 'unicron inject slow --delay 1e300' was accepted (it is finite) and the rank's
    time.sleep(1e300) raised OverflowError at its next iteration (a negative delay from another writer
    was a ValueError there): the rank died and the task took a sev2 restart. Now the rank clamps the
    delay to [0, MAX_SLOW_DELAY_S] (with a warning), and an Injection record refuses one over it."""
    client, agent = connected
    slept: list[float] = []
    monkeypatch.setattr("unicron.kernel.client.time.sleep", slept.append)
    assert isinstance(protocol.parse(wire.decode(agent.recv_line() or b"")), protocol.Hello)
    agent.send(protocol.InjectSlow(delay_s=1e300).to_wire())
    agent.send(protocol.InjectSlow(delay_s=-1.0).to_wire())
    agent.send(protocol.Stop(reason="operator").to_wire())
    assert isinstance(client.next_instruction(timeout=3.0), protocol.Stop)
    client.check_injected()
    client.check_injected()
    assert slept == [3600.0, 0.0]  # protocol.MAX_SLOW_DELAY_S
    with pytest.raises(InvalidRecord, match=r"Injection.delay_s: 3600.5 is not a number of seconds in \[0, 3600\]"):
        Injection(fault=Fault.SLOW, delay_s=3600.5)


def test_injected_slowdowns_apply_in_order_one_iteration_each() -> None:
    """Two slow injections delay the next iterations in the order sent, each for its own count."""
    client = AgentClient(rank=0, local_rank=0, task="t", socket_path="unused")
    client._pending_slow.extend([(0.0, 2), (0.001, 1)])
    seen = []
    for _ in range(4):
        seen.append(list(client._pending_slow))
        client.check_injected()
    assert seen == [[(0.0, 2), (0.001, 1)], [(0.0, 1), (0.001, 1)], [(0.001, 1)], []]
