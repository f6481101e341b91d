"""RunStats and the speedup explained, from hand-built rounds and from the rejection sampler itself."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specdemo.app.views.summary import summary_markdown
from specdemo.core.planning import Plan
from specdemo.core.stats import (
    compare_runs,
    curve_tokens_per_round,
    expected_tokens_per_round,
    median,
    planned_speedup,
    run_stats,
)
from specdemo.core.verify import rejection_sample
from tests.helpers import make_round


def timed(round_, draft: float = 0.0, verify: float = 0.1, other: float = 0.0):
    return replace(round_, draft_seconds=draft, verify_seconds=verify, other_seconds=other, forward_seconds=verify)


def one_token_steps(count: int, step: float = 0.1, prefill: float = 0.5) -> list:
    """Target-only rounds: a prompt pass, then one-token steps."""
    return [timed(make_round(i, [], 0, "bonus", 0.0), verify=prefill if i == 0 else step) for i in range(count)]


def test_run_stats_counts_tokens_tests_positions_and_time():
    rounds = [
        make_round(0, [1, 2, 3], 3, "bonus", 0.4),  # accepts 3, bonus: 4 tokens, 3 tested
        make_round(1, [4, 5, 6], 1, "resampled", 0.4),  # accepts 1, rejects 5, never tests 6: 2 tokens, 2 tested
        make_round(2, [], 0, "bonus", 0.2),  # nothing drafted: 1 token
    ]
    stats = run_stats(rounds)
    assert (stats.num_generated, stats.num_drafted, stats.num_accepted, stats.num_tested) == (7, 6, 4, 5)
    assert stats.acceptance_rate == pytest.approx(4 / 6)  # vLLM's: counts the untested 6
    assert stats.alpha == pytest.approx(4 / 5)
    assert stats.alpha_by_position == pytest.approx((1.0, 0.5, 1.0))
    assert stats.tested_by_position == (2, 2, 1)
    assert stats.no_proposal_share == pytest.approx(1 / 3)
    assert stats.mean_tokens_per_round == pytest.approx(7 / 3)
    assert stats.wall_seconds == pytest.approx(1.0)
    assert stats.tokens_per_second == pytest.approx(7.0)
    assert stats.overhead_fraction == pytest.approx(0.5)


def test_expected_tokens_per_round_matches_the_paper():
    assert expected_tokens_per_round(0.8, 5) == pytest.approx((1 - 0.8**6) / 0.2)  # Leviathan et al., eq. 1
    assert expected_tokens_per_round(1.0, 4) == 5.0  # everything accepted: K drafts and the bonus
    assert expected_tokens_per_round(0.7, 0) == 1.0  # nothing proposed: one token
    assert curve_tokens_per_round([0.5] * 5, 5) == pytest.approx(expected_tokens_per_round(0.5, 5))
    assert curve_tokens_per_round([0.5, 1.0, 1.0], 3) == pytest.approx(1 + 0.5 * 3)


def test_median_is_the_true_median():
    assert median([4.0, 1.0, 3.0, 2.0]) == 2.5  # not the upper middle, 3.0
    assert median([5.0, 1.0, 3.0]) == 3.0
    assert median([]) == 0.0


def independent_rounds(alpha: float, num_draft_tokens: int, num_rounds: int) -> list:
    """Rounds decided by rejection_sample itself: a one-hot draft token the target gives p = α at every position,
    so each tested draft is accepted independently with probability α."""
    vocab_size = 4
    draft_ids = torch.zeros(num_rounds, num_draft_tokens, dtype=torch.long)  # [B, K] always token 0
    draft_probs = torch.nn.functional.one_hot(draft_ids, vocab_size).float()  # [B, K, V]
    target_probs = torch.tensor([alpha, *[(1 - alpha) / (vocab_size - 1)] * (vocab_size - 1)])
    target_probs = target_probs.expand(num_rounds, num_draft_tokens + 1, vocab_size)  # [B, K+1, V]
    result = rejection_sample(draft_ids, draft_probs, target_probs, generator=torch.Generator().manual_seed(0))
    rounds = []
    for index, accepted in enumerate(result.num_accepted.tolist()):
        kind = "bonus" if accepted == num_draft_tokens else "resampled"
        rounds.append(timed(make_round(index, [0] * num_draft_tokens, accepted, kind, 0.0), verify=0.15))
    return rounds


def test_alpha_counts_tested_drafts_and_leviathan_predicts_independent_acceptance():
    rounds = independent_rounds(alpha=0.5, num_draft_tokens=5, num_rounds=20_000)
    stats = run_stats(rounds)
    assert stats.alpha == pytest.approx(0.5, abs=0.01)
    assert stats.acceptance_rate == pytest.approx(0.19, abs=0.01)  # accepted / drafted: not α
    assert stats.alpha_by_position == pytest.approx([0.5] * 5, abs=0.03)  # flat: independent
    comparison = compare_runs(rounds, one_token_steps(40_000, prefill=0.1), num_draft_tokens=5)
    assert comparison.predicted_tokens_per_pass == pytest.approx(stats.mean_tokens_per_round, rel=0.05)
    assert comparison.predicted_speedup == pytest.approx(comparison.speedup, rel=0.05)
    assert abs(comparison.prediction_error) < 0.05


def test_the_speedup_is_tokens_per_pass_over_round_cost():
    speculative = [
        timed(make_round(0, [7, 8], 2, "bonus", 0.0), draft=0.01, verify=0.6, other=0.02),  # the prompt pass
        timed(make_round(1, [1, 2, 3], 1, "resampled", 0.0), draft=0.03, verify=0.16, other=0.01),
        timed(make_round(2, [], 0, "bonus", 0.0), verify=0.1, other=0.005),
        timed(make_round(3, [4, 5, 6], 3, "bonus", 0.0), draft=0.02, verify=0.17, other=0.01),
    ]
    baseline = one_token_steps(10)
    c = compare_runs(speculative, baseline, num_draft_tokens=3)
    assert c.tokens_per_pass == pytest.approx(10 / 4)
    assert c.speedup == pytest.approx(c.tokens_per_pass / c.round_cost, rel=1e-12)  # the identity, exactly
    assert c.round_cost == pytest.approx(c.draft_cost + c.verify_cost + c.other_cost)
    assert c.speedup == pytest.approx((10 / 1.135) / (10 / 1.4))  # tokens/s over tokens/s
    assert dict(c.verify_cost_by_k) == pytest.approx({3: 0.165 / 0.1})  # round 0 (the prompt) left out
    assert c.verify_rounds_by_k == ((3, 2),)  # the median of two rounds, which the page says beside v(3)
    assert not c.identical  # the hand-built rounds emit other tokens than the baseline's


def test_plans_that_come_true_predict_the_measured_speedup_prompt_pass_included():
    """Plans whose tokens and steps all come true expect exactly the measured speedup, though the first round
    also reads a prompt that costs four steps more than its plan: both runs read it, and no plan chooses it."""

    def planned(index, drafts, accepted, kind, tokens, steps, seconds):
        plan = Plan(len(drafts), 1 if drafts else 0, tokens, steps, len(drafts), step_seconds=0.1)
        return replace(timed(make_round(index, drafts, accepted, kind, 0.0), verify=seconds), plan=plan)

    speculative = [
        planned(0, [7, 8], 2, "bonus", 3.0, 1.2, 0.52),  # the prompt pass: 0.5 s alone, and its drafts 0.02 s
        planned(1, [1, 2, 3], 1, "resampled", 2.0, 1.3, 0.13),
        planned(2, [], 0, "bonus", 1.0, 1.0, 0.1),
        planned(3, [4, 5, 6], 3, "bonus", 4.0, 1.3, 0.13),
    ]
    measured = compare_runs(speculative, one_token_steps(10, step=0.1, prefill=0.5), num_draft_tokens=3).speedup
    assert measured == pytest.approx(1.4 / 0.88)
    assert planned_speedup(speculative) == pytest.approx(measured, rel=1e-9)
    assert planned_speedup([replace(r, plan=None) for r in speculative]) is None


def test_correlated_acceptance_is_explained_by_the_alpha_curve():
    """Prompt lookup's shape: a copy goes on to the end or breaks at once. Leviathan's model then misses."""
    rounds = [
        timed(make_round(i, [1, 2, 3, 4, 5], 5 if i % 2 else 0, "bonus" if i % 2 else "resampled", 0.0))
        for i in range(40)
    ]
    stats = run_stats(rounds)
    assert stats.alpha_by_position == pytest.approx((0.5, 1.0, 1.0, 1.0, 1.0))
    comparison = compare_runs(rounds, one_token_steps(150, prefill=0.1), num_draft_tokens=5)
    assert comparison.prediction_error > 0.10  # independence over-predicts: 3.99 against 3.5 tokens per pass
    text = summary_markdown(stats, 5, baseline=run_stats(one_token_steps(150)), comparison=comparison)
    assert "α rises from 0.50 at position 1 to 1.00 at position 5" in text
    assert f"{comparison.speedup:.2f}×" in text and "over-predicts" in text


def test_best_num_draft_tokens_comes_from_the_alpha_curve_and_measured_costs():
    """α is 0.9 at position 1 and 0 after it, and a pass over 4 drafts costs 3 steps: proposing 1 is best."""
    rounds = [timed(make_round(0, [9, 9, 9, 9], 1, "resampled", 0.0), verify=0.5)]  # the prompt pass
    rounds += [
        timed(make_round(i, [1, 2, 3, 4], 1 if i % 10 else 0, "resampled", 0.0), verify=0.3) for i in range(1, 41)
    ]
    comparison = compare_runs(rounds, one_token_steps(200), num_draft_tokens=4)
    assert dict(comparison.verify_cost_by_k) == pytest.approx({4: 3.0})
    assert comparison.best_num_draft_tokens == 1
    # the same tokens per round for half the cost: v(1) = 1.5 by interpolation between v(0) = 1 and v(4) = 3
    assert comparison.best_speedup == pytest.approx(2 * comparison.speedup)
