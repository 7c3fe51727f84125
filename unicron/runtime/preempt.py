"""Work-conserving stop (Singularity-style preemption): a rank asked to stop by SIGTERM does not die
where it stands. The signal only raises a flag; the flag rides in the gradient tail like the agent's
``Stop``, so every member stops at the same iteration boundary, takes an on-demand snapshot of the
state it just committed, waits for that snapshot's background work (replication, persistence) and
exits 0 saying so. The agent gives it a bounded grace period (``AgentSettings.stop_grace_s``) before
SIGKILL, so a rank stuck in a collective with a dead peer cannot hold a stop up for longer.

The relaunched task restores that snapshot (``--resume``), nearest copy first: nothing computed before
the stop is computed again.
"""

from __future__ import annotations

import inspect
import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from ckpt.api import Checkpointer
from unicron.kernel import log as ulog
from unicron.runtime import stdout

log = ulog.get(__name__)

#: ``--stop-snapshot`` values
STOP_SNAPSHOT = ("on", "off")


class Preemption:
    """SIGTERM -> stop at the next boundary. ``snapshot``: take the on-demand snapshot when stopping
    (``--stop-snapshot on``, the default); off, the stop still waits for the boundary but saves only
    what the periodic checkpoints saved (what a plain Megatron job keeps)."""

    def __init__(self, snapshot: bool = True) -> None:
        self.snapshot = snapshot
        self.requested = False
        self.signalled_at: float | None = None
        self.saved: tuple[int, str] | None = None  # (iteration, where) of the on-demand snapshot
        #: why the on-demand snapshot did not reach storage (the runtime reads its save's outcome), or None
        self.not_persisted: str | None = None
        self._idle: Callable[[], bool] = lambda: False

    def install(self, idle: Callable[[], bool] = lambda: False) -> None:
        """Handle SIGTERM in this (the main) thread; a no-op elsewhere (signals go to the main thread).
        ``idle``: whether the rank holds no state worth saving yet (starting, waiting to join): then
        SIGTERM ends it at once, as it did before, instead of after the agent's grace."""
        self._idle = idle
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._idle():
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        # Only a flag: the handler runs between bytecodes of whatever the rank was doing.
        self.requested = True
        if self.signalled_at is None:
            self.signalled_at = time.time()

    def save(self, checkpointer: Checkpointer | None, state: Callable[[], Any], iteration: int, *,
             writer: bool, already_saved: bool) -> object:
        """The on-demand snapshot at ``iteration`` (a boundary every member agreed on). ``writer``: this
        rank writes (every rank for per-rank snapshots; one replica per shard for shared files);
        ``already_saved``: the periodic checkpoint of this very iteration was just taken. Returns what
        its ``save()`` returned (a ticket whose outcome says whether it was persisted), None if none."""
        if not self.snapshot or checkpointer is None or not writer:
            return None
        ticket = None if already_saved else save_persistent(checkpointer, state(), iteration)
        wait = getattr(checkpointer, "wait", None)
        if callable(wait):
            wait()  # replicated and persisted before the process exits (within the agent's grace)
        self.saved = (iteration, type(checkpointer).__name__)
        return ticket

    def report(self, rank: int, iteration: int) -> None:
        """The exit line: a stop that saved says where the relaunch resumes."""
        took = f" {time.time() - self.signalled_at:.2f} s after SIGTERM" if self.signalled_at else ""
        what = (f"on-demand snapshot of iteration {self.saved[0]} saved" if self.saved
                else "no on-demand snapshot (--stop-snapshot off or no --ckpt)")
        if self.saved and self.not_persisted:  # in node memory (and peers' replicas) only: say so
            what += f" in memory but NOT persisted ({self.not_persisted})"
        # stdout: the job's own output (the agent appends it to the rank's log), as Megatron prints
        stdout.status(f"rank {rank}: stopped at iteration {iteration}{took}; {what}")
        log.info("stopped on request", rank=rank, step=iteration, snapshot=self.saved is not None,
                 persisted=self.saved is not None and self.not_persisted is None)


def save_persistent(checkpointer: Checkpointer, state: Any, iteration: int) -> object:
    """Save ``state`` so that it reaches remote storage now, whatever ``persist_every`` says: a stop's
    snapshot must outlive every node. Returns what ``save()`` returned."""
    if "persist" in inspect.signature(checkpointer.save).parameters:
        return checkpointer.save(state, iteration, persist=True)  # type: ignore[call-arg]
    return checkpointer.save(state, iteration)  # a Checkpointer without tiers (torch-save): every save is persistent
