"""Tells a task's surviving ranks, through its rendezvous store, that a rank died: adds 1 to
``failed/<rank>`` there. The write needs torch's store client, which the agent must not import, so it
is done by a helper process, ``python -m unicron.runtime.membership --marker`` (the protocol, its key and
its reader are described in :mod:`unicron.runtime.membership`).

With the node's warm spawner the helper is forked from it (milliseconds, no import) as soon as the
spawner serves; without one it is started with the agent, as a new process that imports torch
(seconds, and as much CPU as a rank's start). Either way a death is never marked behind a start: a
reconfigure's survivors regroup on the mark of the lost node's ranks."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import IO

from agent.prefork import Child, Prefork, PreforkUnavailable, start_helper
from unicron.kernel import log as ulog

log = ulog.get(__name__)

#: the helper's module, run as ``python -m MODULE --marker``
MODULE = "unicron.runtime.membership"
#: how often a waiting mark looks whether its helper died
_POLL_S = 0.1
#: how long the agent's start waits for its spawner's imports before leaving the marker to the first mark
_WARM_WAIT_S = 300.0


class FailureMarker:
    """Owns the marker process; :meth:`mark` never raises, and blocks only when asked to wait."""

    def __init__(self, preexec: Callable[[], None] | None = None, prefork: Prefork | None = None) -> None:
        self._preexec = preexec
        self._prefork = prefork
        self._proc: Child | None = None
        self._requests: IO[str] | None = None  # the helper's stdin
        self._answers: IO[str] | None = None  # its stdout
        self._lock = threading.Lock()
        #: each request sent and not yet answered with its waiter, in order (the helper answers in
        #: order); a new helper is sent them again: a mark raises ``failed`` to the dead process's
        #: incarnation and never beyond, so writing one twice is harmless, and dropping one is not
        self._unanswered: deque[tuple[str, threading.Event]] = deque()
        self._stopped = threading.Event()

    def start(self) -> FailureMarker:
        if self._prefork is None:
            with self._lock:
                self._spawn()
        else:
            threading.Thread(target=self._fork_when_warm, args=(self._prefork,), name="marker-warm",
                             daemon=True).start()
        return self

    def _fork_when_warm(self, prefork: Prefork) -> None:
        """Fork the helper once the spawner serves. Only a fork: a new process started from this
        short-lived thread would die with it (PDEATHSIG); if the fork fails the first mark starts one."""
        deadline = time.monotonic() + _WARM_WAIT_S
        while not prefork.ready():
            if self._stopped.wait(_POLL_S) or time.monotonic() > deadline:
                return
        with self._lock:
            if self._proc is not None or self._stopped.is_set():
                return
            try:
                self._spawn(fork_only=True)
            except (PreforkUnavailable, OSError) as exc:
                log.info("failure marker left to the first mark", reason=str(exc))

    def _spawn(self, fork_only: bool = False) -> None:
        """Under the lock: a new helper, sent what the dead one never answered."""
        self._close_pipes()
        requests_r, requests_w = os.pipe()
        answers_r, answers_w = os.pipe()
        try:
            self._proc = start_helper(self._prefork, MODULE, ["--marker"], stdout=answers_w,
                                      stdin=requests_r, preexec=self._preexec, fork_only=fork_only)
        except (PreforkUnavailable, OSError):
            os.close(requests_w)
            os.close(answers_r)
            raise
        finally:
            os.close(requests_r)
            os.close(answers_w)
        self._requests = os.fdopen(requests_w, "w", buffering=1)
        self._answers = answers = os.fdopen(answers_r, "r", errors="replace")
        threading.Thread(target=self._read_answers, args=(answers,), name="marker-answers", daemon=True).start()
        if self._unanswered:
            self._requests.write("".join(request for request, _ in self._unanswered))
            self._requests.flush()

    def _close_pipes(self) -> None:
        """Under the lock. The answers are closed by their reader, at the end of file the helper's exit
        leaves (closed here, under a reader blocked in them, the close would wait for that reader)."""
        if self._requests is not None:
            with contextlib.suppress(OSError):
                self._requests.close()
        self._requests = self._answers = None

    def _read_answers(self, out: IO[str]) -> None:
        with out:
            for line in out:
                self._answered(out, line)

    def _answered(self, out: IO[str], line: str) -> None:
        try:
            answer = json.loads(line)
        except ValueError:
            return
        if not isinstance(answer, dict) or answer.get("ready"):
            return
        with self._lock:  # a dead helper's late answers are not the new one's
            if self._unanswered and self._answers is out:
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
                assert self._requests is not None
                self._unanswered.append((request, answered))
                self._requests.write(request)
                self._requests.flush()
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
        self._stopped.set()
        with self._lock:
            if self._proc is not None:
                # It holds nothing to save, and left to exit on EOF it spent 0.4-1.5 s in torch's teardown
                # (longer while still importing it): every agent stop waited for that.
                self._proc.kill()
                self._proc.wait()
                self._proc = None
            self._close_pipes()
            self._release_waiters()
