"""A task's rendezvous store sidecar (``python -m unicron.runtime.store``) hosted on this node.

The agent of an assignment's ``store_node`` picks a free port on its own advertised address,
starts the sidecar there and, once it says it listens, publishes the address (``stores/<task>``).
The sidecar is forked by the node's warm spawner when it serves (torch imported already: the store
listens in milliseconds, not seconds), else started as a new process. It dies with the agent
(PDEATHSIG, directly or through the spawner): an orphan would hold the port.
"""

from __future__ import annotations

import os
import select
import signal
import time
from typing import IO

from agent.prefork import Child, Prefork, start_helper, stop_process
from unicron.kernel import log as ulog
from unicron.kernel import parentdeath
from unicron.kernel.errors import TemporaryError
from unicron.kernel.net import free_port

log = ulog.get(__name__)

#: the sidecar imports torch before it listens: allow for a slow, loaded machine
START_TIMEOUT_S = 60.0
#: the sidecar's module, run as ``python -m``
MODULE = "unicron.runtime.store"
#: another process may take the free port between our probe and the sidecar's bind
START_ATTEMPTS = 3


class StoreSidecar:
    """One running sidecar: its process and the address it listens on."""

    def __init__(self, proc: Child, host: str, port: int, stdout: IO[bytes] | None = None) -> None:
        self.proc = proc
        self.host = host
        self.port = port
        #: the read end of its stdout, where it says it listens; held open while it runs (closed, a later
        #: print of the sidecar's would fail)
        self._stdout = stdout
        #: set before the agent stops it: an exit then is no loss of the store
        self.stopping = False

    @classmethod
    def start(cls, host: str, task: str, timeout_s: float = START_TIMEOUT_S,
              prefork: Prefork | None = None) -> StoreSidecar:
        """Start a sidecar on a free port of ``host``; returns once it listens. Raises TemporaryError."""
        error = ""
        for _ in range(START_ATTEMPTS):
            sidecar = cls.spawn(host, prefork)
            error = sidecar.ready(task, timeout_s)
            if not error:
                return sidecar
        raise TemporaryError(f"task {task}: the store sidecar could not listen on {host}: {error}")

    @classmethod
    def spawn(cls, host: str, prefork: Prefork | None = None) -> StoreSidecar:
        """Start a sidecar process on a free port of ``host`` without waiting: :meth:`ready` may then
        be awaited on any thread, but the calling thread must outlive a sidecar started as a new process
        (PDEATHSIG follows the thread that forked it)."""
        port = free_port(host)
        read_end, write_end = os.pipe()
        try:
            proc = start_helper(prefork, MODULE, ["--host", host, "--port", str(port)],
                                stdout=write_end, preexec=parentdeath.preexec(signal.SIGKILL))
        except OSError:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
        return cls(proc, host, port, os.fdopen(read_end, "rb"))

    def ready(self, task: str, timeout_s: float = START_TIMEOUT_S) -> str:
        """"" once the sidecar listens; else why not, and it is stopped."""
        error = _await_listening(self.proc, self._stdout, timeout_s)
        if not error:
            log.info("store sidecar listening", task=task, host=self.host, port=self.port, pid=self.proc.pid)
            return ""
        self.stop()
        log.warning("store sidecar did not start", task=task, host=self.host, port=self.port, error=error)
        return error

    def stop(self) -> None:
        self.stopping = True
        stop_process(self.proc, grace_s=1.0)
        if self._stdout is not None:
            self._stdout.close()


def _await_listening(proc: Child, stdout: IO[bytes] | None, timeout_s: float) -> str:
    """"" once ``proc`` printed its listening line on ``stdout``, else why not."""
    if stdout is None:
        return "its output is not read"
    fd = stdout.fileno()
    deadline = time.monotonic() + timeout_s
    seen = b""
    while b"\n" not in seen:
        left = deadline - time.monotonic()
        if left <= 0:
            return f"not listening after {timeout_s:.0f} s"
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, 4096)
        if not chunk:
            return f"exited with {proc.wait()}"
        seen += chunk
    return "" if b"listening" in seen else f"said {seen.decode(errors='replace').strip()!r}"
