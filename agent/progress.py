"""Iteration progress read from a rank's output: hang and degradation detection for uninstrumented jobs.

Megatron-LM's ``training_log`` (``megatron/training/training.py``) prints, every ``--log-interval``
iterations, on the last rank::

     [2025-08-01 07:19:37] iteration       10/     100 | consumed samples:  640 | elapsed time per iteration (ms): 1234.5 | ...

(the bracketed timestamp only in newer versions). ``elapsed time per iteration`` is the mean over the
iterations since the previous line, measured by Megatron's ``interval-time`` timer, which it pauses
for evaluation and checkpoint saves. Any other job can name its own line with a regular expression
(``UNICRON_PROGRESS_REGEX`` in the task's env or the agent's settings) whose named groups are
``iteration`` (required) and optionally ``elapsed_ms`` or ``elapsed_s`` (time per iteration), and its
saves with ``UNICRON_SAVE_START_REGEX`` (and ``UNICRON_SAVE_END_REGEX``; without it the next progress
line of a later iteration ends the save): a save longer than a few intervals read as a hang, and under
``recovery: restart`` every save relaunched the job from its last checkpoint, for ever.

The unit the monitor sees is one *logging interval*: a line closes the interval that the previous
line opened, and its duration is ``(iterations since the previous line) x elapsed`` (or, with no
elapsed group, or one that is not a positive finite number, the wall time between the lines). The
hang rule then reads "no progress line for 3x the usual interval", which is the paper's 3 x D_iter
when a job logs every iteration; the sustained 1.1x degradation rule is unchanged. Megatron's
``saving checkpoint at iteration`` ...
``successfully saved checkpoint`` lines bracket a non-training phase (Megatron pauses its timer for
it, and so does the hang clock). With ``--async-save`` the phase ends at ``scheduled an async
checkpoint save``: training goes on while the save finalizes, many iterations later (taking the
success line as the end left every hang in between unjudged). A progress line ends any phase a log
line began: the job is training.

Megatron-LM evaluates right after every ``--eval-interval``-th iteration and prints nothing until it
is done (then its ``validation loss at iteration N`` box): with a short log interval the silence read
as a hang, and every evaluation cost a restart. It prints a progress line only every
``--log-interval``-th iteration (before evaluating, when both fall on one): an evaluation after
iteration E falls between the lines of iterations I and I + log interval when I <= E < I + log
interval. The job's own flags tell both (``--eval-interval``, Megatron's default 1000; ``--eval-iters
0``: none; ``--log-interval``, default 100), so the progress line before an evaluation begins an
``eval`` phase, which the validation line ends, or else the next progress line (no validation data:
nothing was evaluated). Like a checkpoint, the phase is bounded only as a whole (the monitor's
``phase_hang_s``, an hour). Trade-off: when the evaluation does not follow the line at once (E > I),
the training iterations between the line and the evaluation are inside the phase: a hang there is not
judged by the hang rule (the silence looks the same as the evaluation's); a collective stuck there
ends at its NCCL timeout, an exit the agent reports, or at the phase's bound. Taking the evaluation
for a hang instead cost a restart per evaluation.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from agent.iterations import IterationMonitor
from unicron.kernel.patterns import JobRegex
from unicron.kernel.protocol import PHASE_TRAIN

#: Megatron-LM's training_log line (also ``==> iteration`` as some forks print it); in linear time as a
#: job's own (a 64 KiB line of repeated ``iteration 1/ 2 |`` took Python's ``re`` a second)
MEGATRON_ITERATION = JobRegex(
    r"\biteration\s+(?P<iteration>\d+)\s*/\s*(?P<total>\d+)\s*\|"
    r".*?elapsed time per iteration \(ms\):\s*(?P<elapsed_ms>\d+(?:\.\d*)?)"
)
#: Megatron-LM's save_checkpoint brackets (printed by rank 0)
MEGATRON_SAVE_START = JobRegex(r"\bsaving checkpoint at iteration\s+(?P<iteration>\d+)")
MEGATRON_SAVE_END = JobRegex(r"\bsuccessfully saved checkpoint (from|at) iteration\s+\d+")
#: with ``--async-save`` the save's synchronous part ends here and training goes on; the success line
#: comes when a later iteration finalizes the save
MEGATRON_SAVE_SCHEDULED = JobRegex(r"\bscheduled an async checkpoint save at iteration\s+\d+")
#: the end of Megatron-LM's evaluation (``evaluate_and_print_results``, on the last rank)
MEGATRON_EVAL_END = JobRegex(r"\bvalidation loss at iteration\s+\d+")
#: Megatron-LM's defaults (``megatron/training/arguments.py``): an evaluation every 1000 iterations,
#: a progress line every 100
MEGATRON_EVAL_INTERVAL = 1000
MEGATRON_LOG_INTERVAL = 100
PHASE_CHECKPOINT = "checkpoint"


@dataclass(frozen=True)
class Progress:
    """One progress line."""

    iteration: int
    """The last completed iteration."""
    per_iteration_s: float | None
    """The job's own mean time per iteration since its previous line, when it prints one."""
    megatron: bool = False
    """Megatron-LM's own line (its evaluation schedule applies)."""


@dataclass(frozen=True)
class PhaseLine:
    """A line that begins a phase."""

    phase: str
    iteration: int | None = None
    """The iteration after which a non-training phase began, when the line says (a save's): the
    progress line of that iteration, read late from another rank's pipe, does not end it."""


