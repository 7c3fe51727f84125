"""Fuzzed inputs to every parser of untrusted data (issue 17 item 6), a CI-sized count of each.

The properties are in ``harness.py``; ``bench/fuzz.py`` runs the same ones with a large count.
"""

from __future__ import annotations

import pytest

from tests.fuzz.harness import PURE_TARGETS, Fuzz, run_pure

EXAMPLES = 300


@pytest.mark.parametrize("target", sorted(PURE_TARGETS))
def test_every_input_is_a_typed_value_or_a_one_line_rejection(target: str) -> None:
    fuzz = Fuzz(raise_on_crash=True)
    run_pure(fuzz, target, EXAMPLES)
    assert fuzz.crashes == []
    # counted by the harness, not configured: the property really ran, and both outcomes happened
    assert fuzz.cases[target] >= EXAMPLES // 2
    assert 0 < fuzz.accepted[target] < fuzz.cases[target]
