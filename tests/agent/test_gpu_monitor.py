"""The per-GPU monitoring threads, driven through the simulated backend's fault injection."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterator

import pytest

from agent.gpu import GpuEvent, GpuHealth, GpuMonitor, SimulatedBackend
from agent.gpu.monitor import health_transitions
from unicron.kernel.types import ErrorKind


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[float, GpuEvent]] = []
        self.health: list[GpuHealth] = []
        self.cond = threading.Condition()

    def on_event(self, event: GpuEvent) -> None:
        now = time.perf_counter()
        with self.cond:
            self.events.append((now, event))
            self.cond.notify_all()

    def on_health(self, health: GpuHealth) -> None:
        with self.cond:
            self.health.append(health)
            self.cond.notify_all()

    def wait_events(self, n: int, timeout_s: float = 2.0) -> list[GpuEvent]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.events) >= n, timeout_s), self.events
            return [e for _, e in self.events]

    def wait_health(self, pred: object, timeout_s: float = 2.0) -> GpuHealth:
        check = pred  # callable[[GpuHealth], bool]
        with self.cond:
            assert self.cond.wait_for(lambda: any(check(h) for h in self.health), timeout_s)  # type: ignore[operator]
            return next(h for h in self.health if check(h))  # type: ignore[operator]


@pytest.fixture
def sim() -> Iterator[tuple[SimulatedBackend, Recorder, GpuMonitor]]:
    backend = SimulatedBackend(2)
    rec = Recorder()
    monitor = GpuMonitor(backend, rec.on_event, rec.on_health, health_interval_s=0.05)
    monitor.start()
    rec.wait_health(lambda h: h.gpu == 1)  # both baselines taken
    try:
        yield backend, rec, monitor
    finally:
        monitor.stop()
        backend.close()


def test_one_thread_per_gpu(sim: tuple[SimulatedBackend, Recorder, GpuMonitor]) -> None:
    names = {t.name for t in threading.enumerate()}
    assert {"gpu-monitor-0", "gpu-monitor-1"} <= names


def test_xid_reaches_on_event_within_milliseconds(sim: tuple[SimulatedBackend, Recorder, GpuMonitor]) -> None:
    backend, rec, _ = sim
    latencies = []
    for i in range(20):
        t0 = time.perf_counter()
        backend.inject_xid(i % 2, 79)
        rec.wait_events(i + 1)
        latencies.append(rec.events[i][0] - t0)
        assert rec.events[i][1].kind is ErrorKind.GPU_DRIVER_ERROR and rec.events[i][1].gpu == i % 2
    print(f"inject_xid -> on_event: median {statistics.median(latencies) * 1e3:.3f} ms, "
          f"max {max(latencies) * 1e3:.3f} ms")
    assert max(latencies) < 0.050


def test_informational_xid_is_not_reported(sim: tuple[SimulatedBackend, Recorder, GpuMonitor]) -> None:
    backend, rec, _ = sim
    backend.inject_xid(0, 45)
    backend.inject_xid(0, 31)  # queued behind 45 on the same GPU: once it arrives, 45 was handled
    events = rec.wait_events(1)
    time.sleep(0.02)
    assert [(e.xid, e.kind) for e in rec.wait_events(1)] == [(31, ErrorKind.ILLEGAL_MEMORY_ACCESS)]
    assert len(events) == 1


def test_double_bit_ecc_reported_once_despite_the_counter_change(
    sim: tuple[SimulatedBackend, Recorder, GpuMonitor],
) -> None:
    backend, rec, _ = sim
    backend.inject_ecc(1, double_bit=False)  # corrected: logged only
    backend.inject_ecc(1, double_bit=True)
    rec.wait_events(1)
    bad = rec.wait_health(lambda h: h.gpu == 1 and h.ecc_dbe == 1)
    n = len(rec.health)
    rec.wait_health(lambda h: rec.health.index(h) > n)  # another poll after the counter changed
    assert [e.kind for e in rec.wait_events(1)] == [ErrorKind.ECC_ERROR]
    assert not bad.ok and bad.ecc_sbe == 1


def test_nvlink_down_seen_by_health_poll(sim: tuple[SimulatedBackend, Recorder, GpuMonitor]) -> None:
    backend, rec, monitor = sim
    backend.set_nvlink_down(0, 3)
    (event,) = rec.wait_events(1)
    assert event.kind is ErrorKind.NVLINK_ERROR and event.gpu == 0 and "[3]" in event.message
    health = rec.wait_health(lambda h: h.gpu == 0 and h.nvlink_down == [3])
    assert not health.ok
    assert any(h.gpu == 0 and h.nvlink_down == [3] for h in monitor.latest_health())


def test_pending_retirement_and_recovery_action(sim: tuple[SimulatedBackend, Recorder, GpuMonitor]) -> None:
    backend, rec, _ = sim
    backend.set_retired_pages_pending(1)
    backend.set_recovery_action(0, "gpu_reset")
    events = rec.wait_events(2)
    assert {(e.gpu, e.kind) for e in events} == {(1, ErrorKind.ECC_ERROR), (0, ErrorKind.GPU_DRIVER_ERROR)}
    time.sleep(0.15)  # several more polls: a persisting condition is not re-reported
    assert len(rec.events) == 2


def test_backend_errors_are_retried_and_do_not_end_the_thread() -> None:
    backend = SimulatedBackend(1)
    rec = Recorder()
    monitor = GpuMonitor(backend, rec.on_event, rec.on_health, 0.02, backoff_s=(0.005, 0.02))
    backend.fail_health(0, times=4)
    monitor.start()
    try:
        rec.wait_health(lambda h: h.gpu == 0)
        backend.inject_xid(0, 48)
        assert [e.xid for e in rec.wait_events(1)] == [48]
    finally:
        monitor.stop()


def test_a_gpu_that_answers_only_errors_is_reported_once_and_shown_unhealthy_until_it_answers() -> None:
    """A failure that persists (NVML_ERROR_UNKNOWN on every query) was retried for ever: never reported,
    and the status kept the GPU's last good poll."""
    backend = SimulatedBackend(1)
    rec = Recorder()
    monitor = GpuMonitor(backend, rec.on_event, rec.on_health, 0.02, backoff_s=(0.005, 0.01))
    monitor.start()
    try:
        rec.wait_health(lambda h: h.gpu == 0 and h.ok)
        backend.fail_health(0, times=30)
        (event,) = rec.wait_events(1)
        assert event.kind is ErrorKind.GPU_DRIVER_ERROR and "only errors" in event.message
        assert not monitor.latest_health()[0].ok
        rec.health.clear()
        rec.wait_health(lambda h: h.ok)  # answers again
        assert len(rec.events) == 1
    finally:
        monitor.stop()


