"""A draft model's K steps on fixed-shape passes (drafters/model_steps.py), forced on the CPU: each drafted token is
drawn from the q recorded for it, so the rule stays exact; a row drafts what it drafts on tree passes; and the coupled
rule's tokens are argmax(log q + G) with the row's noise, as on tree passes (drafters/model.py's _coupled_tokens)."""

# N = rows, W = beams, K = steps, V = vocab_size

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specdemo.audit import chi_square_pvalue
from specdemo.config import SamplingConfig
from specdemo.drafters.base import DraftRequest
from specdemo.drafters.model import ModelDrafter, _coupled_tokens
from specdemo.models import passes
from tests.helpers import TINY_VOCAB

PROMPT = [0, 5, 9, 5, 9, 12, 7, 5, 9]
SAMPLED = SamplingConfig(temperature=0.9, top_k=12, top_p=0.9, repetition_penalty=1.3)
NUM_ROWS = 400


def requests(sampling: SamplingConfig, num_rows: int, depth: int, width: int) -> list[DraftRequest]:
    """num_rows rows on one prompt, each with a seed of its own."""
    return [
        DraftRequest(row, list(PROMPT), depth, width, sampling, torch.Generator().manual_seed(row), seed=7919 * row + 1)
        for row in range(num_rows)
    ]


@pytest.fixture
def fixed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(passes.PASS_SHAPE_VARIABLE, "fixed")


def test_sampled_drafts_follow_their_q(fixed, tiny_draft) -> None:
    """400 rows, K = 2, top-k, top-p and a repetition penalty: every row's first q is the same (one context), and the
    first tokens follow it; the second tokens follow the mixture of the rows' second q (each drawn from its own
    row's). Planted: every row drawing with the first row's uniforms (all rows draft the same tokens)."""
    drafts = ModelDrafter(tiny_draft, None, TINY_VOCAB).propose(requests(SAMPLED, NUM_ROWS, 2, 1))
    assert all(d.probs is not None and d.probs.shape == (1, 2, TINY_VOCAB) for d in drafts)
    probs = torch.stack([d.probs[0] for d in drafts if d.probs is not None])  # [N, K, V]
    assert torch.equal(probs[:, 0], probs[:1, 0].expand(NUM_ROWS, -1))
    for step in range(2):
        counts = torch.bincount(torch.tensor([d.token_ids[0][step] for d in drafts]), minlength=TINY_VOCAB)
        expected = probs[:, step].double().sum(dim=0)  # [V]
        chosen = probs[torch.arange(NUM_ROWS), step, [d.token_ids[0][step] for d in drafts]]
        assert (chosen > 0).all(), "a token its q gives 0 was drafted"
        assert chi_square_pvalue(counts, expected) > 1e-4, f"step {step}"


def test_coupled_drafts_take_the_noise_as_tree_passes_do(fixed, tiny_draft) -> None:
    """48 coupled rows, W = 3, K = 3: each beam's tokens are what _coupled_tokens chooses from the program's own q and
    the row's noise (W distinct first tokens by Gumbel-top-k, then argmax(log q + G)), and the first beams' first
    tokens follow q (Gumbel-max). Planted: the noise of the position after the token's."""
    sampling = SamplingConfig(temperature=0.9, top_p=0.9, rule="coupled")
    asked = requests(sampling, 48, 3, 3)
    drafts = ModelDrafter(tiny_draft, None, TINY_VOCAB).propose(asked)
    counts = torch.zeros(TINY_VOCAB)
    for request, draft in zip(asked, drafts, strict=True):
        assert draft.probs is not None and len(draft.token_ids) == len({beam[0] for beam in draft.token_ids})
        tokens = torch.tensor(draft.token_ids)  # [W', K]
        for step in range(3):
            chosen = _coupled_tokens(request, step, draft.probs[:, step])
            assert torch.equal(chosen, tokens[:, step] if step else tokens[: len(chosen), 0]), (request.key, step)
        counts[tokens[0, 0]] += 1
    assert chi_square_pvalue(counts, drafts[0].probs[0, 0]) > 1e-4  # type: ignore[index]


TREE_MATCHED = {
    "greedy": SamplingConfig(),
    "greedy-penalty": SamplingConfig(repetition_penalty=1.4),
    "sampled": SAMPLED,
}


@pytest.mark.parametrize("sampling", TREE_MATCHED.values(), ids=TREE_MATCHED.keys())
def test_drafts_match_tree_passes(monkeypatch: pytest.MonkeyPatch, tiny_draft, sampling: SamplingConfig) -> None:
    """Eight rows, W = 2, K = 4, greedy (with a repetition penalty and without) and sampled (top-k, top-p, a penalty),
    over three rounds in which each row's sequence takes its first beam's first two tokens and another token: the
    program drafts the tree passes' tokens with their q, its chains fed what they lack, its seen rows what they miss
    and its draws the row's generator's. Planted: the seen rows not given the sequence's new tokens (the penalty's
    cases fail); each step drawing with the next step's uniforms (sampled fails)."""
    found = {}
    for shape in ("tree", "fixed"):
        monkeypatch.setenv(passes.PASS_SHAPE_VARIABLE, shape)
        drafter = ModelDrafter(tiny_draft, None, TINY_VOCAB)
        asked = requests(sampling, 8, 4, 2)
        found[shape] = []
        for _ in range(3):
            drafts = drafter.propose(asked)
            found[shape].append([(d.token_ids, d.probs) for d in drafts])
            asked = [
                replace(r, sequence_ids=[*r.sequence_ids, *d.token_ids[0][:2], (d.token_ids[0][2] + 1) % TINY_VOCAB])
                for r, d in zip(asked, drafts, strict=True)
            ]
    for fixed, tree in zip(found["fixed"], found["tree"], strict=True):
        assert [ids for ids, _ in fixed] == [ids for ids, _ in tree]
        for (_, ours), (_, theirs) in zip(fixed, tree, strict=True):
            assert (ours is None) == (theirs is None) == sampling.is_greedy
            if ours is not None:
                torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
