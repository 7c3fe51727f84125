"""Progress lines of uninstrumented jobs (Megatron-LM's, or a job's own regex) -> the iteration monitor."""

from __future__ import annotations

import pytest

from agent.iterations import IterationMonitor, IterationSettings
from agent.progress import (
    LineParser,
    LogProgress,
    PhaseLine,
    Progress,
    megatron_eval_interval,
    megatron_log_interval,
)
from agent.settings import AgentSettings
from unicron.kernel.errors import ConfigError
from unicron.kernel.patterns import (
    ENV_PROGRESS_REGEX,
    ENV_SAVE_END_REGEX,
    ENV_SAVE_START_REGEX,
    MAX_MATCHED_CHARS,
    compile_job_regex,
)
from unicron.kernel.protocol import PHASE_TRAIN
from unicron.kernel.types import ErrorKind

# As Megatron-LM's training_log prints them: the classic format, the newer one with a timestamp,
# and the "==>" variant of some forks.
MEGATRON = [
    (" iteration       10/     100 | consumed samples:          640 | elapsed time per iteration (ms): 1234.5 |"
     " learning rate: 1.500E-04 | global batch size:    64 | lm loss: 1.043863E+01 | loss scale: 1.0 |"
     " number of skipped iterations:   0 | number of nan iterations:   0 |", Progress(10, 1.2345)),
    (" [2025-08-01 07:19:50] iteration        2/    5000 | consumed samples:          256 | elapsed time per"
     " iteration (ms): 12936.1 | throughput per GPU (TFLOP/s/GPU): 118.7 | learning rate: 1.395349E-07 |",
     Progress(2, 12.9361)),
    ("==> iteration      300/    1000 | consumed samples:        19200 | consumed tokens:     39321600 |"
     " elapsed time per iteration (ms): 87.0 | learning rate: 3.000E-04 |", Progress(300, 0.087)),
]


@pytest.mark.parametrize(("line", "expected"), MEGATRON)
def test_megatron_progress_lines(line: str, expected: Progress) -> None:
    got = LineParser().progress(line)
    assert got is not None
    assert got.iteration == expected.iteration
    assert got.per_iteration_s == pytest.approx(expected.per_iteration_s)


@pytest.mark.parametrize("line", [
    " validation loss at iteration 100 | lm loss value: 1.012345E+01 | lm loss PPL: 2.4E+04 |",
    " saving checkpoint at iteration     100 to /ckpt in torch format",
    "[Rank 0] (after 10 iterations) memory (MB) | allocated: 9334.4 | max allocated: 12680.6",
    "iteration 7",  # no total, no time: not Megatron's line
    "",
])
def test_other_lines_are_not_progress(line: str) -> None:
    assert LineParser().progress(line) is None


def test_checkpoint_lines_bracket_a_phase() -> None:
    p = LineParser()
    assert p.phase(" saving checkpoint at iteration     100 to /ckpt in torch format") == PhaseLine("checkpoint", 100)
    assert p.phase("  successfully saved checkpoint from iteration     100 to /ckpt [ t 1/1, p 1/1 ]") == PhaseLine(PHASE_TRAIN)
    assert p.phase(" loading checkpoint from /ckpt at iteration 100") is None


def test_custom_regex_with_and_without_elapsed_time() -> None:
    timed = LineParser(compile_job_regex(ENV_PROGRESS_REGEX, r"step (?P<iteration>\d+) took (?P<elapsed_s>[\d.]+)s"))
    assert timed.progress("INFO step 42 took 0.25s loss=1.0") == Progress(42, 0.25)
    # Megatron's lines still count next to a custom regex.
    assert timed.progress(MEGATRON[0][0]) == Progress(10, pytest.approx(1.2345), megatron=True)  # type: ignore[arg-type]
    bare = LineParser(compile_job_regex(ENV_PROGRESS_REGEX, r"^epoch \d+ batch (?P<iteration>\d+)$"))
    assert bare.progress("epoch 1 batch 17") == Progress(17, None)
    assert bare.progress("epoch 1 batch x17") is None


@pytest.mark.parametrize("pattern", [r"step (\d+)", r"step (?P<iteration>\d+", ""])
def test_bad_custom_regex_is_a_config_error(pattern: str) -> None:
    with pytest.raises(ConfigError):
        compile_job_regex(ENV_PROGRESS_REGEX, pattern)


