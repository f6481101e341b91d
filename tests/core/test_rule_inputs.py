"""Rows padded into one batch for the rule: a row beside a wider, deeper row with a larger compact vocabulary gets the
verdict it gets alone, its next token named in the whole vocabulary. Planted: draws padded at the end, not per depth."""

from __future__ import annotations

from dataclasses import replace

import torch

from specdemo.core.rule_inputs import RuleInputs, pad_rows
from specdemo.core.rules import STANDARD
from specdemo.core.verify import CandidateVerdict

NUM_PAIRS = 40


def random_row(generator: torch.Generator, width: int, depth: int, vocab_ids: list[int]) -> RuleInputs:
    """A sampled row over a compact vocabulary: q and p far apart, ragged lengths, its own draws."""
    vocab_size = len(vocab_ids)
    draft_probs = torch.softmax(torch.randn(width, depth, vocab_size, generator=generator) * 3, -1)  # [W, K, V]
    target_probs = torch.softmax(torch.randn(width, depth + 1, vocab_size, generator=generator) * 3, -1)
    draft_ids = torch.multinomial(draft_probs.flatten(0, 1), 1, generator=generator).view(width, depth)  # [W, K]
    return RuleInputs(
        draft_token_ids=draft_ids,
        draft_lengths=torch.randint(1, depth + 1, (width,), generator=generator),
        draft_probs=draft_probs,
        target_probs=target_probs,
        uniforms=torch.rand(depth * width + 1, dtype=torch.float64, generator=generator),
        vocab=torch.tensor(vocab_ids),
        rule=STANDARD,
    )


def pairs() -> list[tuple[RuleInputs, RuleInputs]]:
    """(W = 2, K = 2, V' = 4) rows beside (W = 3, K = 4, V' = 6) rows."""
    generator = torch.Generator().manual_seed(13)
    return [
        (random_row(generator, 2, 2, [2, 5, 7, 9]), random_row(generator, 3, 4, [0, 1, 3, 4, 8, 11]))
        for _ in range(NUM_PAIRS)
    ]


def row_zero(verdict: CandidateVerdict, width: int, depth: int) -> tuple:
    return (
        verdict.tested[0, :width, :depth],
        verdict.accepted[0, :width, :depth],
        verdict.target_draft_probs[0, :width, :depth],
        verdict.uniforms[0, :width, :depth],
        verdict.path[0],
        verdict.num_accepted[0],
        verdict.next_token_ids[0],
        verdict.next_token_probs[0],
    )


def same(first: tuple, second: tuple) -> bool:
    return all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def decisions(verdict: CandidateVerdict) -> tuple[int, int, int]:
    """Row 0's path, accepted count and next token."""
    return int(verdict.path[0]), int(verdict.num_accepted[0]), int(verdict.next_token_ids[0])


def test_a_row_padded_beside_a_larger_one_gets_its_own_verdict():
    for row, larger in pairs():
        alone = pad_rows([row]).verdict()
        beside = pad_rows([row, larger]).verdict()
        assert same(row_zero(alone, 2, 2), row_zero(beside, 2, 2))
        assert int(beside.next_token_ids[0]) in row.vocab.tolist()  # never a padding token
        assert int(beside.next_token_ids[1]) in larger.vocab.tolist()


def test_draws_padded_at_the_end_change_some_verdict():
    """Planted: the row's K*W draws kept in order at the front, so test (j, w) reads another draw beside a wider row."""
    changed = 0
    for row, larger in pairs():
        alone = pad_rows([row]).verdict()
        batch = pad_rows([row, larger])
        flat = batch.uniforms.clone()  # [B, K*W + 1]
        flat[0] = torch.cat([row.uniforms[:-1], flat.new_zeros(flat.shape[1] - len(row.uniforms)), row.uniforms[-1:]])
        changed += decisions(alone) != decisions(replace(batch, uniforms=flat).verdict())
    assert changed > 0, "the planted padding went unnoticed"
