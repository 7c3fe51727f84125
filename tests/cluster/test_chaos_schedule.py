"""The chaos suite's schedule loop (``bench/chaos.play``) without a cluster: rounds of every kind, and
a round that raises ends the schedule as a violation instead of ending the run in a traceback (two
full runs lost their figures so: an injection its agent never executed raised TemporaryError)."""

from __future__ import annotations

import os
import random
import sys
import time

import pytest

from unicron.kernel.errors import TemporaryError

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "bench"))

import chaos  # type: ignore[import-not-found,unused-ignore]


class Rounds:
    """Stands in for ``Chaos.inject``: counts what it is given, and raises on call ``fail_at``."""

    def __init__(self, tally: chaos.Tally, fail_at: int | None = None, exc: Exception | None = None) -> None:
        self.tally, self.fail_at, self.exc, self.kinds = tally, fail_at, exc, list[str]()

    def __call__(self, kind: str, outage_s: float) -> None:
        if self.fail_at is not None and len(self.kinds) + 1 == self.fail_at:
            assert self.exc is not None
            raise self.exc
        self.kinds.append(kind)
        self.tally.injected[kind] += 1


def test_every_kind_comes_once_per_round_until_the_fault_count() -> None:
    tally = chaos.Tally()
    rounds = Rounds(tally)
    chaos.play(rounds, tally, random.Random(16), 30, time.monotonic() + 60.0, 8.0, None)
    n = len(chaos.KINDS)
    assert len(rounds.kinds) == 30 and tally.violations == []
    assert sorted(rounds.kinds[:n]) == sorted(chaos.KINDS) and sorted(rounds.kinds[n:2 * n]) == sorted(chaos.KINDS)


@pytest.mark.parametrize("exc", [TemporaryError("node node2's agent did not execute the injection within 20.0s"),
                                 TimeoutError("timed out waiting for the cluster to heal"),
                                 KeyError("node9")])
def test_a_round_that_raises_ends_the_schedule_as_one_violation(exc: Exception,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    tally = chaos.Tally()
    rounds = Rounds(tally, fail_at=5, exc=exc)
    chaos.play(rounds, tally, random.Random(16), 200, time.monotonic() + 60.0, 8.0, None)  # returns
    assert len(rounds.kinds) == 4
    assert tally.violations == [f"schedule ended: {type(exc).__name__}: {exc}"]
    assert "Traceback" in capsys.readouterr().err  # printed for triage


def test_the_stop_file_ends_the_schedule(tmp_path: os.PathLike[str]) -> None:
    stop = os.path.join(tmp_path, "stop")
    tally = chaos.Tally()

    class StopAfterThree(Rounds):
        def __call__(self, kind: str, outage_s: float) -> None:
            super().__call__(kind, outage_s)
            if len(self.kinds) == 3:
                open(stop, "w").close()

    rounds = StopAfterThree(tally)
    chaos.play(rounds, tally, random.Random(16), 200, time.monotonic() + 60.0, 8.0, stop)
    assert len(rounds.kinds) == 3 and tally.violations == []
