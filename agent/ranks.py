"""The agent's Unix socket for its ranks (exception propagation and progress reports, paper §4.1).

Each rank connects once (``unicron.kernel.client.AgentClient``), introduces itself with ``Hello`` and then
streams messages. A malformed line is logged and skipped; it never closes the connection or the
server. Instructions flow back on the same connection.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

from unicron.kernel import log as ulog
from unicron.kernel import protocol, wire
from unicron.kernel.errors import InvalidRecord

log = ulog.get(__name__)



@dataclass(frozen=True)
class Sender:
    """Who a connection's messages come from, as its ``Hello`` said: a process of a generation. A
    rank's old process (a replaced one, or a generation being stopped) may still be heard after its
    successor was launched: its messages are not its successor's."""

    task: str
    rank: int
    pid: int
    generation: int
    #: the process group of ``pid`` when it said hello: the process the agent launched (a group leader,
    #: ``Supervisor``), when the rank is its child (a wrapper script's python); ``pid`` if unknown
    group: int

    def pids(self) -> tuple[int, int]:
        """The pids the agent may know this sender's process by."""
        return self.pid, self.group


def _group_of(pid: int) -> int:
    try:
        return os.getpgid(pid)
    except (OSError, OverflowError):  # gone already, or a nonsense pid: known by its own pid only
        return pid


#: on_message(sender, message)
MessageHandler = Callable[[Sender, protocol.Message], None]


class RankServer:
    def __init__(self, path: str, on_message: MessageHandler) -> None:
        self.path = path
        self.on_message = on_message
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        os.chmod(path, 0o600)
        self._sock.listen(64)
        self._conns: dict[tuple[str, int], wire.LineSocket] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="rank-server", daemon=True)

    def start(self) -> RankServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        wire.stop_listening(self._sock, self._thread)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        with self._lock:
            conns = list(self._conns.values())
        for c in conns:
            c.close()

    def send(self, task: str, rank: int, msg: protocol.Message) -> bool:
        """Send an instruction to a connected rank; False if it is not connected."""
        with self._lock:
            conn = self._conns.get((task, rank))
        if conn is None:
            return False
        try:
            conn.send(msg.to_wire())
            return True
        except OSError:
            return False

    def connected(self) -> list[tuple[str, int]]:
        with self._lock:
            return sorted(self._conns)

    def _accept_loop(self) -> None:
        while (sock := wire.accept(self._sock, self._stop, "rank socket")) is not None:
            try:
                threading.Thread(target=self._serve, args=(wire.LineSocket(sock),), daemon=True).start()
            except RuntimeError as exc:  # no thread could be started: only this rank's connection is lost
                log.warning("rank socket: connection dropped", error=str(exc))
                sock.close()

    def _serve(self, conn: wire.LineSocket) -> None:
        sender: Sender | None = None
        try:
            while True:
                try:
                    line = conn.recv_line()
                except InvalidRecord as exc:
                    log.warning("rank socket: bad line skipped", error=str(exc))
                    continue
                except OSError:
                    return
                if line is None:
                    return
                try:
                    msg = protocol.parse(wire.decode(line))
                except InvalidRecord as exc:
                    who = None if sender is None else (sender.task, sender.rank)
                    log.warning("rank socket: bad message skipped", who=str(who), error=str(exc))
                    continue
                if isinstance(msg, protocol.Hello):
                    with self._lock:
                        # a second hello renames the connection: its old name must not outlive it
                        # (connected() would list a rank that is gone, send() would write to a closed socket)
                        if sender is not None and self._conns.get((sender.task, sender.rank)) is conn:
                            del self._conns[(sender.task, sender.rank)]
                        sender = Sender(msg.task, msg.rank, msg.pid, msg.generation, _group_of(msg.pid))
                        self._conns[(sender.task, sender.rank)] = conn
                if sender is None:
                    log.warning("rank socket: message before hello skipped", type=msg.TYPE)
                    continue
                try:
                    self.on_message(sender, msg)
                except Exception:
                    log.exception("rank socket: handler failed", type=msg.TYPE)
        finally:
            if sender is not None:
                with self._lock:
                    if self._conns.get((sender.task, sender.rank)) is conn:
                        del self._conns[(sender.task, sender.rank)]
            conn.close()