def _flag(argv: Sequence[str], name: str) -> str | None:
    """The value of ``--name V`` or ``--name=V`` in ``argv`` (the last one wins, as argparse's)."""
    value = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(name + "="):
            value = arg[len(name) + 1:]
    return value


def megatron_eval_interval(argv: Sequence[str]) -> int:
    """Iterations between the evaluations a Megatron-LM job runs (0: none), from its own flags."""
    try:
        if int(_flag(argv, "--eval-iters") or 1) <= 0:
            return 0
        return max(0, int(_flag(argv, "--eval-interval") or MEGATRON_EVAL_INTERVAL))
    except ValueError:  # not numbers: Megatron would refuse them; its default is the best guess
        return MEGATRON_EVAL_INTERVAL


def megatron_log_interval(argv: Sequence[str]) -> int:
    """Iterations between the progress lines of a Megatron-LM job, from its own flags."""
    try:
        return max(1, int(_flag(argv, "--log-interval") or MEGATRON_LOG_INTERVAL))
    except ValueError:  # not a number: Megatron would refuse it; its default is the best guess
        return MEGATRON_LOG_INTERVAL


class LineParser:
    """Recognises progress and phase lines: Megatron-LM's, plus a job's own regexes (its env's
    ``UNICRON_PROGRESS_REGEX``, ``UNICRON_SAVE_START_REGEX``, ``UNICRON_SAVE_END_REGEX``)."""

    def __init__(self, custom: JobRegex | None = None, eval_interval: int = 0,
                 save_start: JobRegex | None = None, save_end: JobRegex | None = None,
                 log_interval: int = 1) -> None:
        """``eval_interval``: Megatron-LM's ``--eval-interval`` of the job (0: it does not evaluate);
        ``log_interval``: its ``--log-interval``."""
        self.patterns = (custom, MEGATRON_ITERATION) if custom is not None else (MEGATRON_ITERATION,)
        self.eval_interval = eval_interval
        self.log_interval = max(1, log_interval)
        self.save_start, self.save_end = save_start, save_end

    def progress(self, line: str) -> Progress | None:
        if "iteration" not in line and len(self.patterns) == 1:
            return None  # the cheap test first: most output lines are not progress lines
        for rx in self.patterns:
            groups = rx.search(line)
            if groups is None:
                continue
            try:
                iteration = int(groups["iteration"] or "")
                if (ms := groups.get("elapsed_ms")) is not None:
                    per: float | None = float(ms) / 1000.0
                elif (sec := groups.get("elapsed_s")) is not None:
                    per = float(sec)
                else:
                    per = None
            except (KeyError, TypeError, ValueError):
                continue  # a group matched something that is not a number: not a progress line
            if per is not None and not (math.isfinite(per) and per > 0):
                # "inf" made the baseline infinite (no hang ever found again), "0" a zero one (every
                # pause a hang), "nan" dropped the interval: the line's arrival time is a sane duration
                per = None
            return Progress(iteration, per, megatron=rx is MEGATRON_ITERATION)
        return None

    def evaluates_after(self, p: Progress) -> bool:
        """Whether Megatron-LM evaluates before its next progress line: after this line's iteration, or
        after one before the next line's (it evaluates whether or not the iteration printed a line)."""
        if not p.megatron or self.eval_interval <= 0:
            return False
        next_eval = -(-p.iteration // self.eval_interval) * self.eval_interval  # the first at or after it
        return next_eval < p.iteration + self.log_interval

    def phase(self, line: str) -> PhaseLine | None:
        """The phase a line begins (a save; training after an evaluation or a save), or None."""
        if self.save_start is not None and (g := self.save_start.search(line)) is not None:
            it = g.get("iteration")
            return PhaseLine(PHASE_CHECKPOINT, int(it) if it is not None and it.isascii() and it.isdigit() else None)
        if self.save_end is not None and self.save_end.matches(line):
            return PhaseLine(PHASE_TRAIN)
        if "validation loss" in line and MEGATRON_EVAL_END.matches(line):
            return PhaseLine(PHASE_TRAIN)
        if "checkpoint" not in line:
            return None
        if MEGATRON_SAVE_END.matches(line) or MEGATRON_SAVE_SCHEDULED.matches(line):
            return PhaseLine(PHASE_TRAIN)
        if (g := MEGATRON_SAVE_START.search(line)) is not None:
            return PhaseLine(PHASE_CHECKPOINT, int(g["iteration"] or 0))
        return None


class LogProgress:
    """Turns one rank's progress lines into the inputs of its :class:`IterationMonitor`."""

    def __init__(self, monitor: IterationMonitor) -> None:
        self.monitor = monitor
        self._lock = threading.Lock()  # stdout and stderr have a reader thread each
        self._last: tuple[int, float] | None = None  # (iteration, ts) of the previous line

    def feed(self, p: Progress, ts: float) -> None:
        with self._lock:
            last, self._last = self._last, (p.iteration, ts)
            if last is not None and p.iteration > last[0]:
                done = p.iteration - last[0]
                duration = done * p.per_iteration_s if p.per_iteration_s is not None else ts - last[1]
                self.monitor.iter_end(last[0], duration, ts)
            # The next interval runs from now: the hang clock starts (a restarted count starts over).
            self.monitor.iter_start(p.iteration, ts)
