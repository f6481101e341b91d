"""The inspector's numbers are the rule's own: p, q and the residual the next token came from, at each tested
position of the accepted path, by hand and from real runs of the engine on tiny models."""

from __future__ import annotations

import pytest
import torch

from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.core.inspection import TOP_ENTRIES, path_views
from specdemo.drafters import ModelDrafter
from specdemo.engine.decoding import speculative_generate
from tests.helpers import TINY_VOCAB

EOS = frozenset([1])
PROMPT = torch.tensor([[0, 5, 9, 5, 9, 12, 7, 5, 9]])


def test_a_rejection_shows_the_residual_after_every_candidate_tried_there():
    """Two candidates tried at depth 0 and both rejected: the residual is p less q0, renormalised, less q1,
    renormalised (the rule's recursion), and holds the drawn token."""
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]])  # [K+1 = 2, V = 4]
    q = torch.tensor([[[0.1, 0.8, 0.1, 0.0]], [[0.6, 0.1, 0.1, 0.2]]])  # [W = 2, K = 1, V]
    (view,) = path_views(p, q, 0, [1], 0, [0, 1], 2)
    first = (p[0] - q[0, 0]).clamp(min=0) / (p[0] - q[0, 0]).clamp(min=0).sum()  # [4/9, 0, 1/9... normalised]
    second = (first - q[1, 0]).clamp(min=0)
    expected = second / second.sum()
    residual = dict(zip(view.token_ids, view.residual, strict=True))
    assert residual[2] > 0 and all(residual[t] == pytest.approx(float(expected[t])) for t in residual)
    assert sum(view.residual) + view.residual_rest == pytest.approx(1.0)
    assert view.token_ids[:2] == [1, 0]  # by max(p, q): q = 0.8, then p = 0.5


def test_the_bonus_position_holds_p_alone_and_a_compact_vocabulary_names_real_tokens():
    p = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])  # greedy: one-hot, over V' = 3 tokens
    q = torch.tensor([[[0.0, 1.0, 0.0]]])
    vocab = torch.tensor([7, 40, 41])
    accepted, bonus = path_views(p, q, 0, [1], 1, [], 0, vocab)
    assert accepted.token_ids[0] == 40 and accepted.target[0] == 1.0 and accepted.residual == []
    assert bonus.token_ids == [7] and bonus.target == [1.0] and bonus.draft == [0.0]


@pytest.mark.parametrize(("temperature", "width"), [(0.0, 1), (1.0, 1), (1.0, 2)])
def test_each_round_of_a_run_shows_the_numbers_its_tests_used(tiny_target, tiny_draft, temperature, width):
    """Every tested position of every round: the drafted token is in the view with the q its test used (and, with one
    candidate, the p); where a rejection ended the round the drawn token has residual > 0, and with one candidate the
    residual is max(0, p - q) up to a constant."""
    sampling = SamplingConfig(temperature=temperature, seed=3)
    spec = SpeculativeConfig(num_draft_tokens=4, max_new_tokens=32, num_candidates=width)
    drafter = ModelDrafter(tiny_draft, SamplingConfig(temperature=1.0, seed=4), TINY_VOCAB)
    rounds = list(speculative_generate(tiny_target, drafter, PROMPT, sampling, spec, frozenset()))
    rejections, paths = 0, set()
    for round_ in rounds:
        paths.add(round_.path)
        assert len(round_.views) == round_.num_accepted + 1
        for position, view in enumerate(round_.views):
            assert len(view.token_ids) <= 2 * TOP_ENTRIES + 2
            at = dict(zip(view.token_ids, zip(view.target, view.draft, strict=True), strict=True))
            if position < len(round_.draft_token_ids):
                drafted = round_.draft_token_ids[position]
                assert at[drafted][1] == pytest.approx(round_.draft_probs[position])
                if width == 1:  # with siblings tried first, a test reads what remains of p
                    assert at[drafted][0] == pytest.approx(round_.target_probs[position])
            if position == round_.num_accepted and round_.next_kind == "resampled":
                rejections += 1
                residual = dict(zip(view.token_ids, view.residual, strict=True))
                assert residual[round_.next_token_id] > 0
                if width > 1:
                    continue
                scale = residual[round_.next_token_id] / (at[round_.next_token_id][0] - at[round_.next_token_id][1])
                for token, (p, q) in at.items():
                    assert residual[token] == pytest.approx(max(0.0, p - q) * scale, abs=1e-9)
            if round_.next_kind == "bonus" and position == round_.num_accepted:
                assert view.residual == [] and at[round_.next_token_id][0] > 0
    assert rejections > 3  # the tiny pair disagrees often enough for the test to mean something
    assert width == 1 or paths == {0, 1}  # and the second candidate is the accepted path in some rounds