class WedgedBackend(SimulatedBackend):
    """GPU 1's health query blocks while ``wedged`` is set (an NVML call on a GPU that stopped answering)."""

    def __init__(self) -> None:
        super().__init__(2)
        self.wedged = threading.Event()
        self.release = threading.Event()

    def health(self, gpu: int) -> GpuHealth:
        if gpu == 1 and self.wedged.is_set():
            self.release.wait(10.0)
        return super().health(gpu)


def test_a_driver_call_that_does_not_return_is_reported_once_and_the_gpu_shown_unhealthy() -> None:
    """One GPU's thread blocked in a call that never returned: nothing polled or delivered that GPU's
    events again, nothing was reported, and the status kept its last good poll."""
    backend = WedgedBackend()
    rec = Recorder()
    monitor = GpuMonitor(backend, rec.on_event, rec.on_health, 0.02, stall_s=0.3)
    monitor.start()
    try:
        rec.wait_health(lambda h: h.gpu == 1 and h.ok)
        backend.wedged.set()
        (event,) = rec.wait_events(1)
        assert (event.gpu, event.kind) == (1, ErrorKind.GPU_DRIVER_ERROR) and "not returned" in event.message
        assert [h.ok for h in monitor.latest_health()] == [True, False]
        time.sleep(0.4)
        assert len(rec.events) == 1  # once per stuck call
        backend.release.set()
        rec.health.clear()
        rec.wait_health(lambda h: h.gpu == 1 and h.ok)  # it answers again
    finally:
        backend.release.set()
        monitor.stop()
        backend.close()


def test_lost_gpu_reported_once_then_recovers() -> None:
    backend = SimulatedBackend(1)
    rec = Recorder()
    monitor = GpuMonitor(backend, rec.on_event, rec.on_health, 0.02, backoff_s=(0.005, 0.01))
    backend.set_lost(0)
    monitor.start()
    try:
        (event,) = rec.wait_events(1)
        assert event.kind is ErrorKind.GPU_DRIVER_ERROR and "lost" in event.message
        time.sleep(0.1)  # many failed retries meanwhile
        assert len(rec.events) == 1
        assert not monitor.latest_health()[0].ok  # not its last good poll
        backend.set_lost(0, False)
        rec.wait_health(lambda h: h.gpu == 0 and h.ok)
    finally:
        monitor.stop()


def test_failing_callback_does_not_end_the_thread() -> None:
    backend = SimulatedBackend(1)
    rec = Recorder()
    calls = []

    def flaky(event: GpuEvent) -> None:
        calls.append(event)
        if len(calls) == 1:
            raise RuntimeError("callback bug")
        rec.on_event(event)

    monitor = GpuMonitor(backend, flaky, rec.on_health, health_interval_s=0.05)
    monitor.start()
    try:
        backend.inject_xid(0, 13)
        backend.inject_xid(0, 74)
        assert [e.xid for e in rec.wait_events(1)] == [74]
    finally:
        monitor.stop()


def test_already_faulty_gpu_is_reported_at_start() -> None:
    backend = SimulatedBackend(1)
    backend.set_nvlink_down(0, 1)
    rec = Recorder()
    monitor = GpuMonitor(backend, rec.on_event, rec.on_health, health_interval_s=0.05)
    monitor.start()
    try:
        assert [e.kind for e in rec.wait_events(1)] == [ErrorKind.NVLINK_ERROR]
    finally:
        monitor.stop()


