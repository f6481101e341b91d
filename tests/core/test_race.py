"""A race's figures: each lane priced as it would run alone (its passes at the measured cost of their width, plus its
drafting), the speedup against the target lane, and the one sentence on whether the lanes' texts agree."""

from __future__ import annotations

from dataclasses import replace

import pytest

from specdemo.core.planning import PassCosts
from specdemo.core.race import LaneFigures, RaceCosts, agreement, first_difference, lane_figures, speedup
from tests.helpers import make_round

PASSES = PassCosts.from_seconds({1: 0.010, 4: 0.020, 8: 0.040})  # t(1) = 10 ms; t(4) = 2 steps; t(8) = 4 steps
COSTS = RaceCosts(PASSES, prompt_tokens=30, first_seconds=0.100)  # reading the 30-token prompt alone: 100 ms


def rounds_reading(*num_input_tokens: int):
    """Rounds of one emitted bonus token each, whose passes read these many tokens for the row."""
    return [replace(make_round(i, [], 0, "bonus", 0.0), num_input_tokens=n) for i, n in enumerate(num_input_tokens)]


def test_a_lane_is_priced_by_the_tokens_each_of_its_passes_read():
    """The first pass reads the 30-token prompt and 3 drafts: the prompt's measured pass and t(4) - t(1); then t(8),
    t(4) and t(1). Planted: pricing every pass as one token (t(1) a pass) gives 40 ms here, not 80 ms; the first pass
    priced by extrapolating t(n) to the prompt's 33 tokens (16.5 steps), 165 ms, not 110."""
    lane = lane_figures("suffix", rounds_reading(33, 8, 4, 1), COSTS, drafting_seconds=0.005)
    assert lane.passes == 4 and lane.token_ids == [99, 99, 99, 99]
    assert lane.pass_seconds == pytest.approx((0.100 + 0.010) + 0.040 + 0.020 + 0.010)
    assert lane.estimated_seconds == pytest.approx(0.185)
    assert lane.tokens_per_pass == 1.0
    assert lane_figures("target", rounds_reading(30, 1), COSTS, 0.0).pass_seconds == pytest.approx(0.110)


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
