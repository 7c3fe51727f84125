"""Online statistical monitoring: pure rules with synthetic timestamps, and the watcher thread's timing."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Hashable, Iterator

import pytest

from agent import iterations
from agent.iterations import Finding, HangWatcher, IterationMonitor, IterationSettings, SlidingMax
from unicron.kernel.errors import ConfigError
from unicron.kernel.types import ErrorKind

HANG, DEGR = ErrorKind.TASK_HANG, ErrorKind.DEGRADATION


def feed(mon: IterationMonitor, durations: list[float], t0: float = 0.0, step0: int = 0) -> float:
    """Run back-to-back iterations of the given durations starting at ``t0``; returns the end time."""
    t = t0
    for i, d in enumerate(durations):
        mon.iter_start(step0 + i, t)
        t += d
        mon.iter_end(step0 + i, d, t)
    return t


def steady(mean: float = 0.1, n: int = 10) -> IterationMonitor:
    mon = IterationMonitor(IterationSettings(warmup_iterations=2, min_samples=5))
    feed(mon, [mean] * n)
    return mon


def test_no_false_alarm_with_20_percent_jitter() -> None:
    rng = random.Random(1234)
    mon = IterationMonitor()
    findings: list[Finding] = []
    t = 0.0
    for step in range(2000):
        d = rng.uniform(0.8, 1.2)
        mon.iter_start(step, t)
        findings += mon.check(t + rng.uniform(0, d))  # somewhere inside the iteration
        findings += mon.check(t + d - 1e-9)  # its last moment: the longest it has been running
        t += d
        mon.iter_end(step, d, t)
    findings += mon.check(t)
    assert mon.baseline() == pytest.approx(1.0, rel=0.05)
    assert [f for f in findings if f.kind is HANG] == []
    assert findings == []  # nor a (sustained) degradation
    assert 300 < mon.slow_iterations < 700  # about a quarter of the iterations exceed 1.1x: counted only


def test_hang_at_three_times_the_mean_reported_once() -> None:
    mon = steady(0.1)
    mon.iter_start(50, 100.0)
    assert mon.deadline() == pytest.approx(100.3)
    assert mon.check(100.299) == []
    (f,) = mon.check(100.3)
    assert (f.kind, f.step, f.onset_ts) == (HANG, 50, 100.0) and f.ts == pytest.approx(100.3)
    assert mon.check(101.0) == []  # once
    assert mon.deadline() == pytest.approx(100.3 + IterationSettings().hang_repeat_s)  # unless it lasts
    mon.iter_start(51, 200.0)  # the next iteration is judged afresh
    assert [f.kind for f in mon.check(200.31)] == [HANG]


def test_a_hang_that_lasts_is_reported_again_every_repeat_interval() -> None:
    """A frozen rank's peers wait in its collective and are found hung with it; the coordinator
    restarted the peer whose report came first and the frozen rank stayed in the task (resize soak):
    it must be reported again."""
    mon = IterationMonitor(IterationSettings(warmup_iterations=3, min_samples=2, warmup_hang_s=10.0,
                                             hang_repeat_s=60.0))
    mon.launched(0.0)
    assert [f.kind for f in mon.check(10.0)] == [HANG]
    assert mon.check(69.9) == []
    assert [f.kind for f in mon.check(70.0)] == [HANG]
    assert [f.kind for f in mon.check(130.0)] == [HANG]
    mon.iter_start(1, 131.0)  # it reports again: judged afresh
    assert mon.check(131.5) == []


def test_no_deadline_during_warmup_or_without_an_open_iteration() -> None:
    s = IterationSettings(warmup_iterations=3, min_samples=2, warmup_hang_s=0)  # (the warm-up bound: below)
    mon = IterationMonitor(s)
    for n in range(4):  # 3 warm-up iterations + 1 sample < min_samples
        mon.iter_start(n, float(n))
        assert mon.deadline() is None
        mon.iter_end(n, 0.5, n + 0.5)
    assert mon.deadline() is None and mon.baseline() is None
    feed(mon, [0.5], t0=10.0, step0=4)
    assert mon.baseline() == pytest.approx(0.5) and mon.deadline() is None  # nothing running
    mon.iter_start(5, 20.0)
    assert mon.deadline() == pytest.approx(21.5)


def test_warmup_iterations_do_not_enter_the_baseline() -> None:
    mon = IterationMonitor(IterationSettings(warmup_iterations=2, min_samples=3))
    feed(mon, [30.0, 20.0, 1.0, 1.0, 1.0])
    assert mon.baseline() == pytest.approx(1.0)


def test_non_train_phase_suspends_hang_detection_and_restarts_the_clock() -> None:
    mon = steady(0.1)
    mon.iter_start(20, 50.0)
    mon.phase("checkpoint", 50.05)
    assert mon.deadline() == pytest.approx(50.05 + 3600.0) and mon.check(60.0) == []  # its own bound only
    mon.phase("train", 60.0)
    assert mon.deadline() == pytest.approx(60.3)
    mon.iter_end(20, 10.1, 60.1)  # spanned a checkpoint: not a training sample
    assert mon.baseline() == pytest.approx(0.1)


def test_waiting_in_the_collective_is_iteration_time_judged_like_training() -> None:
    """The peers of a hung rank wait in the collective: their hang must still be found (the coordinator
    then points it at the rank they wait for), and a normal collective is part of the sample."""
    mon = steady(0.1)
    mon.iter_start(20, 50.0)
    mon.phase("collective", 50.05)
    assert mon.deadline() == pytest.approx(50.3)  # the iteration's clock, not restarted
    mon.phase("train", 50.08)
    mon.iter_end(20, 0.1, 50.1)
    assert mon.stats()["completed"] == 11 and mon.baseline() == pytest.approx(0.1)  # a training sample
    mon.iter_start(21, 60.0)
    mon.phase("collective", 60.05)
    (f,) = mon.check(60.3)
    assert (f.kind, f.step) == (HANG, 21)


def test_a_data_wait_stops_the_hang_clock_and_is_not_iteration_time() -> None:
    mon = steady(0.1)  # deadline 3x = 0.3 s of compute
    mon.iter_start(20, 50.0)
    mon.phase("data", 50.05)
    assert mon.deadline() == pytest.approx(50.05 + 1.0)  # the wait's own bound: 10x the baseline
    assert mon.check(50.9) == []  # 0.85 s of waiting: no hang although 8.5x the mean has passed
    mon.phase("train", 50.9)
    assert mon.deadline() == pytest.approx(50.0 + 0.85 + 0.3)  # resumed where it stopped
    assert mon.check(51.14) == []
    mon.iter_end(20, 0.95, 50.95)
    assert mon.baseline() == pytest.approx(0.1)  # the sample was 0.1 s of compute, not 0.95
    assert mon.stats()["completed"] == 11  # and it was counted
    # Control: the same 0.85 s inside the iteration, unreported, is a hang.
    mon.iter_start(21, 60.0)
    assert [f.kind for f in mon.check(60.85)] == [HANG]


def test_a_data_wait_past_its_bound_is_one_hang() -> None:
    mon = steady(0.1)
    mon.iter_start(20, 50.0)
    mon.phase("data", 50.02)
    assert mon.check(51.01) == []
    (f,) = mon.check(51.02)
    assert (f.kind, f.step, f.onset_ts) == (HANG, 20, 50.02) and "data" in f.message
    assert mon.check(60.0) == []  # once, until hang_repeat_s later
    assert mon.deadline() == pytest.approx(51.02 + IterationSettings().hang_repeat_s)
    mon.phase("train", 60.0)
    mon.iter_end(20, 10.0, 60.01)  # a hang that ended: no sample, no widening
    assert mon.baseline() == pytest.approx(0.1) and mon.stats()["completed"] == 10
    assert IterationMonitor(IterationSettings(data_wait_factor=20.0)).settings.data_wait_factor == 20.0
    with pytest.raises(ConfigError, match="data_wait_factor"):
        IterationSettings(data_wait_factor=0.5)


def test_a_gc_pause_stops_the_hang_clock_like_a_data_wait_and_past_its_own_bound_is_one_hang() -> None:
    # bench/soak.py: a 2.4 s gen-2 pause in a 1 s iteration was the last cause of false alarms
    mon = steady(0.1)
    mon.iter_start(20, 50.0)
    mon.phase("gc", 50.05)
    assert mon.deadline() == pytest.approx(50.05 + 1.0)  # gc_wait_factor 10 x the baseline
    assert mon.check(50.9) == []  # an 0.85 s pause: 8.5x the mean, no hang
    mon.phase("train", 50.9)
    assert mon.deadline() == pytest.approx(50.0 + 0.85 + 0.3)  # the clock resumed where it stopped
    mon.iter_end(20, 0.95, 50.95)
    assert mon.baseline() == pytest.approx(0.1)  # the sample is the compute, not the pause
    mon = IterationMonitor(IterationSettings(warmup_iterations=2, min_samples=5, gc_wait_factor=20.0))
    feed(mon, [0.1] * 10)
    mon.iter_start(20, 50.0)
    mon.phase("gc", 50.02)
    assert mon.check(52.01) == []
    (f,) = mon.check(52.02)  # a collection stuck for good (a finalizer that never returns)
    assert (f.kind, f.step, f.onset_ts) == (HANG, 20, 50.02) and "garbage collection" in f.message
    assert mon.check(60.0) == []  # once
    with pytest.raises(ConfigError, match="gc_wait_factor"):
        IterationSettings(gc_wait_factor=0.5)


def test_a_rank_silent_since_its_launch_or_in_warm_up_is_a_hang_after_the_warmup_bound() -> None:
    # bench/chaos.py SIGSTOPped a rank right after its launch: it never reported, and no iteration
    # rule can judge a rank without a baseline, so nothing was ever found.
    mon = IterationMonitor(IterationSettings(warmup_iterations=3, min_samples=2, warmup_hang_s=10.0))
    assert mon.deadline() is None  # not launched yet
    mon.launched(100.0)
    assert mon.deadline() == pytest.approx(110.0) and mon.check(109.9) == []
    (f,) = mon.check(110.0)
    assert (f.kind, f.step, f.onset_ts) == (HANG, None, 100.0) and "baseline" in f.message
    assert mon.check(169.9) == []  # once, until hang_repeat_s (60 s) later
    mon.iter_start(0, 200.0)  # it reports after all (a slow start): judged afresh
    assert mon.deadline() == pytest.approx(210.0)
    mon.phase("checkpoint", 201.0)
    assert mon.deadline() == pytest.approx(201.0 + 3600.0)  # a checkpoint's own bound, as with a baseline
    mon.phase("train", 260.0)
    feed(mon, [0.5] * 6, t0=300.0, step0=1)  # warm-up done: the iteration rules take over
    mon.iter_start(7, 400.0)
    assert mon.deadline() == pytest.approx(401.5)


@pytest.mark.parametrize("name", ["checkpoint", "eval"])
def test_a_rank_stuck_in_a_checkpoint_or_eval_is_one_hang_after_the_phase_bound(name: str) -> None:
    """A save blocked for good (a hung NFS mount, a dead object store): the phase suspended the hang
    clock and had no bound, so nothing was ever found and the job sat idle until a human noticed."""
    s = IterationSettings(warmup_iterations=2, min_samples=5, phase_hang_s=100.0, hang_repeat_s=60.0)
    mon = IterationMonitor(s)
    t = feed(mon, [0.1] * 10)
    mon.iter_start(10, t)
    mon.iter_end(10, 0.1, t + 0.1)
    mon.phase(name, 50.0)  # between iterations, as unicron.runtime saves
    assert mon.deadline() == pytest.approx(150.0)
    assert mon.check(149.9) == []  # a long save is no hang
    (f,) = mon.check(150.0)
    assert (f.kind, f.step, f.ts, f.onset_ts) == (HANG, None, 150.0, 50.0)
    assert f.message.startswith(f"in {name} for 100.000 s"), f.message
    assert mon.check(209.9) == []  # once per episode
    (again,) = mon.check(210.0)  # and again every hang_repeat_s while it lasts, like any hang
    assert again.kind is HANG and f"in {name} for 160.000 s" in again.message
    mon.phase("train", 300.0)  # it came back after all: the episode is over, nothing due in the past
    assert mon.check(1000.0) == []
    assert mon.deadline() is None
    fresh = IterationMonitor(s)  # no baseline yet: a save right after the launch is bounded the same
    fresh.launched(0.0)
    fresh.phase(name, 1.0)
    assert fresh.check(100.9) == [] and [x.kind for x in fresh.check(101.0)] == [HANG]


def test_a_checkpoint_that_ends_or_reports_within_the_phase_bound_is_no_hang() -> None:
    s = IterationSettings(warmup_iterations=2, min_samples=5, phase_hang_s=100.0)
    mon = IterationMonitor(s)
    feed(mon, [0.1] * 10)
    mon.iter_start(10, 40.0)
    mon.phase("checkpoint", 50.0)  # inside the iteration: its clock stops, the phase's starts
    mon.phase("train", 140.0)  # a 90 s save
    assert mon.deadline() == pytest.approx(140.3)  # the iteration's clock again, restarted
    assert mon.check(140.2) == []
    mon.iter_end(10, 100.2, 140.2)
    mon.phase("eval", 200.0)
    mon.iter_start(11, 290.0)  # any report within the bound is progress: the bound counts from it
    assert mon.check(300.0) == [] and mon.deadline() == pytest.approx(390.0)
    mon.phase("train", 380.0)
    mon.iter_end(11, 90.1, 380.1)
    assert mon.check(1000.0) == []
    off = IterationMonitor(IterationSettings(phase_hang_s=0.0))  # 0: unbounded, as before
    off.phase("checkpoint", 0.0)
    assert off.deadline() is None and off.check(1e9) == []
    with pytest.raises(ConfigError, match="phase_hang_s"):
        IterationSettings(phase_hang_s=-1.0)


def test_completed_stalls_do_not_inflate_the_baseline() -> None:
    mon = steady(0.1, n=20)
    mon.iter_start(30, 10.0)
    assert [f.kind for f in mon.check(10.5)] == [HANG]
    mon.iter_end(30, 1800.0, 1810.0)  # the hung iteration finally finished
    feed(mon, [0.25], t0=2000.0, step0=31)  # 2.5x: an outlier, never reported as a hang
    assert mon.baseline() == pytest.approx(0.1)


def test_sustained_slowdown_is_one_degradation_finding() -> None:
    rng = random.Random(7)
    mon = IterationMonitor()
    t = feed(mon, [rng.uniform(0.8, 1.2) for _ in range(200)])
    assert mon.check(t) == []
    t = feed(mon, [1.3 * rng.uniform(0.9, 1.1) for _ in range(40)], t0=t, step0=200)
    findings = mon.check(t)
    assert [f.kind for f in findings] == [DEGR]
    assert 200 <= (findings[0].step or 0) < 240 and findings[0].onset_ts < findings[0].ts
    assert mon.slow_iterations >= 30


def test_isolated_slow_iterations_are_counted_not_reported() -> None:
    mon = IterationMonitor()
    durations = [1.5 if i % 25 == 24 else 1.0 for i in range(300)]
    t = feed(mon, durations)
    assert mon.check(t) == []
    assert mon.slow_iterations == sum(d > 1.1 for d in durations[mon.settings.warmup_iterations + 5:])


@pytest.mark.parametrize("field", ["hang_factor", "degrade_factor"])
def test_bad_settings_name_the_field(field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        IterationSettings(**{field: 0.5})  # type: ignore[arg-type]


# --- the watcher thread ------------------------------------------------------------------------


class Sink:
    def __init__(self) -> None:
        self.got: list[tuple[Hashable, Finding, float]] = []
        self.cond = threading.Condition()

    def __call__(self, key: Hashable, finding: Finding) -> None:
        with self.cond:
            self.got.append((key, finding, time.time()))
            self.cond.notify_all()

    def wait(self, n: int, timeout_s: float = 2.0) -> list[tuple[Hashable, Finding, float]]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.got) >= n, timeout_s), self.got
            return list(self.got)


class CountingClock:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> float:
        self.calls += 1
        return time.time()


@pytest.fixture
def watched() -> Iterator[tuple[HangWatcher, Sink, CountingClock]]:
    sink, clock = Sink(), CountingClock()
    watcher = HangWatcher(sink, clock=clock)
    watcher.start()
    try:
        yield watcher, sink, clock
    finally:
        watcher.stop()


def test_stall_reported_at_its_deadline(watched: tuple[HangWatcher, Sink, CountingClock]) -> None:
    watcher, sink, clock = watched
    now = time.time()
    mon = steady(0.1)
    feed(mon, [0.1] * 5, t0=now - 1.0, step0=10)  # recent history, in the past
    watcher.add(("t", 3), mon)
    start = time.time()
    mon.iter_start(99, start)  # ... and the rank never reports its end
    time.sleep(0.2)
    calls_while_waiting = clock.calls
    ((key, finding, seen),) = sink.wait(1)
    assert key == ("t", 3) and finding.kind is HANG and finding.step == 99
    print(f"stall reported {(seen - start) * 1e3:.1f} ms after its iteration started (deadline 300 ms)")
    assert 0.300 <= seen - start < 0.350
    assert calls_while_waiting < 20  # it slept until the deadline instead of polling


def test_earlier_deadline_rearms_the_watcher(watched: tuple[HangWatcher, Sink, CountingClock]) -> None:
    watcher, sink, _ = watched
    slow, fast = steady(1.0), steady(0.05)
    watcher.add("slow", slow)
    watcher.add("fast", fast)
    slow.iter_start(1, time.time())  # deadline in 3 s: the watcher goes to sleep until then
    time.sleep(0.02)
    start = time.time()
    fast.iter_start(1, start)  # deadline in 150 ms: must wake the watcher
    ((key, _, seen),) = sink.wait(1)
    assert key == "fast" and 0.150 <= seen - start < 0.200


def test_iteration_ending_in_time_is_not_reported(watched: tuple[HangWatcher, Sink, CountingClock]) -> None:
    watcher, sink, _ = watched
    mon = steady(0.05)
    watcher.add("r", mon)
    t = time.time()
    mon.iter_start(1, t)
    time.sleep(0.1)  # 2x the mean: slow but not hung
    mon.iter_end(1, 0.1, time.time())
    time.sleep(0.1)
    assert sink.got == []
    watcher.remove("r", mon)
    mon.iter_start(2, time.time())
    time.sleep(0.2)
    assert sink.got == [] and mon.on_change is None


def test_degradation_delivered_through_the_watcher(watched: tuple[HangWatcher, Sink, CountingClock]) -> None:
    watcher, sink, _ = watched
    mon = IterationMonitor()
    watcher.add("r", mon)
    t = feed(mon, [1.0] * 60, t0=time.time() - 1000.0)
    feed(mon, [1.5] * 20, t0=t, step0=60)
    ((_, finding, _),) = sink.wait(1)
    assert finding.kind is DEGR


def test_sliding_max_forgets_values_older_than_its_window() -> None:
    m = SlidingMax(3)
    assert m.max() is None
    for v, want in [(5.0, 5.0), (1.0, 5.0), (2.0, 5.0), (1.5, 2.0), (0.5, 2.0), (0.2, 1.5), (0.1, 0.5)]:
        m.push(v)
        assert m.max() == want


def test_a_long_iteration_that_completed_widens_the_hang_threshold_up_to_its_ceiling() -> None:
    s = IterationSettings(warmup_iterations=0, min_samples=5, tail_margin=2.0, tail_window=50, max_hang_factor=10.0)
    mon = IterationMonitor(s)
    t = feed(mon, [1.0] * 20)
    mon.iter_start(20, t)
    assert mon.deadline() == pytest.approx(t + 3.0)  # nothing long seen: 3x the mean
    t = feed(mon, [2.5], t0=t, step0=20)  # a GC pause that ended (an outlier: kept out of the mean)
    mon.iter_start(21, t)
    assert mon.baseline() == pytest.approx(1.0)
    assert mon.deadline() == pytest.approx(t + 5.0)  # 2 x the longest healthy iteration
    assert mon.check(t + 4.9) == []  # the same pause again is no hang
    t = feed(mon, [4.9], t0=t, step0=21)
    mon.iter_start(22, t)
    assert mon.deadline() == pytest.approx(t + 9.8)
    t = feed(mon, [9.0], t0=t, step0=22)
    mon.iter_start(23, t)
    assert mon.deadline() == pytest.approx(t + 10.0)  # capped at max_hang_factor x the mean
    assert [(f.kind, f.step) for f in mon.check(t + 10.0) if f.kind is HANG] == [(HANG, 23)]
    t = feed(mon, [1.0] * 50, t0=t + 20.0, step0=24)  # the long ones leave the tail window
    mon.iter_start(99, t)
    assert mon.deadline() == pytest.approx(t + 3.0, rel=0.01)


def test_a_reported_hang_that_ends_does_not_widen_the_threshold() -> None:
    s = IterationSettings(warmup_iterations=0, min_samples=5, tail_margin=2.0)
    mon = IterationMonitor(s)
    t = feed(mon, [1.0] * 10)
    mon.iter_start(10, t)
    assert [f.kind for f in mon.check(t + 3.0)] == [HANG]
    mon.iter_end(10, 8.0, t + 8.0)  # it finished after all: still no evidence of a healthy 8 s
    mon.iter_start(11, t + 8.0)
    assert mon.deadline() == pytest.approx(t + 8.0 + 3.0)


def test_an_old_process_leaving_does_not_unwatch_the_new_process_of_its_rank(
        watched: tuple[HangWatcher, Sink, CountingClock]) -> None:
    watcher, sink, _ = watched
    old, new = steady(0.05), steady(0.05)
    watcher.add("r", old)
    watcher.add("r", new)  # the rank's relaunched process registered first
    watcher.remove("r", old)  # then the old process's exit is handled: the new one stays watched
    new.iter_start(1, time.time())
    ((key, _, _),) = sink.wait(1)  # its hang is still found
    assert key == "r"


class FailsOnce(IterationMonitor):
    """A monitor whose first check raises (a bug in one rank's statistics)."""

    failed = False

    def check(self, now: float) -> list[Finding]:
        if not self.failed:
            self.failed = True
            raise ZeroDivisionError("one bad scan")
        return super().check(now)


@pytest.mark.parametrize("odd", ["far setting", "far message", "failing check"])
def test_the_watcher_survives_a_far_future_deadline_or_a_failing_scan(
        watched: tuple[HangWatcher, Sink, CountingClock], monkeypatch: pytest.MonkeyPatch, odd: str) -> None:
    """A deadline ~1e10 s away (UNICRON_WARMUP_HANG_S=1e10, which settings accept, or a rank's far but
    finite timestamp) made Condition.wait raise OverflowError, and the node's hang-watcher thread died
    for good, as it did of any exception in a scan. The wait is bounded now, and a failed scan is logged
    and retried (a review's reproduction)."""
    monkeypatch.setattr(iterations, "_RETRY_S", 0.05)
    watcher, sink, _ = watched
    if odd == "far setting":
        watcher.add("odd", mon := IterationMonitor(IterationSettings(warmup_hang_s=1e10)))
        mon.launched(time.time())
    elif odd == "far message":
        watcher.add("odd", mon := IterationMonitor(IterationSettings(warmup_hang_s=1800.0)))
        mon.launched(1e11)
    else:
        watcher.add("odd", FailsOnce(IterationSettings(warmup_hang_s=1800.0)))
    time.sleep(0.2)
    silent = IterationMonitor(IterationSettings(warmup_hang_s=0.2))  # another rank, silent past its bound
    watcher.add("silent", silent)
    silent.launched(time.time())
    ((key, finding, _),) = sink.wait(1, timeout_s=5.0)
    assert key == "silent" and finding.kind is HANG


def test_a_hang_factor_above_the_tail_cap_is_accepted_and_rules() -> None:
    # UNICRON_HANG_FACTOR=100 (tests that must not see hangs) once stopped the agent at start
    s = IterationSettings(warmup_iterations=0, min_samples=5, hang_factor=100.0, max_hang_factor=10.0)
    mon = IterationMonitor(s)
    t = feed(mon, [1.0] * 20)
    mon.iter_start(20, t)
    assert mon.deadline() == pytest.approx(t + 100.0)
    assert "100.0 x mean iteration time 1.000 s" in mon.check(t + 100.0)[0].message


def test_a_reported_hang_that_ends_leaves_no_deadline_in_the_past() -> None:
    """An iteration reported as a hang that then completes: with no iteration open, there is nothing
    to judge; yet deadline() keeps returning the (past) repeat time, and check() never moves it."""
    s = IterationSettings(warmup_iterations=0, min_samples=5, hang_repeat_s=60.0)
    mon = IterationMonitor(s)
    t = feed(mon, [1.0] * 10)
    mon.iter_start(10, t)
    assert [f.kind for f in mon.check(t + 3.0)] == [HANG]
    mon.iter_end(10, 8.0, t + 8.0)  # the stall ended; the rank now sits between iterations
    later = t + 200.0
    assert mon.check(later) == []
    deadline = mon.deadline()
    assert deadline is None or deadline > later, f"deadline {deadline} is in the past at {later}"


def _checks_after_an_ended_hang(begin: Callable[[IterationMonitor], None],
                                 end: Callable[[IterationMonitor], None]) -> int:
    """How often the watcher thread calls check() in 0.3 s once a hang ``begin`` made was reported and
    ``end`` ended it, with nothing left to watch (it busy-looped: check + deadline at timeout 0)."""
    s = IterationSettings(warmup_iterations=0, min_samples=5, hang_repeat_s=0.05)
    checks = 0
    found = threading.Event()

    class Counting(IterationMonitor):
        def check(self, now: float):  # type: ignore[no-untyped-def]
            nonlocal checks
            checks += 1
            return super().check(now)

    mon = Counting(s)
    feed(mon, [0.01] * 10, t0=time.monotonic() - 1.0)
    watcher = HangWatcher(lambda key, f: found.set())
    watcher.start()
    try:
        watcher.add("r", mon)
        begin(mon)
        assert found.wait(2.0)
        end(mon)
        time.sleep(0.1)  # past the repeat time
        before = checks
        time.sleep(0.3)
        return checks - before
    finally:
        watcher.stop()


def test_the_watcher_does_not_spin_after_a_reported_hang_ended() -> None:
    """The same through the watcher thread: it busy-loops (check + deadline at timeout 0) on the agent."""
    spins = _checks_after_an_ended_hang(lambda mon: mon.iter_start(10, time.monotonic()),
                                        lambda mon: mon.iter_end(10, 0.2, time.monotonic()))  # no next one yet
    assert spins < 20, f"the hang watcher called check() {spins} times in 0.3 s with nothing to watch"


def test_a_wait_between_iterations_reported_as_a_hang_that_ends_leaves_no_deadline_in_the_past() -> None:
    """A data wait outside any iteration (``with client.phase("data")`` around the loader) reported as a
    hang, then the data comes: the repeat time stayed in the past while check() found nothing to repeat."""
    mon = steady(0.1)  # wait bound: 10 x 0.1 s
    mon.phase("data", 50.0)
    (f,) = mon.check(51.0)
    assert (f.kind, f.step) == (HANG, None) and "data" in f.message
    mon.phase("train", 52.0)  # the data came; no iteration started yet
    later = 52.0 + 10 * IterationSettings().hang_repeat_s
    assert mon.check(later) == []
    deadline = mon.deadline()
    assert deadline is None or deadline > later, f"deadline {deadline} is in the past at {later}"
    mon.phase("gc", later)  # a new wait is judged afresh, not as the old hang's repeat
    assert mon.check(later + 0.5) == []
    assert mon.deadline() == pytest.approx(later + 1.0)
    mon.phase("train", later + 0.6)
    mon.iter_start(20, later + 2.0)  # and the next iteration as usual
    assert mon.deadline() == pytest.approx(later + 2.0 + 0.3)


def test_the_watcher_does_not_spin_after_a_wait_between_iterations_was_reported() -> None:
    """The same through the watcher thread (reviewer's repro 8): 100 % CPU until the rank's next input."""
    spins = _checks_after_an_ended_hang(lambda mon: mon.phase("data", time.monotonic()),  # 10 x 10 ms
                                        lambda mon: mon.phase("train", time.monotonic()))  # the data came
    assert spins < 20, f"the hang watcher called check() {spins} times in 0.3 s with nothing to watch"


def test_a_fault_handled_in_place_keeps_the_baseline_and_restarts_the_iteration_clock() -> None:
    mon = IterationMonitor(IterationSettings(warmup_iterations=2, min_samples=5))
    assert mon.reconfigured(2)  # the runtime's first regroup (start) names the pace: nothing learned yet
    feed(mon, [0.1] * 10)
    mon.iter_start(20, 50.0)
    mon.interrupted(50.25)  # a non-fatal exception: the rank regroups in place
    assert mon.baseline() == pytest.approx(0.1)
    assert mon.deadline() == pytest.approx(50.25 + 0.3)  # the clock restarted at the fault
    mon.phase("regroup", 50.26)
    assert mon.deadline() is None  # the regroup has no bound here
    mon.phase("train", 51.0)
    mon.iter_end(20, 1.1, 51.1)
    assert mon.stats()["completed"] == 10  # recovery time is no sample
    assert not mon.reconfigured(2)  # the reattempt's regroup, same data-parallel size: the pace is kept
    assert mon.baseline() == pytest.approx(0.1)
    mon.iter_start(21, 60.0)
    assert [f.kind for f in mon.check(60.3)] == [HANG]  # a hang right after it: the iteration rule


def test_a_regroup_that_changes_or_does_not_name_the_pace_resets_but_stays_bounded_by_the_old_baseline() -> None:
    s = IterationSettings(warmup_iterations=2, min_samples=5, warmup_hang_s=1800.0, reset_hang_factor=30.0)
    for pace in (None, 1):  # unknown (another runtime), or a new data-parallel size
        mon = IterationMonitor(s)
        assert mon.reconfigured(2)  # the first one names the pace: nothing learned yet
        feed(mon, [0.1] * 10)
        assert mon.reconfigured(pace)
        assert mon.baseline() is None
        mon.iter_start(10, 100.0)
        assert mon.deadline() == pytest.approx(100.0 + 1800.0)  # the first iteration may set things up
        mon.iter_end(10, 0.2, 100.2)
        mon.iter_start(11, 101.0)
        assert mon.deadline() == pytest.approx(101.0 + 30 * 0.1)  # not the 30-minute warm-up bound
        assert mon.check(103.9) == []
        (f,) = mon.check(104.0)
        assert (f.kind, f.step, f.onset_ts) == (HANG, 11, 101.0) and "reconfiguration" in f.message
        assert mon.check(150.0) == []  # once, until hang_repeat_s later
        assert [f.kind for f in mon.check(164.0)] == [HANG]
    with pytest.raises(ConfigError, match="reset_hang_factor"):
        IterationSettings(reset_hang_factor=0.5)
