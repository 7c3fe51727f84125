"""Liveness through the task store: each rank bumps ``hb/<rank>``; peers judge staleness locally.

A counter (not a timestamp) so that judging needs no synchronised clocks: a rank whose counter did not
move for ``window_s`` of the observer's own time is presumed dead. This covers a whole node dying,
where no agent is left to call :func:`unicron.runtime.membership.mark_failed`.

The same thread watches the store keys the training loop would otherwise poll every iteration (the
launcher's ``stop``, join requests of ranks outside the group), so that no store round trip lies on
the iteration's path: the loop reads the thread's last observation.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import signal
import time
from collections.abc import Callable, Iterable

from unicron.kernel import log as ulog
from unicron.kernel.parentdeath import die_with_parent
from unicron.kernel.procs import DEAD_STATES, STOPPED_STATES, proc_state
from unicron.runtime import store as keys
from unicron.runtime.comm import RendezvousStore

log = ulog.get(__name__)

STOP_KEY = "stop"
"""Store key that asks every rank to stop at the next iteration boundary (the launcher's Stop)."""
WATCH_PERIOD_S = 1.0
"""How often the beater looks at the stop key and join requests."""


class Heartbeat:
    """A small forked process that bumps ``hb/<rank>`` every ``interval_s`` and watches the ``stop``
    key and the join requests of the ``outside`` ranks, over its own store connection.

    Every 0.5 s by default (``--heartbeat-interval``), ten beats per default staleness window (5 s),
    which is what bounds detection anyway: a beat costs about 0.15 ms of CPU, so at 50 ms a beater
    takes 0.8 % of a core (measured), which four ranks sharing two cores feel in every iteration.

    A process, not a thread: a Python thread that wakes every 50 ms takes the GIL from the training
    thread, and on a busy machine the handoff stalls training until the OS schedules the waker
    (measured: +15 % iteration time with 4 ranks on 2 cores). The two share a few bytes of anonymous
    shared memory. The beater dies with its rank (PR_SET_PDEATHSIG, plus a parent check each tick)
    and stops beating while its rank is stopped (SIGSTOP), so a frozen rank still goes stale.
    """

    _PAUSED, _STOP_SEEN, _JOIN_SEEN, _QUIT, _MOVED = 0, 1, 2, 3, 4
    _HEADER = 8
    _ADDR = 256  # "host:port" of a moved store (after the per-rank join mask)

    def __init__(self, host: str, port: int, rank: int, interval_s: float = 0.5, world: int = 4096,
                 asking: Callable[[RendezvousStore, int], object] | None = None) -> None:
        """``asking(store, rank)``: whether an outside rank asks to join (truthy); by default, that its
        ``join/<rank>`` exists (:func:`unicron.runtime.membership.asking_to_join` also tells a key a
        dead joiner left: with it, the iteration path never checks the store for that rank again)."""
        self._host, self._port, self._rank, self._interval = host, port, rank, interval_s
        self._world = world
        self._asking = asking or (lambda store, r: store.check([keys.join_key(r)]))
        self._mem = mmap.mmap(-1, self._HEADER + world + self._ADDR)
        self._pid = 0

    # --- shared flags ----------------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        """While set, no beats and no store access (the benchmark's plain-loop rounds)."""
        return bool(self._mem[self._PAUSED])

    @paused.setter
    def paused(self, value: bool) -> None:
        self._mem[self._PAUSED] = int(value)

    @property
    def stop_seen(self) -> bool:
        return bool(self._mem[self._STOP_SEEN])

    @property
    def join_seen(self) -> bool:
        return bool(self._mem[self._JOIN_SEEN])

    @property
    def outside(self) -> tuple[int, ...]:
        return tuple(r for r in range(self._world) if self._mem[self._HEADER + r])

    @outside.setter
    def outside(self, ranks: tuple[int, ...]) -> None:
        mask = bytearray(self._world)
        for r in ranks:
            mask[r] = 1
        self._mem[self._HEADER : self._HEADER + self._world] = bytes(mask)

    def move(self, host: str, port: int) -> None:
        """The task's store moved (its node was lost): beat there from now on."""
        addr = f"{host}:{port}".encode()[: self._ADDR - 1]
        at = self._HEADER + self._world
        self._mem[at : at + self._ADDR] = addr + bytes(self._ADDR - len(addr))
        self._mem[self._MOVED] = (self._mem[self._MOVED] + 1) % 256  # after the address: the beater reads it then

    def _moved_to(self) -> tuple[str, int]:
        at = self._HEADER + self._world
        host, _, port = bytes(self._mem[at : at + self._ADDR]).rstrip(b"\0").decode().rpartition(":")
        return host, int(port)

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> Heartbeat:
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the beater
            code = 0
            try:
                self._child(parent)
            except BaseException:  # never run the rank's code in this process
                code = 1
            finally:
                os._exit(code)
        self._pid = pid
        return self

    def stop(self) -> None:
        self._mem[self._QUIT] = 1
        if self._pid:
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(self._pid, 0)
            self._pid = 0

    def _child(self, parent: int) -> None:
        die_with_parent(parent)  # (also checked each tick: getppid)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the rank handles ^C; we follow it out
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the rank stops at a boundary (preempt.py); we follow it
        try:
            conn = keys.connect(self._host, self._port)
        except Exception as exc:
            log.warning("heartbeat cannot connect to the store", rank=self._rank, error=str(exc))
            return
        key = keys.hb_key(self._rank)
        mem = self._mem
        failures = 0
        # The stop key and join requests are looked at about once a second, not every beat: they are
        # acted on at an iteration boundary anyway, and each look is a store round trip.
        watch_every, tick = max(1, round(WATCH_PERIOD_S / self._interval)), 0
        moved = 0  # a move before this process got here is still acted on
        while not mem[self._QUIT] and os.getppid() == parent:
            try:
                if mem[self._MOVED] != moved:
                    version = mem[self._MOVED]
                    conn = keys.connect(*self._moved_to(), timeout_s=5.0)
                    moved = version  # only once connected: a failed connect is tried again next beat
                if not mem[self._PAUSED] and _running(parent):
                    conn.add(key, 1)
                    if tick % watch_every == 0:
                        self._watch(conn)
                    tick += 1
                failures = 0
            except Exception as exc:
                failures += 1
                # Logged once, and tried for as long as the rank lives: its StoreMoved may come any time
                # within its regroup timeout (90 s); a beater that gave up never read the move.
                if failures == 1:
                    log.warning("heartbeat store access failed", rank=self._rank, error=str(exc).splitlines()[0])
            time.sleep(self._interval)

    def _watch(self, conn: RendezvousStore) -> None:
        mem = self._mem
        if conn.check([STOP_KEY]):
            mem[self._STOP_SEEN] = 1
        outside = [r for r in range(self._world) if mem[self._HEADER + r]]
        mem[self._JOIN_SEEN] = int(any(self._asking(conn, r) for r in outside))


def _running(pid: int) -> bool:
    """False while ``pid`` is stopped (SIGSTOP) or a zombie: a frozen rank must not look alive."""
    state = proc_state(pid)
    return state is None or state not in STOPPED_STATES | DEAD_STATES


class StalenessJudge:
    """Tracks peers' heartbeat counters; a peer is stale when its counter, once moving, stood still
    for ``window_s``. A counter still at 0 belongs to a process that has not started beating yet
    (still importing, or never launched): not judged here; the agent's ``failed/`` mark covers it."""

    def __init__(self, store: RendezvousStore, window_s: float) -> None:
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
