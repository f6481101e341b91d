"""The drafter seam: anything that proposes K tokens with the distributions it sampled them from."""

# B = batch (1 here), T = sequence length, K = num_draft_tokens, V = vocab_size

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import PreTrainedModel

from specdemo.config import SamplingConfig
from specdemo.kv_cache import KVCachedModel
from specdemo.sampling import build_warpers, draw_uniforms, logits_to_probs, sample_from_probs


@dataclass(frozen=True)
class Draft:
    """K proposed tokens and q, the exact distributions they were drawn from (after every filter)."""

    token_ids: torch.Tensor  # [B, K] int64; K may be 0 when the drafter has nothing to propose
    probs: torch.Tensor | None  # [B, K, V] float32 (V the target's); None: q is one-hot on token_ids
    forward_seconds: float = 0.0  # time the drafter spent in model forward passes (0 for prompt lookup)

    def dense_probs(self, vocab_size: int) -> torch.Tensor:  # [B, K, V]
        if self.probs is not None:
            return self.probs
        return torch.nn.functional.one_hot(self.token_ids, vocab_size).float()


class Drafter(Protocol):
    """Proposes up to `num_draft_tokens` continuations of `sequence_ids` (which ends with the newest token)."""

    def propose(self, sequence_ids: torch.Tensor, num_draft_tokens: int, generator: torch.Generator) -> Draft: ...


def one_hot_draft(token_ids: torch.Tensor) -> Draft:  # [B, K]
    """A deterministic proposal: q is one-hot, so acceptance is u < p(d) and the residual is p without d."""
    return Draft(token_ids=token_ids, probs=None)


class NoDrafter:
    """Proposes nothing: every round is one target step, which is target-only decoding."""

    def propose(self, sequence_ids: torch.Tensor, num_draft_tokens: int, generator: torch.Generator) -> Draft:
        return one_hot_draft(sequence_ids.new_empty(sequence_ids.shape[0], 0))


def find_ngram_continuation(
    sequence_ids: torch.Tensor,  # [T] int64
    num_draft_tokens: int,
    max_ngram_size: int,
    min_ngram_size: int = 1,
) -> torch.Tensor:  # [k] int64, k <= num_draft_tokens, empty when no n-gram recurs
    """Prompt lookup (Saxena 2023): find the latest earlier occurrence of the last n tokens, longest n first,
    and propose what followed it."""
    length = sequence_ids.shape[0]
    for size in range(min(max_ngram_size, length - 1), min_ngram_size - 1, -1):
        windows = sequence_ids[: length - 1].unfold(0, size, 1)  # [T-size, size] every earlier n-gram
        matches = (windows == sequence_ids[length - size :]).all(dim=1).nonzero().flatten()  # start indices
        if matches.numel():
            start = int(matches[-1]) + size
            return sequence_ids[start : start + num_draft_tokens]
    return sequence_ids[:0]


class NgramDrafter:
    """Prompt-lookup drafting: no model, no cache; copies text that follows the latest matching n-gram."""

    def __init__(self, max_ngram_size: int = 3, min_ngram_size: int = 2) -> None:
        self.max_ngram_size, self.min_ngram_size = max_ngram_size, min_ngram_size

    def propose(self, sequence_ids: torch.Tensor, num_draft_tokens: int, generator: torch.Generator) -> Draft:
        assert sequence_ids.shape[0] == 1, "the n-gram drafter proposes for one sequence at a time"
        found = find_ngram_continuation(  # [k]
            sequence_ids[0], num_draft_tokens, self.max_ngram_size, self.min_ngram_size
        )
        return one_hot_draft(found[None])


class ModelDrafter:
    """A smaller model sharing the target's tokenizer, sampling K tokens one by one with its own KV cache."""

    def __init__(self, model: PreTrainedModel, sampling: SamplingConfig, vocab_size: int) -> None:
        self.cached = KVCachedModel(model)
        self.sampling = sampling  # may differ from the target's: q is whatever the draft really sampled from
        self.warpers = build_warpers(sampling)
        self.vocab_size = vocab_size  # the target's: a larger padded draft embedding is cut, a smaller one padded

    def propose(self, sequence_ids: torch.Tensor, num_draft_tokens: int, generator: torch.Generator) -> Draft:
        ids, probs = sequence_ids, []
        forward_before = self.cached.forward_seconds
        for _ in range(num_draft_tokens):
            logits = self.cached.logits(ids, num_logits=1)[..., : self.vocab_size]  # [B, 1, V]
            step_probs = logits_to_probs(logits, ids, self.sampling, self.warpers)  # [B, 1, V_draft]
            # A draft with a smaller vocabulary gives q = 0 to the target's extra ids.
            step_probs = torch.nn.functional.pad(step_probs, (0, self.vocab_size - step_probs.shape[-1]))
            uniforms = draw_uniforms(generator, ids.shape[0], 1, ids.device)[:, 0]  # [B]
            token = sample_from_probs(step_probs[:, 0], uniforms)  # [B]
            ids = torch.cat([ids, token[:, None]], dim=1)
            probs.append(step_probs)
        token_ids = ids[:, sequence_ids.shape[1] :]  # [B, K]
        if not probs or self.sampling.is_greedy:
            return Draft(token_ids=token_ids, probs=None, forward_seconds=self.cached.forward_seconds - forward_before)
        forward_seconds = self.cached.forward_seconds - forward_before
        return Draft(token_ids=token_ids, probs=torch.cat(probs, dim=1), forward_seconds=forward_seconds)