@pytest.mark.timeout(20)
def test_a_jobs_regex_is_matched_in_linear_time_and_on_a_lines_start_only() -> None:
    """The agent matches every output line on its reader threads, and Python's backtracking ``re`` held
    the GIL for the whole match: ``(a+)+$`` on a line of 40 a's never returns there (2^40 paths), and
    one such line stalled the agent's heartbeat until its node was isolated."""
    nested = LineParser(compile_job_regex(ENV_PROGRESS_REGEX, r"^(?P<iteration>\d+)(a+)+$"))
    assert nested.progress("1" + "a" * 40 + "b") is None
    assert nested.progress("7" + "a" * 40) == Progress(7, None)
    greedy = LineParser(compile_job_regex(ENV_PROGRESS_REGEX, r".*step (?P<iteration>\d+)"))
    assert greedy.progress("x" * 65536) is None
    assert greedy.progress("step 3 " + "x" * 65536) == Progress(3, None)
    assert greedy.progress("x" * (MAX_MATCHED_CHARS + 1) + " step 3") is None  # past the start: not one
    assert LineParser().progress("iteration 1/ 2 |" * 4096) is None  # Megatron's own, as long


def test_a_regex_re2_cannot_match_in_linear_time_is_refused_naming_the_variable() -> None:
    with pytest.raises(ConfigError, match=r"^UNICRON_PROGRESS_REGEX: .* RE2 .*lookaround"):
        compile_job_regex(ENV_PROGRESS_REGEX, r"(?<=step )(?P<iteration>\d+)")
    with pytest.raises(ConfigError, match="backreferences"):
        compile_job_regex(ENV_SAVE_END_REGEX, r"(saved)\1")


@pytest.mark.parametrize("pattern", ["(?P<iteration>a{99999999999999999999})", "(" * 3000 + "(?P<iteration>a)" + ")" * 3000])
def test_a_regex_past_pythons_limits_is_no_traceback(pattern: str) -> None:
    """Python's re raised OverflowError (a huge count) and RecursionError (deep nesting), not re.error:
    they escaped as tracebacks, from Submit and from the agent's start. RE2 takes both and matches them
    in linear time; a refused one's error stays one line, naming the flag at the agent's start."""
    assert compile_job_regex(ENV_PROGRESS_REGEX, pattern).matches("x" * 65536) is False
    AgentSettings(node="a0", etcd="127.0.0.1:1", progress_regex=pattern).validate()
    with pytest.raises(ConfigError, match=r"^--progress-regex / UNICRON_PROGRESS_REGEX: .* RE2 ") as err:
        AgentSettings(node="a0", etcd="127.0.0.1:1", progress_regex="(?<=x)" + pattern).validate()
    assert len(str(err.value)) < 300


def feeder() -> tuple[IterationMonitor, LogProgress]:
    mon = IterationMonitor(IterationSettings(warmup_iterations=1, min_samples=3))
    return mon, LogProgress(mon)


def test_lines_become_logging_intervals_and_a_silence_becomes_a_hang() -> None:
    mon, feed = feeder()
    # A line every 10 iterations of 0.1 s: each interval lasts 1 s.
    t = 0.0
    for n in range(1, 7):
        feed.feed(Progress(10 * n, 0.1), t)
        t += 1.0
    last = t - 1.0
    assert mon.baseline() == pytest.approx(1.0)  # the interval, from Megatron's own time per iteration
    assert mon.deadline() == pytest.approx(last + 3.0)
    assert mon.check(last + 2.9) == []
    (hang,) = mon.check(last + 3.0)
    assert (hang.kind, hang.step) == (ErrorKind.TASK_HANG, 60)


def test_without_elapsed_time_the_wall_time_between_lines_is_the_interval() -> None:
    mon, feed = feeder()
    for n, t in enumerate([0.0, 0.5, 1.0, 1.5, 2.0, 2.5]):
        feed.feed(Progress(n, None), t)
    assert mon.baseline() == pytest.approx(0.5)


@pytest.mark.parametrize("elapsed", ["inf", "1e999", "nan", "0", "0.0", "-1"])
def test_an_elapsed_time_that_is_no_duration_falls_back_to_the_lines_arrival(elapsed: str) -> None:
    """A regex whose elapsed group matched "inf" fed an infinite interval: the baseline became inf and
    no hang was ever found again; "0" made a zero baseline, every pause a hang."""
    parser = LineParser(compile_job_regex(ENV_PROGRESS_REGEX, r"step (?P<iteration>\d+) took (?P<elapsed_s>\S+)s"))
    assert parser.progress(f"step 30 took {elapsed}s") == Progress(30, None)
    mon, feed = feeder()
    t = 0.0
    for n in range(1, 9):  # a line a second, each of 10 iterations of 0.1 s, every other one with `elapsed`
        p = parser.progress(f"step {10 * n} took {elapsed if n % 2 else '0.1'}s")
        assert p is not None
        feed.feed(p, t)
        t += 1.0
    last = t - 1.0
    assert mon.baseline() == pytest.approx(1.0)
    assert mon.check(last + 2.9) == []
    assert [f.kind for f in mon.check(last + 3.0)] == [ErrorKind.TASK_HANG]


