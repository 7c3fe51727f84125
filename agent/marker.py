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
        self._respawn = threading.Event()  # a mark found no live helper: the spawner thread starts one
        self._first = threading.Event()  # the first start (without a spawner) was tried

    def start(self) -> FailureMarker:
        # Every helper is started on one thread of the marker's own, which lives as long as it: PDEATHSIG
        # follows the thread that forked, and a helper started by a mark on a rank's waiter thread (at
        # the rank's exit) was killed as soon as that thread ended.
        threading.Thread(target=self._spawner, name="marker-spawner", daemon=True).start()
        if self._prefork is None:
            self._first.wait()  # started with the agent, as before
        return self

    def _spawner(self) -> None:
        """Start the helper (without a spawner: at once; with one: forked once it serves, else left to
        the first mark), then a new one whenever a mark finds none alive."""
        warm, deadline = self._prefork, time.monotonic() + _WARM_WAIT_S
        try:
            if warm is None:
                self._start_helper()
        finally:
            self._first.set()
        while not self._stopped.is_set():
            asked = self._respawn.wait(None if warm is None else _POLL_S)
            if self._stopped.is_set():
                return
            if asked:
                self._respawn.clear()
                if not self._start_helper() and self._unanswered and not self._stopped.wait(1.0):
                    self._respawn.set()  # retried while a mark waits to be written
            elif warm is not None and (warm.ready() or time.monotonic() > deadline):
                # Only a fork: if it fails the first mark starts a new process
                if warm.ready():
                    self._start_helper(fork_only=True)
                warm = None

    def _start_helper(self, fork_only: bool = False) -> bool:
        """On the spawner thread: a new helper unless one runs. False if none could be started."""
        with self._lock:
            if self._stopped.is_set() or (self._proc is not None and self._proc.poll() is None):
                return True
            try:
                self._spawn(fork_only=fork_only)
            except (PreforkUnavailable, OSError) as exc:
                if fork_only:
                    log.info("failure marker left to the first mark", reason=str(exc))
                else:  # survivors still find out by heartbeat staleness
                    log.warning("failure marker unavailable", error=str(exc))
                return False
        return True

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
            if self._stopped.is_set():
                return False
            self._unanswered.append((request, answered))
            if self._proc is None or self._proc.poll() is not None or self._requests is None:
                self._respawn.set()  # never started here: the new helper is sent every unanswered request
            else:
                try:
                    self._requests.write(request)
                    self._requests.flush()
                except OSError as exc:  # it died meanwhile
                    log.info("failure marker helper gone; starting another", error=str(exc))
                    self._respawn.set()
        return wait_s <= 0 or self._wait(answered, wait_s)

    def _wait(self, answered: threading.Event, wait_s: float) -> bool:
        """Wait for the answer; a helper that dies meanwhile is replaced (and sent the request again)."""
        deadline = time.monotonic() + wait_s
        while not answered.wait(min(_POLL_S, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                return False
            with self._lock:
                if self._proc is not None and self._proc.poll() is not None:
                    self._respawn.set()
        return True

    def stop(self) -> None:
        self._stopped.set()
        self._respawn.set()  # wakes the spawner thread, which ends
        with self._lock:
            if self._proc is not None:
                # It holds nothing to save, and left to exit on EOF it spent 0.4-1.5 s in torch's teardown
                # (longer while still importing it): every agent stop waited for that.
                self._proc.kill()
                self._proc.wait()
                self._proc = None
            self._close_pipes()
            self._release_waiters()
