"""A race's figures: each lane priced as it would run alone (its passes at the measured cost of their width, plus its
drafting), the speedup against the target lane, and the one sentence on whether the lanes' texts agree."""

from __future__ import annotations

from dataclasses import replace

import pytest

from specdemo.core.planning import PassCosts
from specdemo.core.race import LaneFigures, agreement, first_difference, lane_figures, speedup
from tests.helpers import make_round

COSTS = PassCosts.from_seconds({1: 0.010, 4: 0.020, 8: 0.040})  # t(1) = 10 ms; t(4) = 2 steps; t(8) = 4 steps


def rounds_reading(*num_input_tokens: int):
    """Rounds of one emitted bonus token each, whose passes read these many tokens for the row."""
    return [replace(make_round(i, [], 0, "bonus", 0.0), num_input_tokens=n) for i, n in enumerate(num_input_tokens)]


def test_a_lane_is_priced_by_the_tokens_each_of_its_passes_read():
    """Planted: pricing every pass as one token (t(1) a pass) gives 30 ms here, not 70 ms."""
    lane = lane_figures("suffix", rounds_reading(8, 4, 1), COSTS, drafting_seconds=0.005)
    assert lane.passes == 3 and lane.token_ids == [99, 99, 99]
    assert lane.pass_seconds == pytest.approx(0.040 + 0.020 + 0.010)
    assert lane.estimated_seconds == pytest.approx(0.075)
    assert lane.tokens_per_pass == 1.0


def test_the_speedup_is_tokens_per_estimated_second_against_the_target_lanes():
    target = LaneFigures("target", [1] * 10, 10, 0.100, 0.0)
    fast = LaneFigures("ngram", [1] * 10, 4, 0.040, 0.010)
    assert speedup(fast, target) == pytest.approx(2.0)
    assert speedup(LaneFigures("x", [], 0, 0.0, 0.0), target) is None


def test_the_first_difference_counts_a_text_that_ends_early():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2


def test_agreement_says_whether_the_lanes_wrote_the_same_text():
    same = [LaneFigures(name, [4, 5, 6], 3, 0.0, 0.0) for name in ("target", "ngram", "suffix")]
    assert agreement(same, True).startswith("All 3 finished lanes wrote the same 3 tokens")
    differing = [*same[:2], LaneFigures("suffix", [4, 5, 7], 2, 0.0, 0.0)]
    assert "'suffix' from token 3" in agreement(differing, True)
    assert "differ by design" in agreement(differing, False)
    failed = [same[0], LaneFigures("ngram", [4], 1, 0.0, 0.0, error="The drafter failed.")]
    assert agreement(failed, True).startswith("Only one lane finished")
