"""Liveness through the task store: each rank bumps ``hb/<rank>``; peers judge staleness locally.

A counter (not a timestamp) so that judging needs no synchronised clocks: a rank whose counter did not
move for ``window_s`` of the observer's own time is presumed dead. This covers a whole node dying,
where no agent is left to call :func:`unicron.runtime.store.mark_failed`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable

from unicron.runtime import store as keys
from unicron.runtime.comm import Store

log = logging.getLogger(__name__)


class Heartbeat:
    """Background thread bumping ``hb/<rank>`` every ``interval_s`` over its own store connection."""

    def __init__(self, host: str, port: int, rank: int, interval_s: float = 0.05) -> None:
        self._host, self._port, self._rank, self._interval = host, port, rank, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"unicron-hb-{rank}", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        # A separate connection: the training thread's store calls must never queue behind ours.
        try:
            conn = keys.connect(self._host, self._port)
        except Exception as exc:  # the thread must not die noisily; peers will see us stale
            log.warning("heartbeat: cannot connect to the store: %s", exc)
            return
        key = keys.hb_key(self._rank)
        while not self._stop.is_set():
            try:
                conn.add(key, 1)
            except Exception as exc:
                log.warning("heartbeat: store write failed: %s", exc)
            self._stop.wait(self._interval)


class StalenessJudge:
    """Tracks peers' heartbeat counters; a peer is stale when its counter, once moving, stood still
    for ``window_s``. A counter still at 0 belongs to a process that has not started beating yet
    (still importing, or never launched): not judged here; the agent's ``failed/`` mark covers it."""

    def __init__(self, store: Store, window_s: float) -> None:
        self._store = store
        self._window = window_s
        self._seen: dict[int, tuple[int, float]] = {}

    def stale(self, ranks: Iterable[int]) -> set[int]:
        now = time.monotonic()
        out: set[int] = set()
        for r in ranks:
            value = keys.counter(self._store, keys.hb_key(r))
            prev = self._seen.get(r)
            if value == 0:
                continue
            if prev is None or prev[0] != value:
                self._seen[r] = (value, now)
            elif now - prev[1] > self._window:
                out.add(r)
        return out
