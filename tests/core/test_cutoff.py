"""A token's place against top-k and top-p in one vector of scores, and the cut-off it falls on different sides of in
two vectors that two pass shapes rounded apart (one bfloat16 step at the k-th logit is enough)."""

# V = vocab_size

from __future__ import annotations

import pytest
import torch

from specdemo.config import SamplingConfig
from specdemo.core.cutoff import crossed_cutoff, cutoff_names, cutoff_place
from specdemo.core.sampling import build_warpers, logits_to_probs


def coupled(**settings: float) -> SamplingConfig:
    return SamplingConfig(**{"temperature": 1.0, "rule": "coupled", **settings})


def test_top_k_keeps_a_token_tied_with_the_kth_logit_and_cuts_it_one_bfloat16_step_lower():
    sampling = coupled(top_k=3)
    one_token = torch.tensor([16.0, 16.5, 15.9375, 15.9375, 15.0, 14.0])  # [V] tokens 2 and 3 tie at the 3rd value
    wide = torch.tensor([16.0, 16.5, 15.875, 15.9375, 15.0, 14.0])  # [V] token 2 one bfloat16 step lower: 4th
    assert torch.isfinite(build_warpers(sampling)(None, one_token[None])).sum() == 4  # transformers keeps the tie
    kept, cut = cutoff_place(one_token, 2, sampling), cutoff_place(wide, 2, sampling)
    assert (kept.logit, kept.rank, kept.kth_logit, kept.inside_top_k, kept.kept) == (15.9375, 3, 15.9375, True, True)
    assert (cut.logit, cut.rank, cut.kth_logit, cut.inside_top_k, cut.kept) == (15.875, 4, 15.9375, False, False)
    assert kept.mass_above is None  # no top-p set
    assert crossed_cutoff(kept, cut, sampling) == ("top-k", 3)
    assert crossed_cutoff(cut, kept, sampling) == ("top-k", 3)  # either way round
    assert crossed_cutoff(kept, cutoff_place(wide, 3, sampling), sampling) is None  # token 3 is kept in both


def test_top_p_keeps_a_token_while_the_tokens_above_it_hold_less_than_p():
    sampling = coupled(temperature=0.5, top_p=0.9)
    one_token = 0.5 * torch.tensor([0.6, 0.299, 0.06, 0.041]).log()  # [V] /0.5: log p. Above token 2: 0.899
    wide = 0.5 * torch.tensor([0.6, 0.302, 0.057, 0.041]).log()  # [V] above token 2: 0.902
    kept, cut = cutoff_place(one_token, 2, sampling), cutoff_place(wide, 2, sampling)
    assert kept.mass_above == pytest.approx(0.899, abs=1e-6) and kept.kept and kept.rank == 3
    assert cut.mass_above == pytest.approx(0.902, abs=1e-6) and not cut.kept and cut.rank == 3
    assert kept.kth_logit is None and kept.inside_top_k is None  # no top-k set
    assert crossed_cutoff(kept, cut, sampling) == ("top-p", 0.9)


def test_top_p_weighs_only_what_top_k_kept():
    sampling = coupled(top_k=3, top_p=0.9)
    logits = torch.tensor([0.5, 0.25, 0.12, 0.08, 0.05]).log()  # [V] top-3 keeps 0.87 of p
    place = cutoff_place(logits, 2, sampling)  # above it: 0.75 of those 0.87, under 0.9 (0.75 of all 1.0 would be too)
    assert place.mass_above == pytest.approx(0.75 / 0.87, abs=1e-5) and place.kept and place.inside_top_k
    assert not cutoff_place(logits, 2, coupled(top_k=3, top_p=0.85)).kept  # 0.862 is not under 0.85


@pytest.mark.parametrize(
    "settings",
    [{"top_k": 5}, {"top_k": 40}, {"top_p": 0.7}, {"top_k": 20, "top_p": 0.9}, {"top_k": 10, "temperature": 0.6}],
)
def test_kept_is_what_decoding_gives_a_nonzero_probability_and_the_cutoffs_say_why(settings):
    """On logits rounded to bfloat16, with a tie at the k-th value, `kept` is p > 0 in decoding's own probabilities,
    top-k's verdict alone (top-p off) is `kept`, and top-p's follows the mass above the token."""
    sampling = coupled(**settings)
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = (4 * torch.randn(64, generator=generator)).bfloat16().float()  # [V]
        order = logits.argsort(descending=True)  # [V]
        if sampling.top_k:
            logits[order[sampling.top_k]] = logits[order[sampling.top_k - 1]]  # the (k+1)-th ties the k-th: kept
        context_ids = torch.zeros((1, 1), dtype=torch.long)  # [1, 1] no penalty reads it
        probs = logits_to_probs(logits[None, None], context_ids, sampling, build_warpers(sampling))[0, 0]  # [V]
        for token_id in range(64):
            place = cutoff_place(logits, token_id, sampling)
            assert place.kept == bool(probs[token_id] > 0), (token_id, place)
            if sampling.top_p == 1.0:
                assert place.inside_top_k == place.kept, (token_id, place)
            elif not sampling.top_k and not _tied(logits, token_id) and abs(place.mass_above - sampling.top_p) > 1e-6:
                assert place.kept == (place.mass_above < sampling.top_p), (token_id, place)


def _tied(logits: torch.Tensor, token_id: int) -> bool:  # [V]: of tied tokens, top-p's sort order decides
    return int((logits == logits[token_id]).sum()) > 1


def test_the_cutoffs_are_named_as_the_page_names_them():
    assert cutoff_names(coupled(top_k=50, top_p=0.9)) == "top-k 50 and top-p 0.9"
    assert cutoff_names(coupled(top_p=0.95)) == "top-p 0.95"
    assert cutoff_names(coupled()) == ""
    assert cutoff_names(SamplingConfig(top_k=50)) == ""  # greedy: the argmax, no cut-off
