"""The drafter seam: anything that proposes W candidate drafts per row with the distributions it drew them from."""

# R = rows asking for drafts, W = num_candidates, K = num_draft_tokens, T = sequence length, V = vocab_size

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import PreTrainedModel

from specdemo.config import SamplingConfig
from specdemo.core.planning import Plan
from specdemo.core.sampling import build_warpers, logits_to_probs
from specdemo.core.verify import choose_draft_tokens
from specdemo.models.tree_cache import RowRequest, TreeCachedModel


@dataclass(frozen=True)
class DraftRequest:
    """One row's ask: up to `num_candidates` drafts of up to `num_draft_tokens` tokens continuing its sequence."""

    key: Hashable  # the row, stable while it decodes (a drafter with a cache keeps the row's cache under it)
    sequence_ids: list[int]  # prompt and emitted tokens
    num_draft_tokens: int
    num_candidates: int
    sampling: SamplingConfig  # what a draft model samples with for this row
    generator: torch.Generator  # the row's own: a draft model draws one uniform per beam per step from it


@dataclass(frozen=True)
class Draft:
    """A row's W candidates and q, the exact distributions their tokens were drawn from (after every filter)."""

    token_ids: list[list[int]]  # W candidates of at most K tokens; W may be 0 when there is nothing to propose
    probs: torch.Tensor | None  # [W, K, V] float32 (V the target's); None: deterministic, q one-hot on the tokens
    forward_seconds: float = 0.0  # time in the drafter's forward passes, shared by the rows drafted together
    plan: Plan | None = None  # how much a cost-aware drafter chose to draft, and what it expected of it
    chances: list[list[float]] | None = None  # [W][K] its estimate that each token is accepted given its prefix


class Drafter(Protocol):
    """Proposes candidates for every row that asks, in one go, so a draft model runs one pass per step for all."""

    def propose(self, requests: list[DraftRequest]) -> list[Draft]: ...

    def forget(self, key: Hashable) -> None:
        """The row left the batch: drop whatever is kept for it."""


class NoDrafter:
    """Proposes nothing: every round is one target step, which is target-only decoding."""

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        return [Draft([], None) for _ in requests]

    def forget(self, key: Hashable) -> None:
        pass


def find_ngram_continuations(
    sequence_ids: torch.Tensor,  # [T] int64
    num_draft_tokens: int,
    num_candidates: int,
    max_ngram_size: int,
    min_ngram_size: int = 1,
) -> list[list[int]]:  # up to num_candidates distinct continuations of at most num_draft_tokens tokens
    """Prompt lookup (Saxena 2023): find earlier occurrences of the last n tokens, longest n first and latest match
    first, and propose what followed each; distinct continuations only, from different matches."""
    length, found = sequence_ids.shape[0], []
    for size in range(min(max_ngram_size, length - 1), min_ngram_size - 1, -1):
        windows = sequence_ids[: length - 1].unfold(0, size, 1)  # [T-size, size] every earlier n-gram
        starts = (windows == sequence_ids[length - size :]).all(dim=1).nonzero().flatten() + size  # [matches]
        for start in starts.flip(0).tolist():
            continuation = sequence_ids[start : start + num_draft_tokens].tolist()
            if continuation not in found:
                found.append(continuation)
            if len(found) == num_candidates:
                return found
    return found


class NgramDrafter:
    """Prompt-lookup drafting: no model, no cache; copies text that follows matching n-grams. With W > 1 it also
    follows one-token matches once the longer ones run out: one candidate from such a match is mostly wrong, but W of
    them checked in the same pass often hold the next token (tokens per pass in BENCHMARKS.md's batch bench)."""

    def __init__(self, max_ngram_size: int = 3, min_ngram_size: int = 2) -> None:
        self.max_ngram_size, self.min_ngram_size = max_ngram_size, min_ngram_size  # min: for W = 1

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        return [
            Draft(
                find_ngram_continuations(
                    torch.tensor(r.sequence_ids),
                    r.num_draft_tokens,
                    r.num_candidates,
                    self.max_ngram_size,
                    self.min_ngram_size if r.num_candidates == 1 else 1,
                )
                if r.num_draft_tokens
                else [],
                None,
            )
            for r in requests
        ]

    def forget(self, key: Hashable) -> None:
        pass


class ModelDrafter:
    """A smaller model sharing the target's tokenizer. Each step feeds every row's W beams in one pass (a tree on the
    row's cache) and samples each beam's next token from its own draw: W i.i.d. drafts, q recorded per token."""

    def __init__(self, model: PreTrainedModel, sampling: SamplingConfig | None, vocab_size: int) -> None:
        self.cached = TreeCachedModel(model)
        self.sampling = sampling  # None: each row's own draft settings; q is whatever the draft really sampled from
        self.vocab_size = vocab_size  # the target's: a larger padded draft embedding is cut, a smaller one padded

    def forget(self, key: Hashable) -> None:
        self.cached.drop(key)

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        beams = [[[] for _ in range(r.num_candidates)] for r in requests]  # per row, W lists of drafted tokens
        probs: list[list[torch.Tensor]] = [[] for _ in requests]  # per row, K x [W, V]
        forward_before = self.cached.forward_seconds
        samplings = [self.sampling or r.sampling for r in requests]
        warpers = [build_warpers(sampling) for sampling in samplings]  # once per row, not per step
        for step in range(max((r.num_draft_tokens for r in requests), default=0)):
            drafting = [i for i, r in enumerate(requests) if step < r.num_draft_tokens]
            logits = self.cached.logits(
                {
                    requests[i].key: RowRequest(requests[i].sequence_ids, beams[i] if step else [], "tips")
                    for i in drafting
                }
            )  # per row [W, V] after each beam (or [1, V] after the sequence at the first step)
            step_probs, uniforms = [], []
            for i, row_logits in zip(drafting, logits, strict=True):
                request = requests[i]
                contexts = torch.tensor([request.sequence_ids + beam for beam in beams[i]], device=row_logits.device)
                row_probs = logits_to_probs(  # [W, 1, V_draft] -> [W, V], q = 0 for the target's extra ids
                    row_logits[:, None, : self.vocab_size].expand(len(beams[i]), 1, -1),
                    contexts,
                    samplings[i],
                    warpers[i],
                )[:, 0]
                step_probs.append(torch.nn.functional.pad(row_probs, (0, self.vocab_size - row_probs.shape[-1])))
                uniforms.append(torch.rand(len(beams[i]), dtype=torch.float64, generator=request.generator))
            tokens = choose_draft_tokens(  # [R, W]: every beam of every row in one vmapped call
                torch.nn.utils.rnn.pad_sequence(step_probs, batch_first=True, padding_value=1.0),
                torch.nn.utils.rnn.pad_sequence(uniforms, batch_first=True),
            )
            for row, i in enumerate(drafting):
                for w, beam in enumerate(beams[i]):
                    beam.append(int(tokens[row, w]))
                probs[i].append(step_probs[row])
        forward_seconds = self.cached.forward_seconds - forward_before
        return [
            Draft(
                row_beams,
                None if not row_probs or sampling.is_greedy else torch.stack(row_probs, dim=1),
                forward_seconds,
            )  # [W, K, V]
            for sampling, row_beams, row_probs in zip(samplings, beams, probs, strict=True)
        ]
