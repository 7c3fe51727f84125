"""Tells a task's surviving ranks, through its rendezvous store, that a rank died: adds 1 to
``failed/<rank>`` there. The write needs torch's store client, which the agent must not import, so it
is done by a helper process, ``python -m unicron.runtime.membership --marker`` (the protocol, its key and
its reader are described in :mod:`unicron.runtime.membership`)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import IO

from unicron.kernel import log as ulog

log = ulog.get(__name__)

#: how often a waiting mark looks whether its helper died
_POLL_S = 0.1


class FailureMarker:
    """Owns the marker process; :meth:`mark` never raises, and blocks only when asked to wait."""

    def __init__(self, preexec: Callable[[], object] | None = None) -> None:
        self._preexec = preexec
        self._proc: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()
        #: each request sent and not yet answered with its waiter, in order (the helper answers in
        #: order); a new helper is sent them again: a mark raises ``failed`` to the dead process's
        #: incarnation and never beyond, so writing one twice is harmless, and dropping one is not
        self._unanswered: deque[tuple[str, threading.Event]] = deque()

    def start(self) -> FailureMarker:
        with self._lock:
            self._spawn()
        return self

    def _spawn(self) -> None:
        """Under the lock: a new helper, sent what the dead one never answered."""
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "unicron.runtime.membership", "--marker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, bufsize=1, preexec_fn=self._preexec,
        )
        assert self._proc.stdout is not None and self._proc.stdin is not None
        threading.Thread(target=self._read_answers, args=(self._proc.stdout,), name="marker-answers",
                         daemon=True).start()
        if self._unanswered:
            self._proc.stdin.write("".join(request for request, _ in self._unanswered))
            self._proc.stdin.flush()

    def _read_answers(self, out: IO[str]) -> None:
        for line in out:
            try:
                answer = json.loads(line)
            except ValueError:
                continue
            if answer.get("ready"):
                continue
            with self._lock:  # a dead helper's late answers are not the new one's
                if self._unanswered and self._proc is not None and self._proc.stdout is out:
                    self._unanswered.popleft()[1].set()
            if answer.get("ok") is False:
                log.info("could not mark a rank failed in its store", error=str(answer.get("error")))

    def _release_waiters(self) -> None:
        """Under the lock."""
        while self._unanswered:
            self._unanswered.popleft()[1].set()

    def mark(self, host: str, port: int, rank: int, wait_s: float = 0.0) -> bool:
        """The rank's newest process is gone (:func:`unicron.runtime.membership.mark_failed`). With
        ``wait_s``, wait that long for the helper's answer: False if none came (or it failed to send)."""
        request = json.dumps({"host": host, "port": port, "rank": rank}) + "\n"
        answered = threading.Event()
        with self._lock:
            try:
                if self._proc is None or self._proc.poll() is not None:
                    self._spawn()
                assert self._proc is not None and self._proc.stdin is not None
                self._unanswered.append((request, answered))
                self._proc.stdin.write(request)
                self._proc.stdin.flush()
            except OSError as exc:  # survivors still find out by heartbeat staleness
                log.warning("failure marker unavailable", error=str(exc))
                return False
        return wait_s <= 0 or self._wait(answered, wait_s)

    def _wait(self, answered: threading.Event, wait_s: float) -> bool:
        """Wait for the answer; a helper that dies meanwhile is replaced (and sent the request again)."""
        deadline = time.monotonic() + wait_s
        while not answered.wait(min(_POLL_S, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                return False
            with self._lock:
                try:
                    if self._proc is not None and self._proc.poll() is not None:
                        self._spawn()
                except OSError as exc:
                    log.warning("failure marker unavailable", error=str(exc))
                    return False
        return True

    def stop(self) -> None:
        with self._lock:
            if self._proc is not None:
                if self._proc.stdin is not None:
                    self._proc.stdin.close()
                # It holds nothing to save, and left to exit on EOF it spent 0.4-1.5 s in torch's teardown
                # (longer while still importing it): every agent stop waited for that.
                self._proc.kill()
                self._proc.wait()
                self._proc = None
            self._release_waiters()
