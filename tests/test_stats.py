"""RunStats from hand-built rounds, and the expected-speedup formula."""

from __future__ import annotations

import pytest

from specdemo.stats import best_num_draft_tokens, compare_runs, expected_speedup, run_stats
from tests.conftest import make_round


def test_run_stats_counts_tokens_rounds_and_time():
    rounds = [
        make_round(0, [1, 2, 3], 3, "bonus", 0.4),  # accepts 3, bonus: 4 tokens
        make_round(1, [4, 5, 6], 1, "resampled", 0.4),  # accepts 1, resampled: 2 tokens
        make_round(2, [], 0, "bonus", 0.2),  # nothing drafted: 1 token
    ]
    stats = run_stats(rounds)
    assert (stats.num_generated, stats.num_drafted, stats.num_accepted) == (7, 6, 4)
    assert stats.acceptance_rate == pytest.approx(4 / 6)
    assert stats.mean_tokens_per_round == pytest.approx(7 / 3)
    assert stats.wall_seconds == pytest.approx(1.0)
    assert stats.tokens_per_second == pytest.approx(7.0)
    assert stats.overhead_fraction == pytest.approx(0.5)


def test_expected_speedup_matches_the_paper():
    # Leviathan et al. (2023): alpha = 0.8, gamma = 5, c = 0.05 -> (1 - 0.8**6) / (0.2 * 1.25) = 2.95
    assert expected_speedup(0.8, 5, 0.05) == pytest.approx((1 - 0.8**6) / (0.2 * 1.25))
    assert expected_speedup(1.0, 4, 0.0) == 5.0  # everything accepted, free draft: K + 1 tokens per pass
    assert expected_speedup(0.0, 4, 0.1) == pytest.approx(1 / 1.4)  # nothing accepted: pure cost


def test_best_num_draft_tokens_grows_with_acceptance():
    assert best_num_draft_tokens(0.3, 0.2) < best_num_draft_tokens(0.9, 0.2)
    assert best_num_draft_tokens(0.99, 0.0) == 16


def test_compare_runs_measures_speedup_costs_and_identity():
    speculative = [make_round(0, [], 0, "bonus", 0.3), make_round(1, [1, 2, 3], 3, "bonus", 0.2)]  # 5 tokens
    baseline = [make_round(i, [], 0, "bonus", 0.2) for i in range(5)]  # 5 tokens, one per round
    comparison = compare_runs(speculative, baseline, num_draft_tokens=3)
    assert comparison.speedup == pytest.approx((5 / 0.5) / (5 / 1.0))
    assert comparison.verify_cost_ratio == pytest.approx(0.1 / 0.1)  # verify is half of each round's time
    assert comparison.cost_ratio == pytest.approx((0.05 / 3) / 0.1)  # a quarter of the round, over 3 drafts
    assert comparison.acceptance_rate == 1.0
    assert not comparison.identical  # the test rounds emit different tokens (bonus 99 vs drafts)
