"""One monitoring thread per GPU (paper §3.1: "a dedicated monitoring thread on the CPU for each GPU").

Each thread blocks in the backend's event wait, so a driver event reaches ``on_event`` within about a
millisecond, and polls the GPU's health every ``health_interval_s``. A health poll that shows the GPU
turning bad (new uncorrected ECC errors, an NVLink link down, a pending page retirement, a recovery
action requested by the driver) also produces an event, unless an event of the same kind was already
delivered for that GPU since the previous poll (the driver usually announces the same fault first).
A backend failure is logged and retried with exponential backoff; it never ends the thread. While
the GPU's queries fail its health reads ``ok=False``; a lost GPU is reported at once, any other
failure once it persists for ``report_after_failures`` attempts in a row (a GPU that answers only
errors was otherwise never reported, and the node's status kept its last good poll).

A watchdog thread notices a backend call that does not return (a wedged GPU or driver: NVML calls
block): after ``stall_s`` the GPU is reported once and shows ``ok=False``. Its thread, blocked in the
call, polled and delivered nothing more, for good, and nothing said so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator

from agent.gpu.api import RECOVERY_NONE, GpuBackend, GpuEvent, GpuHealth, GpuLost
from unicron.kernel import log as ulog
from unicron.kernel.errors import ConfigError
from unicron.kernel.types import ErrorKind

log = ulog.get(__name__)

EventCallback = Callable[[GpuEvent], None]
HealthCallback = Callable[[GpuHealth], None]


def health_transitions(prev: GpuHealth | None, cur: GpuHealth) -> list[GpuEvent]:
    """Events for what turned bad between two polls; ``prev`` None compares against a clean GPU
    (so a GPU already faulty when the agent starts is reported once)."""
    prev_dbe = (prev.ecc_dbe or 0) if prev else 0
    prev_down = set(prev.nvlink_down) if prev else set()
    prev_pending = prev.retired_pages_pending if prev else False
    prev_action = prev.recovery_action if prev else RECOVERY_NONE
    out: list[GpuEvent] = []

    def add(kind: ErrorKind, message: str) -> None:
        out.append(GpuEvent(cur.gpu, kind, None, message, cur.ts))

    if cur.ecc_dbe is not None and cur.ecc_dbe > prev_dbe:
        add(ErrorKind.ECC_ERROR, f"uncorrected ECC errors {prev_dbe} -> {cur.ecc_dbe}")
    new_down = sorted(set(cur.nvlink_down) - prev_down)
    if new_down:
        add(ErrorKind.NVLINK_ERROR, f"NVLink link(s) {new_down} down")
    if cur.retired_pages_pending and not prev_pending:
        add(ErrorKind.ECC_ERROR, "page retirement / row remap pending (GPU reset needed)")
    if cur.recovery_action not in (None, RECOVERY_NONE) and cur.recovery_action != prev_action:
        add(ErrorKind.GPU_DRIVER_ERROR, f"driver requests recovery action {cur.recovery_action}")
    return out


class GpuMonitor:
    """Runs one thread per GPU of ``backend``; callbacks run on those threads (keep them short).

    ``on_event(GpuEvent)``: a reportable fault (informational events are only logged).
    ``on_health(GpuHealth)``: every health poll (for the node's status summary); ``ok=False`` for one
    that failed.
    """

    def __init__(
        self,
        backend: GpuBackend,
        on_event: EventCallback,
        on_health: HealthCallback,
        health_interval_s: float = 2.0,
        max_block_s: float = 0.25,
        backoff_s: tuple[float, float] = (0.05, 5.0),
        report_after_failures: int = 5,
        stall_s: float | None = None,
    ) -> None:
        if health_interval_s <= 0:
            raise ConfigError(f"health_interval_s must be > 0, got {health_interval_s}")
        if max_block_s <= 0:
            raise ConfigError(f"max_block_s must be > 0, got {max_block_s}")
        self.backend = backend
        self._on_event = on_event
        self._on_health = on_health
        self._interval = health_interval_s
        # NVML waits cannot be interrupted: bounding each wait bounds how long stop() takes.
        self._max_block = max_block_s
        self._backoff = backoff_s
        # with the default backoff, 5 failures in a row take 1.5 s: past a transient error
        self._report_after = max(1, report_after_failures)
        # a health poll takes milliseconds and an event wait at most max_block_s: a call this long is stuck
        self._stall_s = stall_s if stall_s is not None else max(4 * health_interval_s, 8 * max_block_s)
        if self._stall_s <= 0:
            raise ConfigError(f"stall_s must be > 0, got {stall_s}")
        #: gpu -> when its thread's backend call in progress began (monotonic); absent between calls
        self._calling: dict[int, float] = {}
        self._stalled: set[int] = set()  # GPUs whose stuck call was reported
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._latest: dict[int, GpuHealth] = {}
        self._latest_lock = threading.Lock()

    def start(self) -> None:
        if self._threads:
            return
        self._stop.clear()
        for gpu in range(self.backend.device_count()):
            t = threading.Thread(target=self._run, args=(gpu,), name=f"gpu-monitor-{gpu}", daemon=True)
            self._threads.append(t)
            t.start()
        watchdog = threading.Thread(target=self._watch, name="gpu-watchdog", daemon=True)
        self._threads.append(watchdog)
        watchdog.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop and join the threads (the backend stays open: close it after this)."""
        self._stop.set()
        self.backend.interrupt()
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                log.warning("monitor thread did not stop in time", thread=t.name, timeout_s=timeout_s)
        self._threads = []

    def latest_health(self) -> list[GpuHealth]:
        """The most recent poll of each GPU, in GPU order (``ok=False`` while its polls fail)."""
        with self._latest_lock:
            return [self._latest[g] for g in sorted(self._latest)]

    # --- per-GPU thread --------------------------------------------------------------------------

    def _run(self, gpu: int) -> None:
        worker = _GpuWorker(self, gpu)
        while not self._stop.is_set():
            worker.step()

    @contextlib.contextmanager
    def _call(self, gpu: int) -> Iterator[None]:
        """A backend call of ``gpu``'s thread, timed for the watchdog."""
        with self._latest_lock:
            self._calling[gpu] = time.monotonic()
        try:
            yield
        finally:
            with self._latest_lock:
                del self._calling[gpu]
                self._stalled.discard(gpu)

    def _watch(self) -> None:
        while not self._stop.wait(min(self._interval, self._stall_s / 4)):
            self.check_stalled()

    def check_stalled(self) -> None:
        """Report each GPU whose backend call has not returned for ``stall_s`` (once per call)."""
        now = time.monotonic()
        with self._latest_lock:
            stuck = {g: now - t for g, t in self._calling.items() if now - t >= self._stall_s and g not in self._stalled}
            self._stalled |= set(stuck)
            latest = {g: self._latest.get(g) for g in stuck}
        for gpu, age in sorted(stuck.items()):
            log.error("GPU monitoring stalled: a backend call does not return", gpu=gpu, age_s=round(age, 1))
            prev = latest[gpu]
            self._record_health(GpuHealth(gpu, False, None, None, [], False, None) if prev is None
                                else dataclasses.replace(prev, ok=False, ts=time.time()))
            self._deliver(GpuEvent(gpu, ErrorKind.GPU_DRIVER_ERROR, None,
                                   f"GPU does not answer: a driver call has not returned for {age:.0f} s"))

    def _deliver(self, event: GpuEvent) -> None:
        if not event.reportable:
            log.info("informational GPU event", gpu=event.gpu, detail=event.message)
            return
        try:
            self._on_event(event)
        except Exception:
            log.exception("on_event callback failed", gpu=event.gpu, detail=event.message)

    def _record_health(self, health: GpuHealth) -> None:
        with self._latest_lock:
            self._latest[health.gpu] = health
        try:
            self._on_health(health)
        except Exception:
            log.exception("on_health callback failed", gpu=health.gpu)


class _GpuWorker:
    """The state of one GPU's thread: its previous poll, backoff and what it already reported."""

    def __init__(self, monitor: GpuMonitor, gpu: int) -> None:
        self.m = monitor
        self.gpu = gpu
        self.prev: GpuHealth | None = None
        #: time.monotonic() of the previous poll and of each kind's latest delivery: which came first is
        #: what dedups a poll against the driver's events, and wall-clock stamps (a GpuEvent's ts) got
        #: that wrong after a clock step: an event stamped an hour ahead hid every later fault of its kind
        self.prev_poll_at = 0.0
        self.next_poll = time.monotonic()  # poll at once: the baseline
        self.delay = monitor._backoff[0]
        self.lost_reported = False
        self.failures = 0  # backend failures in a row
        self.failure_reported = False
        self.last_kind_at: dict[ErrorKind, float] = {}
        # kinds the latest poll found turned bad: the driver's event for the same fault may still be
        # queued (a poll right after a backoff sees the counter first), and is then not reported again
        self.polled: set[ErrorKind] = set()

    def step(self) -> None:
        try:
            if time.monotonic() >= self.next_poll:
                self._poll()
            timeout = min(max(0.0, self.next_poll - time.monotonic()), self.m._max_block)
            with self.m._call(self.gpu):
                event = self.m.backend.wait_event(self.gpu, timeout)
            if event is not None and event.reportable and event.kind in self.polled:
                self.polled.discard(event.kind)  # the driver's own report of what the poll found
                log.info("GPU event already reported from the health poll", gpu=self.gpu, kind=event.kind.value,
                         detail=event.message)
            elif event is not None:
                self._forward(event)
            self.delay = self.m._backoff[0]
        except GpuLost as exc:
            self._lost(exc)
        except Exception as exc:  # a backend fault must never end the GPU's thread
            log.warning("GPU backend error; will retry", gpu=self.gpu, retry_s=self.delay, error=str(exc))
            self._failed(exc)
            self._back_off()

    def _poll(self) -> None:
        self.next_poll = time.monotonic() + self.m._interval
        with self.m._call(self.gpu):
            health = self.m.backend.health(self.gpu)
        polled_at = time.monotonic()
        self.lost_reported = self.failure_reported = False
        self.failures = 0
        self.m._record_health(health)
        self.polled = set()
        for event in health_transitions(self.prev, health):
            if self._delivered_since_poll(event.kind):
                continue  # already delivered from the driver's own event since the previous poll
            self._forward(event)
            if event.reportable:
                self.polled.add(event.kind)
        self.prev, self.prev_poll_at = health, polled_at

    def _forward(self, event: GpuEvent) -> None:
        if event.reportable:
            self.last_kind_at[event.kind] = time.monotonic()
        self.m._deliver(event)

    def _delivered_since_poll(self, kind: ErrorKind) -> bool:
        return self.prev is not None and self.last_kind_at.get(kind, -1.0) >= self.prev_poll_at

    def _failed(self, exc: Exception) -> None:
        """A backend call failed: the GPU shows unhealthy until a poll answers, and is reported once
        the failures persist."""
        self.failures += 1
        self._record_unhealthy()
        if self.failures >= self.m._report_after and not self.failure_reported and not self.lost_reported:
            self.failure_reported = True
            self._forward(GpuEvent(self.gpu, ErrorKind.GPU_DRIVER_ERROR, None,
                                   f"GPU answers only errors ({self.failures} in a row): {exc}"))

    def _record_unhealthy(self) -> None:
        blank = GpuHealth(self.gpu, False, None, None, [], False, None)
        self.m._record_health(dataclasses.replace(self.prev or blank, ok=False, ts=time.time()))

    def _lost(self, exc: GpuLost) -> None:
        self._record_unhealthy()
        if not self.lost_reported:
            self.lost_reported = True
            # the driver announces a GPU falling off the bus (XID 79) before NVML answers "lost": one fault
            if self.last_kind_at.get(ErrorKind.GPU_DRIVER_ERROR, -1.0) < self.prev_poll_at:
                self._forward(GpuEvent(self.gpu, ErrorKind.GPU_DRIVER_ERROR, None, f"GPU lost: {exc}"))
        log.warning("GPU lost; will retry", gpu=self.gpu, retry_s=self.delay, error=str(exc))
        self._back_off()

    def _back_off(self) -> None:
        self.m._stop.wait(self.delay)
        self.delay = min(self.delay * 2, self.m._backoff[1])
        # After a failed poll, poll again right after the backoff instead of a full interval later.
        self.next_poll = min(self.next_poll, time.monotonic())