def test_stop_is_prompt_even_with_long_waits() -> None:
    backend = SimulatedBackend(4)
    rec = Recorder()
    monitor = GpuMonitor(backend, rec.on_event, rec.on_health, health_interval_s=30.0, max_block_s=30.0)
    monitor.start()
    rec.wait_health(lambda h: h.gpu == 3)
    t0 = time.perf_counter()
    monitor.stop()
    assert time.perf_counter() - t0 < 0.5
    assert not [t for t in threading.enumerate() if t.name.startswith("gpu-monitor-")]


def _h(dbe: int | None = 0, down: list[int] | None = None, pending: bool = False, action: str | None = "none",
       ) -> GpuHealth:
    return GpuHealth(0, True, 0, dbe, down or [], pending, action, ts=1.0)


def test_health_transitions_only_report_what_turned_bad() -> None:
    assert health_transitions(None, _h()) == []
    assert health_transitions(_h(dbe=None), _h(dbe=None)) == []
    assert [e.kind for e in health_transitions(_h(dbe=2), _h(dbe=3))] == [ErrorKind.ECC_ERROR]
    assert health_transitions(_h(dbe=3), _h(dbe=3)) == []
    down = health_transitions(_h(down=[1]), _h(down=[1, 4]))
    assert [e.message for e in down] == ["NVLink link(s) [4] down"]
    assert health_transitions(_h(down=[1, 4]), _h(down=[1])) == []  # a link coming back is no fault
    assert [e.kind for e in health_transitions(_h(action=None), _h(action="drain_p2p"))] == [
        ErrorKind.GPU_DRIVER_ERROR]
    assert health_transitions(_h(pending=True), _h(pending=True)) == []


def test_a_fault_the_poll_saw_before_the_drivers_event_is_reported_once() -> None:
    """A poll right after a backoff (NVML calls fail around GPU faults) sees the DBE counter before the
    thread reads the driver's event for the same error: it was reported twice (reviewer's repro 6)."""
    backend = SimulatedBackend(1)
    rec = Recorder()
    monitor = GpuMonitor(backend, rec.on_event, rec.on_health, 0.5, backoff_s=(0.2, 0.2))
    monitor.start()
    try:
        rec.wait_health(lambda h: h.gpu == 0)  # the baseline poll
        backend.fail_health(0, 1)
        time.sleep(0.6)  # the next poll fails: the thread backs off 0.2 s
        backend.inject_ecc(0, double_bit=True)  # counter and the driver's event, while it backs off
        rec.wait_health(lambda h: h.ecc_dbe == 1)
        time.sleep(0.1)  # the queued event is read right after that poll
        assert [e.kind for _, e in rec.events] == [ErrorKind.ECC_ERROR]
        time.sleep(0.8)
        backend.inject_xid(0, 48)  # a later fault of the same kind, after the next poll: reported
        assert [e.kind for e in rec.wait_events(2)] == [ErrorKind.ECC_ERROR] * 2
    finally:
        monitor.stop()
        backend.close()


def test_a_gpu_that_falls_off_the_bus_after_its_xid_79_is_reported_once() -> None:
    """XID 79, after which NVML answers GPU_IS_LOST: two GPU driver errors for one fault (repro 6b)."""
    backend = SimulatedBackend(1)
    rec = Recorder()
    monitor = GpuMonitor(backend, rec.on_event, rec.on_health, 0.05)
    monitor.start()
    try:
        rec.wait_health(lambda h: h.gpu == 0)
        backend.inject_xid(0, 79)
        backend.set_lost(0)
        rec.wait_events(1)
        time.sleep(0.3)  # several polls: the loss is seen
        assert [(e.kind, e.xid) for _, e in rec.events] == [(ErrorKind.GPU_DRIVER_ERROR, 79)]
    finally:
        monitor.stop()
        backend.close()


def test_a_driver_event_stamped_before_a_clock_step_back_hides_no_later_fault(
    sim: tuple[SimulatedBackend, Recorder, GpuMonitor],
) -> None:
    """Agent review: the poll's dedup compared wall-clock stamps, so an event read while the host's
    clock was an hour ahead (then stepped back) hid every fault of its kind the polls found for that
    hour: here an NVLink going down."""
    backend, rec, _ = sim
    ahead = GpuEvent(0, ErrorKind.NVLINK_ERROR, None, "NVLink error", ts=time.time() + 3600)
    with backend._lock:
        backend._push(backend._state(0), ahead)
    rec.wait_events(1)
    n = len(rec.health)
    rec.wait_health(lambda h: h.gpu == 0 and rec.health.index(h) >= n)  # a poll after its delivery
    backend.set_nvlink_down(0, 3)
    assert [e.kind for e in rec.wait_events(2)] == [ErrorKind.NVLINK_ERROR] * 2
