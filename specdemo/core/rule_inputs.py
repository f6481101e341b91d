"""Pure: one row's inputs to the rule, named, and rows padded to one shape and stacked as verify_rows takes them."""

# B = rows, W = num_candidates, K = num_draft_tokens (the longest candidate), V = the vocabulary the rule runs on
# (all of it, or a greedy row's V' tokens: the drafts and the target's argmaxes)

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch.nn.functional import pad

from specdemo.core.rules import Rule
from specdemo.core.verify import CandidateVerdict


@dataclass(frozen=True)
class RuleInputs:
    """One row's inputs to the multi-candidate rule (verify_candidates), with the row's own settings and draws. With a
    compact vocabulary the ids, q and p index and span the V' tokens of `vocab`; the verdict names them back."""

    draft_token_ids: torch.Tensor  # [W, K] int64, each candidate padded past its length
    draft_lengths: torch.Tensor  # [W] int64; 0 for a padding candidate
    draft_probs: torch.Tensor  # [W, K, V] q each token was drafted from (one-hot: deterministic)
    target_probs: torch.Tensor  # [W, K+1, V] p along candidate w's path, position j after its first j tokens
    uniforms: torch.Tensor  # [K*W + 1] float64: the test of candidate w at depth j uses j*W + w, the last is final
    vocab: torch.Tensor  # [V] int64 sorted, the token ids V stands for (0 past them when padded); empty: all of them
    rule: Rule  # what decides the row (rows decided together share it)
    noise: torch.Tensor | None = None  # [K+1, V] float64 the coupled rule's G at the round's positions; None for a
    # rule without noise

    def padded(self, num_candidates: int, depth: int, vocab_size: int) -> RuleInputs:
        """The row at a W, K and V no smaller than its own: padding candidates have length 0, so they are never tested;
        padding tokens have p = q = 0, so they are never drawn; test (j, w) still reads draw j*W + w of its own W."""
        width, num_draft = self.draft_token_ids.shape
        more_candidates, more_depth = num_candidates - width, depth - num_draft
        extra = vocab_size - self.target_probs.shape[-1]
        draws = self.uniforms.new_zeros(depth * num_candidates + 1)  # [K*W + 1] at the padded K and W
        draws[:-1].view(depth, num_candidates)[:num_draft, :width] = self.uniforms[:-1].view(num_draft, width)
        draws[-1] = self.uniforms[-1]
        return RuleInputs(
            draft_token_ids=pad(self.draft_token_ids, (0, more_depth, 0, more_candidates)),
            draft_lengths=pad(self.draft_lengths, (0, more_candidates)),
            draft_probs=pad(self.draft_probs, (0, extra, 0, more_depth, 0, more_candidates)),
            target_probs=pad(self.target_probs, (0, extra, 0, more_depth, 0, more_candidates)),
            uniforms=draws,
            vocab=pad(self.vocab, (0, extra)) if len(self.vocab) else self.vocab,
            rule=self.rule,
            noise=None if self.noise is None else pad(self.noise, (0, extra, 0, more_depth)),
        )


@dataclass(frozen=True)
class RuleBatch:
    """Rows padded to the largest W, K and V among them (RuleInputs.padded) and stacked."""

    draft_token_ids: torch.Tensor  # [B, W, K] int64
    draft_lengths: torch.Tensor  # [B, W] int64
    draft_probs: torch.Tensor  # [B, W, K, V]
    target_probs: torch.Tensor  # [B, W, K+1, V]
    uniforms: torch.Tensor  # [B, K*W + 1] float64
    vocabs: torch.Tensor  # [B, V] int64 each row's token ids; [B, 0]: the whole vocabulary
    rule: Rule
    noise: torch.Tensor | None = None  # [B, K+1, V] float64 where the rule reads noise

    def verdict(self) -> CandidateVerdict:
        """The rule's verdict on every row, each row's next token named in the whole vocabulary."""
        verdict = self.rule.decide(self)
        if not self.vocabs.shape[1]:
            return verdict
        local = verdict.next_token_ids  # [B] indices into each row's V'
        return replace(verdict, next_token_ids=self.vocabs.gather(1, local.unsqueeze(1)).squeeze(1))


def pad_rows(rows: Sequence[RuleInputs]) -> RuleBatch:
    """The rows as one batch for the rule: each padded to the largest W, K and V among them."""
    assert rows, "pad_rows needs at least one row"
    num_candidates = max(row.draft_token_ids.shape[0] for row in rows)
    depth = max(row.draft_token_ids.shape[1] for row in rows)
    vocab_size = max(row.target_probs.shape[-1] for row in rows)
    padded = [row.padded(num_candidates, depth, vocab_size) for row in rows]
    rules = {row.rule for row in rows}
    assert len(rules) == 1, f"pad_rows takes rows of one rule, got {rules}"
    return RuleBatch(
        draft_token_ids=torch.stack([row.draft_token_ids for row in padded]),
        draft_lengths=torch.stack([row.draft_lengths for row in padded]),
        draft_probs=torch.stack([row.draft_probs for row in padded]),
        target_probs=torch.stack([row.target_probs for row in padded]),
        uniforms=torch.stack([row.uniforms for row in padded]),
        vocabs=torch.stack([row.vocab for row in padded]),
        rule=rows[0].rule,
        noise=None if rows[0].noise is None else torch.stack([row.noise for row in padded]),  # type: ignore[misc]
    )