def test_a_sustained_slowdown_in_the_lines_is_a_degradation() -> None:
    mon = IterationMonitor(IterationSettings(warmup_iterations=1, min_samples=3, window=5, baseline_window=50))
    feed = LogProgress(mon)
    t, it = 0.0, 0
    per_iteration = [0.1] * 30 + [0.13] * 10  # Megatron reports 30 % slower iterations
    for per in per_iteration:
        it += 10
        feed.feed(Progress(it, per), t)
        t += 10 * per
    found = [f.kind for f in mon.check(t)]
    assert ErrorKind.DEGRADATION in found


def test_a_checkpoint_save_pauses_the_hang_clock() -> None:
    mon, feed = feeder()
    for n in range(1, 7):
        feed.feed(Progress(10 * n, 0.1), float(n - 1))
    mon.phase("checkpoint", 5.5)
    assert mon.deadline() == pytest.approx(5.5 + 3600.0)  # a 30-second save is not a hang: an hour's bound
    assert mon.check(39.9) == []
    mon.phase(PHASE_TRAIN, 40.0)
    assert mon.deadline() == pytest.approx(43.0)


def test_megatrons_evaluation_schedule_comes_from_the_jobs_flags() -> None:
    assert megatron_eval_interval(["python", "pretrain_gpt.py", "--eval-interval", "200"]) == 200
    assert megatron_eval_interval(["python", "pretrain_gpt.py", "--eval-interval=50"]) == 50
    assert megatron_eval_interval(["python", "pretrain_gpt.py"]) == 1000  # Megatron's default
    assert megatron_eval_interval(["pretrain_gpt.py", "--eval-interval", "200", "--eval-iters", "0"]) == 0
    parser = LineParser(eval_interval=200)
    line = (" [2025-08-01 07:19:37] iteration      200/    1000 | consumed samples: 12800 |"
            " elapsed time per iteration (ms): 1234.5 | learning rate: 1.5E-04 |")
    p = parser.progress(line)
    assert p is not None and p.megatron and parser.evaluates_after(p)
    assert LineParser().phase(" validation loss at iteration 200 | lm loss value: 1.04E+01 |") == PhaseLine("train")
    custom = LineParser(compile_job_regex(ENV_PROGRESS_REGEX, r"^step (?P<iteration>\d+)"), eval_interval=200)
    q = custom.progress("step 200 loss 1.0")
    assert q is not None and not custom.evaluates_after(q)  # a job's own line: Megatron's schedule is not its


def test_a_megatron_evaluation_between_two_progress_lines_begins_at_the_first() -> None:
    """It evaluates after iteration E whether or not E printed a line: the line of I is the last before
    the evaluation when I <= E < I + log interval (at E = I + log interval, that line comes first)."""
    assert megatron_log_interval(["pretrain_gpt.py", "--log-interval", "10"]) == 10
    assert megatron_log_interval(["pretrain_gpt.py"]) == 100  # Megatron's default
    parser = LineParser(eval_interval=25, log_interval=10)
    evaluating = [i for i in range(10, 160, 10) if parser.evaluates_after(Progress(i, 1.0, megatron=True))]
    assert evaluating == [20, 50, 70, 100, 120, 150]


def test_a_jobs_own_save_lines_bracket_a_checkpoint_phase() -> None:
    p = LineParser(compile_job_regex(ENV_PROGRESS_REGEX, r"^step (?P<iteration>\d+)"),
                   save_start=compile_job_regex(ENV_SAVE_START_REGEX, r"^saving model at step (?P<iteration>\d+)"),
                   save_end=compile_job_regex(ENV_SAVE_END_REGEX, r"^model saved"))
    assert p.phase("saving model at step 300") == PhaseLine("checkpoint", 300)
    assert p.phase("model saved in 12.5 s") == PhaseLine(PHASE_TRAIN)
    assert p.phase("step 301 loss 1.0") is None
    # no iteration group: the save ends at the next progress line, whatever its iteration
    bare = LineParser(save_start=compile_job_regex(ENV_SAVE_START_REGEX, r"checkpointing"))
    assert bare.phase("INFO checkpointing to /ckpt") == PhaseLine("checkpoint", None)
