"""Online statistical monitoring of iteration times (paper §4.1, Figure 6).

Training is periodic: in a fixed configuration, iterations take about the same time. Two rules follow:

* **Hang** (Table 1 "task hang", sev2): an iteration still running ``hang_factor`` (3) times the
  baseline iteration time after it started is a failure. This catches what only times out much
  later (a NCCL collective waiting on a dead peer times out after up to 30 minutes).
* **Degradation** (recorded, not acted on): completed iterations slower than ``degrade_factor``
  (1.1) times the baseline are counted, and a DEGRADATION finding is raised when the slowdown is
  *sustained*: the mean of the last ``window`` iterations exceeds 1.1x the baseline. A per-iteration
  rule would fire constantly: with ±20 % jitter a quarter of all healthy iterations exceed 1.1x
  the mean. The mean of 20 such iterations has a standard deviation of ~2.6 % of the mean, so 1.1x
  is ~4 standard deviations away; a real 30 % slowdown crosses it within ``window`` iterations.

The baseline is the mean of the last ``baseline_window`` completed train-phase iterations after
``warmup_iterations`` (compilation, allocator warm-up). Iterations longer than ``outlier_factor``
(2) times the baseline - a stall that eventually finished, an iteration already reported as a hang -
never enter it: one 30-minute stall in a window of 100 ten-second iterations would otherwise raise
the mean 2.8x and blind the detector to the next hang. Moderately slow iterations do enter it, on
purpose: excluding everything above 1.1x would cut off the top of the normal jitter and bias the
baseline low (to ~0.89x the true mean with ±20 % jitter), and a lasting change of pace (e.g. after
micro-batches were redistributed to fewer ranks) becomes the new normal after about one window.

Tail memory (issue 16's realistic soak, ``bench/soak.py``): real iteration times have heavy tails (GC
pauses, data-loader stalls) that a fixed 3x-the-mean rule takes for hangs. Every completed iteration
showed that a healthy iteration can take that long, so the hang threshold is widened to
``tail_margin`` x the longest of the last ``tail_window`` completed iterations, at most
``max_hang_factor`` x the baseline. A hang never completes, so it cannot widen the threshold; an
iteration reported as a hang that later ends is not recorded either. The first stall longer than any
seen before is still reported (no rule on iteration times alone can tell it from a hang).

Data waits (``PHASE_DATA``): ``unicron.runtime`` reports the wait for each micro-batch from the data
loader as a phase. Unlike a checkpoint, a data wait happens inside an iteration and does not taint it:
the hang clock stops while the rank waits for data and resumes where it stopped, and the iteration's
sample is its duration minus its data waits (compute time). The wait itself is bounded: waiting longer
than ``data_wait_factor`` x the baseline (at least ``min_hang_s``) is a TASK_HANG (a loader stuck on a
dead filesystem). Full garbage collections (``PHASE_GC``, reported by the rank client from
``gc.callbacks`` while it trains) are waits of the same kind, bounded by ``gc_wait_factor``: a 2-3 s
gen-2 pause in a 1 s iteration was the soak's one remaining cause of false alarms. A checkpoint or an
evaluation (``PHASE_CHECKPOINT``, ``PHASE_EVAL``) suspends the hang clock, but a rank that stays in one
with no further report for ``phase_hang_s`` (an hour) is a TASK_HANG too: a save blocked for good on a
hung NFS/Lustre mount or a dead object-store endpoint otherwise left the job idle until a human noticed.
The regroup phase has no bound here: the runtime's own timeouts end a stuck regroup.
``PHASE_COLLECTIVE`` (waiting for the peers inside the iteration) is training time to the monitor; it
matters to the coordinator.

:class:`IterationMonitor` is pure logic with time passed in (one per rank). :class:`HangWatcher` is
the thread that sleeps until the earliest deadline of all monitors and reports findings. The agent
runs both on ``time.monotonic()`` (the ranks stamp their messages with it too, one clock per host): a
wall-clock step forward of more than a hang's threshold (NTP, an operator) would otherwise report every
running iteration of the node hung at once, and one backward would hide hangs for its length.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from unicron.kernel import log as ulog
from unicron.kernel.errors import ConfigError
from unicron.kernel.protocol import (
    PHASE_CHECKPOINT,
    PHASE_COLLECTIVE,
    PHASE_DATA,
    PHASE_EVAL,
    PHASE_GC,
    PHASE_TRAIN,
)
from unicron.kernel.types import ErrorKind

log = ulog.get(__name__)

#: waits inside an iteration: the hang clock stops while they last, each with its own bound
_WAITS = (PHASE_DATA, PHASE_GC)
#: phases whose iterations are judged (training, and training interrupted by a wait)
_JUDGED = (PHASE_TRAIN, *_WAITS)
#: phases outside the iterations bounded as a whole (phase_hang_s), however long the iterations are
BOUNDED_PHASES = (PHASE_CHECKPOINT, PHASE_EVAL)


@dataclass(frozen=True)
class IterationSettings:
    """Thresholds of the statistical monitor (paper §4.1)."""

    hang_factor: float = 3.0
    """An iteration running longer than this times the baseline is a hang (the paper's grey line)."""
    degrade_factor: float = 1.1
    """An iteration slower than this times the baseline is slow (the paper's blue line)."""
    warmup_iterations: int = 5
    """The first completed iterations (compilation, allocator warm-up) never enter the baseline."""
    min_samples: int = 5
    """Completed iterations after warm-up needed before hangs are judged."""
    window: int = 20
    """Recent iterations whose mean decides a sustained degradation."""
    baseline_window: int = 100
    """Recent normal iterations whose mean is the baseline."""
    outlier_factor: float = 2.0
    """Completed iterations longer than this times the baseline stay out of it (a stall that ended);
    ``math.inf`` lets every iteration update the baseline."""
    min_hang_s: float = 0.0
    """Floor of the hang threshold in seconds, for very short iterations where a GC pause or a
    scheduling hiccup is a sizeable multiple of the iteration."""
    tail_margin: float = 2.0
    """The hang threshold is at least this times the longest iteration that completed among the
    last ``tail_window`` (a GC pause or a data-loader stall that ended shows how long a healthy
    iteration can take); 0 turns the tail memory off (3x the mean only)."""
    tail_window: int = 1000
    """Recent completed train iterations whose longest widens the hang threshold."""
    max_hang_factor: float = 10.0
    """Ceiling of what the tail memory may widen the threshold to, times the baseline: hangs are
    still found within this many iterations."""
    warmup_hang_s: float = 1800.0
    """Before there is a baseline (a rank just launched, or in warm-up), a rank that reports nothing
    this long (no iteration started or ended, no phase) is a hang: the iteration rules cannot judge it
    yet. Generous: a first iteration may compile for minutes (NCCL's own timeout is 30 min); 0: off."""
    data_wait_factor: float = 10.0
    """A wait for data (the ``data`` phase) longer than this times the baseline is a hang: a loader
    stuck for good is found within this many iterations (the same ceiling as ``max_hang_factor``)."""
    gc_wait_factor: float = 10.0
    """A full garbage collection (the ``gc`` phase) longer than this times the baseline is a hang (a
    finalizer blocked for good); shorter ones stop the hang clock like a data wait."""
    phase_hang_s: float = 3600.0
    """A rank in a checkpoint or evaluation phase that reports nothing more for this long is a hang (a
    save blocked for good on a hung NFS/Lustre mount, a dead object-store endpoint, a deadlocked
    writer), found within the hour instead of when a human notices. Generous: a full save of a
    trillion-parameter model with its optimizer state (~14 TB) takes ~25 minutes at 10 GB/s to a
    parallel filesystem, and Megatron's evaluation of ``--eval-iters`` (100) iterations a few minutes;
    an hour is twice NCCL's own 30-minute timeout. 0: off (those phases unbounded)."""
    reset_hang_factor: float = 30.0
    """After :meth:`IterationMonitor.reset` (a regroup that may change each rank's work) and until a new
    baseline exists, an iteration running longer than this times the baseline before the reset is a hang,
    from the second iteration after the reset on (the first may set things up). Generous, as the pace may
    have changed (half the data-parallel ranks: twice the work); without it only ``warmup_hang_s`` of
    silence was left (30 minutes)."""
    hang_repeat_s: float = 60.0
    """A hang still there this long after its report is reported again. The first one may be lost in
    another's recovery: a frozen rank's peers wait in its collective and are found hung with it, and
    when the coordinator restarted a peer (whose report came first), the frozen rank stayed in the task
    for good (resize soak, SIGSTOP; its peers trained on without it)."""

    def __post_init__(self) -> None:
        checks = (
            ("hang_factor", self.hang_factor > 1.0, "> 1"),
            ("degrade_factor", self.degrade_factor > 1.0, "> 1"),
            ("warmup_iterations", self.warmup_iterations >= 0, ">= 0"),
            ("min_samples", self.min_samples >= 1, ">= 1"),
            ("window", self.window >= 1, ">= 1"),
            ("baseline_window", self.baseline_window >= max(self.window, self.min_samples),
             ">= window and >= min_samples"),
            ("outlier_factor", self.outlier_factor > self.degrade_factor, "> degrade_factor"),
            ("min_hang_s", self.min_hang_s >= 0.0, ">= 0"),
            ("tail_margin", self.tail_margin >= 0.0, ">= 0"),
            ("tail_window", self.tail_window >= 1, ">= 1"),
            # no rule against hang_factor: the threshold is never below hang_factor x the mean
            ("max_hang_factor", self.max_hang_factor >= 1.0, ">= 1"),
            ("data_wait_factor", self.data_wait_factor >= 1.0, ">= 1"),
            ("gc_wait_factor", self.gc_wait_factor >= 1.0, ">= 1"),
            ("warmup_hang_s", self.warmup_hang_s >= 0.0, ">= 0"),
            ("phase_hang_s", self.phase_hang_s >= 0.0, ">= 0"),
            ("hang_repeat_s", self.hang_repeat_s > 0.0, "> 0"),
            ("reset_hang_factor", self.reset_hang_factor >= 1.0, ">= 1"),
        )
        for name, ok, rule in checks:
            if not ok:
                raise ConfigError(f"iteration monitor: {name} must be {rule}, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class Finding:
    """An abnormal status found by statistical monitoring."""

    kind: ErrorKind
    """TASK_HANG or DEGRADATION."""
    step: int | None
    """The hung iteration's step, or the last step of the slow window."""
    message: str
    """What was measured against what."""
    ts: float
    """When the condition became true, on the monitor's clock: the hang deadline, or the end of the
    iteration that made the slowdown sustained (the report's source timestamp, through
    :func:`wall_time_of` where that clock is ``time.monotonic()``)."""
    onset_ts: float
    """When the problem began: the hung iteration's start, or the start of the slow window."""


class IterationMonitor:
    """Iteration statistics of one rank. Thread-safe: rank messages and the watcher thread meet here."""

    def __init__(self, settings: IterationSettings | None = None) -> None:
        self.settings = settings or IterationSettings()
        self._lock = threading.Lock()
        self.on_change: Callable[[], None] | None = None
        """Called (outside the monitor's lock) after every input; :class:`HangWatcher` sets it."""
        self._last_input: float | None = None  # the launch or the latest report (warm-up bound); kept by reset()
        self._baseline: deque[float] = deque()
        self._sum = 0.0
        self._prior: float | None = None  # the baseline before the latest reset (its post-reset bound)
        self._pace: Hashable | None = None  # what the baseline was learned at (reconfigured())
        self.reset()

    def reset(self) -> None:
        """Forget the baseline (e.g. after a reconfiguration): warm-up starts again, but until a new
        baseline exists an iteration is still bounded by ``reset_hang_factor`` x the old one."""
        with self._lock:
            mean = self._mean()
            if mean is not None:
                self._prior = mean
            self._phase = PHASE_TRAIN
            self._phase_since: float | None = None  # when the rank entered its current phase
            self._open: tuple[int, float] | None = None  # (step, start ts) of the running iteration
            self._wait_since: float | None = None  # start of the running wait (data or gc)
            self._waited = 0.0  # waits of the running iteration, ended ones
            self._tainted = False  # the open iteration spanned a non-train phase
            self._hang_reported = False
            self._again_at: float | None = None  # when a reported hang is reported again
            self._completed = 0  # train iterations completed, warm-up included
            self._baseline = deque(maxlen=self.settings.baseline_window)
            self._sum = 0.0
            self._recent: deque[tuple[float, float]] = deque(maxlen=self.settings.window)  # (start, dur)
            self._tail = SlidingMax(self.settings.tail_window)
            self._degraded = False
            self._pending: list[Finding] = []
            self.slow_iterations = 0
            """Completed iterations slower than degrade_factor x baseline (Figure 6's red dots)."""

    # --- inputs ----------------------------------------------------------------------------------

    def reconfigured(self, pace: Hashable | None) -> bool:
        """The rank's work was reconfigured (a regroup) to ``pace``, e.g. its data-parallel size (None:
        unknown). The baseline is kept when the pace is the one it was learned at (a transient fault
        reattempted with the same members), else forgotten (:meth:`reset`). True: it was forgotten."""
        with self._lock:
            same = pace is not None and pace == self._pace
            self._pace = pace
        if same:
            return False
        self.reset()
        self._changed()
        return True

    def interrupted(self, ts: float) -> None:
        """The rank is recovering in place from a fault at ``ts`` (a non-fatal exception): the open
        iteration is not a sample, a hang reported for it is over, and its hang clock restarts (the
        regroup phase that follows suspends it). The baseline stays: the pace has not changed."""
        with self._lock:
            self._last_input = ts
            if self._open is not None:
                self._open = (self._open[0], ts)
                self._tainted = True
            self._hang_reported = False
        self._changed()

    def launched(self, ts: float) -> None:
        """The rank's process was started at ``ts``: from now on it must report within
        ``warmup_hang_s`` even before it has a baseline."""
        with self._lock:
            self._last_input = ts
        self._changed()

    def iter_start(self, step: int, ts: float) -> None:
        with self._lock:
            self._last_input = ts
            self._open = (step, ts)
            self._tainted = self._phase not in _JUDGED
            self._hang_reported = False
            self._waited = 0.0
        self._changed()

    def iter_end(self, step: int, duration_s: float, ts: float) -> None:
        with self._lock:
            self._last_input = ts
            self._end_wait(ts)
            counted = self._phase in _JUDGED and not self._tainted and not self._hang_reported
            if self._open is not None and self._open[0] == step:
                self._open = None
            if self._open is None:  # the hang reported is over: no repeat is due (its time had passed: a spin)
                self._hang_reported = False
            if counted and duration_s >= 0:
                self._record(step, max(0.0, duration_s - self._waited), ts)
            self._waited = 0.0
        self._changed()

    def phase(self, name: str, ts: float) -> None:
        if name == PHASE_COLLECTIVE:
            name = PHASE_TRAIN  # waiting for peers is iteration time: its hang clock runs on
        with self._lock:
            self._last_input = ts
            was_waiting = self._phase in _WAITS
            if name in BOUNDED_PHASES or self._phase in BOUNDED_PHASES:
                self._hang_reported = False  # the rank spoke: a save or evaluation reported as a hang is over
            if name != self._phase:
                self._phase_since = ts
            self._end_wait(ts)
            if name in _WAITS:
                self._wait_since = ts  # inside the iteration: it stays a training sample
                if not was_waiting and self._phase != PHASE_TRAIN and self._open is not None:
                    self._open = (self._open[0], ts)  # out of e.g. a checkpoint: its time is not counted
            elif name != PHASE_TRAIN and self._open is not None:
                self._tainted = True  # its duration includes e.g. a checkpoint: not a training sample
            elif name == PHASE_TRAIN and self._phase != PHASE_TRAIN and not was_waiting and self._open is not None:
                self._open = (self._open[0], ts)  # the hang clock restarts when training resumes
            self._phase = name
        self._changed()

    def _end_wait(self, ts: float) -> None:
        """A wait (data or gc) ended at ``ts``: the open iteration's hang clock resumes where it stopped."""
        since, self._wait_since = self._wait_since, None
        if since is not None and self._open is None:
            # a wait between iterations that was reported as a hang is over: no repeat is due (its
            # time stayed in the past and check() found nothing to repeat: the watcher spun)
            self._hang_reported = False
        if since is None or self._open is None:
            return
        waited = max(0.0, ts - max(since, self._open[1]))
        self._waited += waited
        self._open = (self._open[0], self._open[1] + waited)

    def _changed(self) -> None:
        hook = self.on_change
        if hook is not None:
            hook()

    # --- statistics ------------------------------------------------------------------------------

    def _mean(self) -> float | None:
        if len(self._baseline) < self.settings.min_samples:
            return None
        return self._sum / len(self._baseline)

    def _record(self, step: int, duration: float, ts: float) -> None:
        self._completed += 1
        if self._completed <= self.settings.warmup_iterations:
            return
        s = self.settings
        mean = self._mean()
        if mean is not None and duration > s.degrade_factor * mean:
            self.slow_iterations += 1
        if mean is None or duration <= s.outlier_factor * mean:
            if len(self._baseline) == self._baseline.maxlen:
                self._sum -= self._baseline[0]
            self._baseline.append(duration)
            self._sum += duration
        self._recent.append((ts - duration, duration))
        # every completed iteration, outliers too: it ended, so it was no hang (one that was
        # reported as a hang never gets here, so a real hang cannot widen the threshold)
        self._tail.push(duration)
        self._judge_degradation(step, ts)

    def _judge_degradation(self, step: int, ts: float) -> None:
        s = self.settings
        mean = self._mean()
        if mean is None or len(self._recent) < s.window:
            return
        recent = sum(d for _, d in self._recent) / len(self._recent)
        slow = recent > s.degrade_factor * mean
        if slow and not self._degraded:
            self._pending.append(Finding(
                ErrorKind.DEGRADATION, step,
                f"mean of the last {len(self._recent)} iterations {recent:.3f} s > "
                f"{s.degrade_factor} x baseline {mean:.3f} s ({self.slow_iterations} slow iterations so far)",
                ts, self._recent[0][0],
            ))
        self._degraded = slow

    def baseline(self) -> float | None:
        """The baseline iteration time in seconds; None until warm-up and min_samples are done."""
        with self._lock:
            return self._mean()

    def _deadline(self) -> float | None:
        mean = self._mean()
        # a repeat is due only while check() can still find the hang: a deadline in the past that
        # check() does not act on has the watcher wait 0 s in a loop
        if self._hang_reported and (self._open is not None or self._phase in (*_WAITS, *BOUNDED_PHASES)
                                    or mean is None):
            return self._again_at if self._phase in (*_JUDGED, *BOUNDED_PHASES) else None
        if self._phase in BOUNDED_PHASES:  # with a baseline or without: a save may come before any
            return self._phase_deadline()
        if mean is None:
            return self._warmup_deadline()
        if self._phase in _WAITS and self._wait_since is not None:
            factor = self.settings.gc_wait_factor if self._phase == PHASE_GC else self.settings.data_wait_factor
            return self._wait_since + max(factor * mean, self.settings.min_hang_s)
        if self._open is None or self._phase != PHASE_TRAIN:
            return None
        return self._open[1] + max(self._threshold(mean), self.settings.min_hang_s)

    def _phase_deadline(self) -> float | None:
        """In a checkpoint or evaluation: ``phase_hang_s`` after the rank's latest report (None: off)."""
        if not self.settings.phase_hang_s or self._last_input is None:
            return None
        return self._last_input + self.settings.phase_hang_s

    def _warmup_deadline(self) -> float | None:
        s = self.settings
        silent = None
        if s.warmup_hang_s and self._last_input is not None and self._phase in _JUDGED:
            silent = self._last_input + s.warmup_hang_s
        prior = self._prior_deadline()
        if prior is None or silent is None:
            return prior if silent is None else silent
        return min(prior, silent)

    def _prior_deadline(self) -> float | None:
        """After a reset, before a new baseline: the open iteration is a hang at reset_hang_factor x the
        old baseline (not before an iteration completed since: the first may set things up)."""
        if self._prior is None or self._completed < 1 or self._open is None or self._phase != PHASE_TRAIN:
            return None
        return self._open[1] + max(self.settings.reset_hang_factor * self._prior, self.settings.min_hang_s)

    def _threshold(self, mean: float) -> float:
        """hang_factor x the mean, widened to tail_margin x the longest recent healthy iteration
        (at most max_hang_factor x the mean)."""
        s = self.settings
        tail = s.tail_margin * (self._tail.max() or 0.0)
        return max(s.hang_factor * mean, min(tail, s.max_hang_factor * mean))

    def deadline(self) -> float | None:
        """When the running iteration (or wait for data) becomes a hang; before a baseline, when the
        rank's silence does (``warmup_hang_s`` after its launch or latest report); once reported, when it
        is reported again (``hang_repeat_s``); in a checkpoint or evaluation, ``phase_hang_s`` after the
        latest report. None: no iteration open, or in the regroup phase."""
        with self._lock:
            return self._deadline()

    def check(self, now: float) -> list[Finding]:
        """Findings due at ``now``: pending degradations, and a TASK_HANG once per iteration, again every
        ``hang_repeat_s`` while it lasts."""
        with self._lock:
            out, self._pending = self._pending, []
            deadline = self._deadline()
            prior = self._prior_deadline()
            if deadline is not None and now >= deadline and self._phase in BOUNDED_PHASES:
                out.append(self._phase_hang(now, deadline))
            elif deadline is not None and now >= deadline and self._mean() is None and prior is not None \
                    and now >= prior and self._open is not None:
                step, start = self._open
                self._hang_reported = True
                out.append(Finding(
                    ErrorKind.TASK_HANG, step,
                    f"iteration {step} running {now - start:.3f} s > {self.settings.reset_hang_factor} x "
                    f"mean iteration time {self._prior:.3f} s before the latest reconfiguration "
                    f"(no new baseline yet)", deadline, start,
                ))
            elif deadline is not None and now >= deadline and self._mean() is None:
                out.append(self._warmup_hang(now, deadline))
            elif deadline is not None and now >= deadline and self._phase in _WAITS:
                out.append(self._wait_hang(now, deadline))
            elif deadline is not None and now >= deadline and self._open is not None:
                step, start = self._open
                mean = self._mean() or 0.0
                self._hang_reported = True
                out.append(Finding(
                    ErrorKind.TASK_HANG, step,
                    f"iteration {step} running {now - start:.3f} s > {self._threshold(mean):.3f} s "
                    f"(>= {self.settings.hang_factor} x mean iteration time {mean:.3f} s; "
                    f"longest recent {self._tail.max() or 0.0:.3f} s)",
                    deadline, start,
                ))
            if any(f.kind is ErrorKind.TASK_HANG for f in out):
                self._again_at = now + self.settings.hang_repeat_s
            return out

    def _warmup_hang(self, now: float, deadline: float) -> Finding:
        since = self._last_input if self._last_input is not None else deadline
        return self._silent_hang(since, deadline, f"no report for {now - since:.3f} s before a baseline "
                                 f"(launch or warm-up; bound {self.settings.warmup_hang_s} s)")

    def _phase_hang(self, now: float, deadline: float) -> Finding:
        since = self._last_input if self._last_input is not None else deadline
        entered = self._phase_since if self._phase_since is not None else since
        return self._silent_hang(since, deadline, f"in {self._phase} for {now - entered:.3f} s, no report for "
                                 f"{now - since:.3f} s > {self.settings.phase_hang_s} s (a save or an "
                                 f"evaluation that never ends: a hung filesystem, a dead storage endpoint)")

    def _wait_hang(self, now: float, deadline: float) -> Finding:
        since = self._wait_since if self._wait_since is not None else deadline
        mean = f"mean iteration time {self._mean() or 0.0:.3f} s"
        if self._phase == PHASE_GC:
            return self._silent_hang(since, deadline, f"in garbage collection {now - since:.3f} s > "
                                     f"{self.settings.gc_wait_factor} x {mean} (a finalizer is stuck)")
        return self._silent_hang(since, deadline, f"waiting for data {now - since:.3f} s > "
                                 f"{self.settings.data_wait_factor} x {mean} (the data loader is stuck)")

    def _silent_hang(self, since: float, deadline: float, message: str) -> Finding:
        """A hang judged by a bound rather than by iteration times (no baseline yet, or a wait)."""
        self._hang_reported = True
        return Finding(ErrorKind.TASK_HANG, self._open[0] if self._open else None, message, deadline, since)

    def stats(self) -> dict[str, float | int | None]:
        """Summary for the node status record."""
        with self._lock:
            return {
                "baseline_s": self._mean(),
                "completed": self._completed,
                "slow_iterations": self.slow_iterations,
                "step": self._open[0] if self._open else None,
            }


class SlidingMax:
    """The largest of the last ``size`` values pushed, in O(1) amortized (a monotonic deque)."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._n = 0
        self._q: deque[tuple[int, float]] = deque()  # (index, value), values decreasing

    def push(self, value: float) -> None:
        while self._q and self._q[-1][1] <= value:
            self._q.pop()
        self._q.append((self._n, value))
        self._n += 1
        if self._q[0][0] <= self._n - 1 - self._size:
            self._q.popleft()

    def max(self) -> float | None:
        return self._q[0][1] if self._q else None


FindingCallback = Callable[[Hashable, Finding], None]

#: the watcher's longest sleep: a far deadline (UNICRON_WARMUP_HANG_S=1e10, a rank's far-future timestamp)
#: is looked at again then, as Condition.wait refuses a timeout past threading.TIMEOUT_MAX (OverflowError)
_LONGEST_WAIT_S = 3600.0
#: after a scan that failed, the watcher scans again this much later (not at every monitor input)
_RETRY_S = 1.0


class HangWatcher:
    """One thread for all monitors of the node: it sleeps until the earliest deadline (a condition
    variable woken by every monitor input, never a fixed poll) and calls ``on_finding(key, finding)``."""

    def __init__(self, on_finding: FindingCallback, clock: Callable[[], float] = time.monotonic) -> None:
        self._on_finding = on_finding
        self._clock = clock  # the monitors' inputs are the ranks' (and log lines') time.monotonic() too
        self._cond = threading.Condition()
        self._monitors: dict[Hashable, IterationMonitor] = {}
        self._generation = 0
        self._stopped = False
        self._thread: threading.Thread | None = None

    def add(self, key: Hashable, monitor: IterationMonitor) -> None:
        """Watch ``monitor`` (one rank), reported under ``key`` (e.g. ``(task, rank)``)."""
        monitor.on_change = self.rearm
        with self._cond:
            self._monitors[key] = monitor
        self.rearm()

    def remove(self, key: Hashable, monitor: IterationMonitor | None) -> None:
        """Stop watching ``monitor`` under ``key``; nothing if another monitor holds the key now
        (a rank's newer process) or ``monitor`` is None."""
        with self._cond:
            if monitor is None or self._monitors.get(key) is not monitor:
                return
            self._monitors.pop(key)
        monitor.on_change = None
        self.rearm()

    def rearm(self) -> None:
        """Recompute the earliest deadline now (called automatically on every monitor input)."""
        with self._cond:
            self._generation += 1
            self._cond.notify_all()

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="hang-watcher", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._stopped:
                    return
                generation = self._generation
                monitors = list(self._monitors.items())
            # Monitors are consulted without the watcher's lock: a monitor input calls rearm()
            # while holding nothing, and the watcher never waits on a monitor while holding its own.
            try:
                earliest = self._scan(monitors)
            except Exception:  # one bad scan must not end the node's hang detection for good
                log.exception("hang watcher: a scan failed; scanning again", retry_s=_RETRY_S)
                with self._cond:
                    self._cond.wait_for(lambda: self._stopped, _RETRY_S)
                continue
            with self._cond:
                if self._stopped:
                    return
                if self._generation != generation:
                    continue  # something changed while scanning: scan again
                timeout = None if earliest is None else min(max(0.0, earliest - self._clock()), _LONGEST_WAIT_S)
                self._cond.wait(timeout)

    def _scan(self, monitors: list[tuple[Hashable, IterationMonitor]]) -> float | None:
        earliest: float | None = None
        for key, monitor in monitors:
            for finding in monitor.check(self._clock()):
                self._deliver(key, finding)
            deadline = monitor.deadline()
            if deadline is not None and (earliest is None or deadline < earliest):
                earliest = deadline
        return earliest

    def _deliver(self, key: Hashable, finding: Finding) -> None:
        log.warning("iteration finding", key=key, kind=finding.kind.value, detail=finding.message)
        try:
            self._on_finding(key, finding)
        except Exception:
            log.exception("on_finding callback failed", key=key)


def wall_time_of(mono: float) -> float:
    """A ``time.monotonic()`` instant as wall-clock time, for reports (their timestamps are compared
    across hosts)."""
    return time.time() - (time.monotonic() - mono)


__all__ = ["BOUNDED_PHASES", "Finding", "HangWatcher", "IterationMonitor", "IterationSettings", "SlidingMax", "wall_time_of"]
