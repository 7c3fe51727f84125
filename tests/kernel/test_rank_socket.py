"""The rank socket's line protocol (``unicron.kernel.wire``) and the rank client's reports
(``unicron.kernel.client``) against the agent's rank server."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from agent.ranks import RankServer
from tests.kernel.test_etcd import _wait
from unicron.kernel import protocol, wire
from unicron.kernel.client import AgentClient
from unicron.kernel.errors import InvalidRecord


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
    server = RankServer(str(tmp_path / "a.sock"), lambda task, rank, msg: got.append(msg)).start()
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
