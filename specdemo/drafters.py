"""The drafter seam: anything that proposes K tokens with the distributions it sampled them from."""

# B = batch (1 here), T = sequence length, K = num_draft_tokens, V = vocab_size

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import PreTrainedModel

from specdemo.config import SamplingConfig
from specdemo.models import KVCachedModel
from specdemo.sampling import build_warpers, draw_uniforms, logits_to_probs, sample_from_probs


@dataclass(frozen=True)
class Draft:
    """K proposed tokens and q, the exact distributions they were drawn from (after every filter)."""

    token_ids: torch.Tensor  # [B, K] int64; K may be 0 when the drafter has nothing to propose
    probs: torch.Tensor  # [B, K, V] float32


class Drafter(Protocol):
    """Proposes up to `num_draft_tokens` continuations of `sequence_ids` (which ends with the newest token)."""

    def propose(self, sequence_ids: torch.Tensor, num_draft_tokens: int, generator: torch.Generator) -> Draft: ...


def one_hot_draft(token_ids: torch.Tensor, vocab_size: int) -> Draft:  # [B, K]
    """A deterministic proposal: q is one-hot, so acceptance is u < p(d) and the residual is p without d."""
    return Draft(token_ids=token_ids, probs=torch.nn.functional.one_hot(token_ids, vocab_size).float())


class NoDrafter:
    """Proposes nothing: every round is one target step, which is target-only decoding."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def propose(self, sequence_ids: torch.Tensor, num_draft_tokens: int, generator: torch.Generator) -> Draft:
        return one_hot_draft(sequence_ids.new_empty(sequence_ids.shape[0], 0), self.vocab_size)


def find_ngram_continuation(
    sequence_ids: torch.Tensor,  # [T] int64
    max_ngram_size: int,
    num_draft_tokens: int,
) -> torch.Tensor:  # [k] int64, k <= num_draft_tokens, empty when no n-gram recurs
    """Prompt lookup (Saxena 2023): find the latest earlier occurrence of the last n tokens, longest n first,
    and propose what followed it."""
    length = sequence_ids.shape[0]
    for size in range(min(max_ngram_size, length - 1), 0, -1):
        windows = sequence_ids[: length - 1].unfold(0, size, 1)  # [T-size, size] every earlier n-gram
        matches = (windows == sequence_ids[length - size :]).all(dim=1).nonzero().flatten()  # start indices
        if matches.numel():
            start = int(matches[-1]) + size
            return sequence_ids[start : start + num_draft_tokens]
    return sequence_ids[:0]


class NgramDrafter:
    """Prompt-lookup drafting: no model, no cache; copies text that follows the latest matching n-gram."""

    def __init__(self, vocab_size: int, max_ngram_size: int = 3) -> None:
        self.vocab_size = vocab_size
        self.max_ngram_size = max_ngram_size

    def propose(self, sequence_ids: torch.Tensor, num_draft_tokens: int, generator: torch.Generator) -> Draft:
        assert sequence_ids.shape[0] == 1, "the n-gram drafter proposes for one sequence at a time"
        found = find_ngram_continuation(sequence_ids[0], self.max_ngram_size, num_draft_tokens)  # [k]
        return one_hot_draft(found[None], self.vocab_size)


class ModelDrafter:
    """A smaller model sharing the target's tokenizer, sampling K tokens one by one with its own KV cache."""

    def __init__(self, model: PreTrainedModel, sampling: SamplingConfig, vocab_size: int) -> None:
        self.cached = KVCachedModel(model)
        self.sampling = sampling  # may differ from the target's: q is whatever the draft really sampled from
        self.warpers = build_warpers(sampling)
        self.vocab_size = vocab_size  # the target's; a draft with a padded embedding is cut to it

    def propose(self, sequence_ids: torch.Tensor, num_draft_tokens: int, generator: torch.Generator) -> Draft:
        ids, probs = sequence_ids, []
        for _ in range(num_draft_tokens):
            logits = self.cached.logits(ids, num_logits=1)[..., : self.vocab_size]  # [B, 1, V]
            step_probs = logits_to_probs(logits, ids, self.sampling, self.warpers)  # [B, 1, V]
            uniforms = draw_uniforms(generator, ids.shape[0], 1, ids.device)[:, 0]  # [B]
            token = sample_from_probs(step_probs[:, 0], uniforms)  # [B]
            ids = torch.cat([ids, token[:, None]], dim=1)
            probs.append(step_probs)
        token_ids = ids[:, sequence_ids.shape[1] :]  # [B, K]
        if not probs:
            return one_hot_draft(token_ids, self.vocab_size)
        return Draft(token_ids=token_ids, probs=torch.cat(probs, dim=1))
