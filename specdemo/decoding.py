"""The decoding loops: speculative rounds (draft, verify, accept) and target-only decoding, yielding one Round each."""

# B = batch (1 here), T = sequence length, K = num_draft_tokens, V = vocab_size

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
from transformers import LogitsProcessorList, PreTrainedModel

from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.drafters import Draft, Drafter, NoDrafter
from specdemo.kv_cache import KVCachedModel
from specdemo.rejection import RejectionResult, greedy_verify, rejection_sample
from specdemo.sampling import build_warpers, greedy_token_ids, logits_to_probs

NextKind = Literal["resampled", "bonus"]


@dataclass(frozen=True)
class Round:
    """One draft proposal and one target verification pass, with every number behind its outcome."""

    index: int
    draft_token_ids: list[int]  # the K proposed tokens (K may be 0: nothing to propose, a plain target step)
    target_probs: list[float]  # p(d_i) under the target, with the user's settings
    draft_probs: list[float]  # q(d_i), the probability the drafter sampled d_i with
    acceptance_probs: list[float]  # min(1, p(d_i) / q(d_i))
    uniforms: list[float]  # u_i; d_i was accepted when u_i * q(d_i) < p(d_i)
    num_accepted: int  # accepted drafts (drafts are cut after their first EOS before verification)
    next_token_id: int | None  # the resampled or bonus token; None when an accepted EOS ended the run
    next_kind: NextKind | None
    next_token_prob: float | None  # the target probability of next_token_id
    num_input_tokens: int  # tokens the target read in this pass (the whole prompt in round 0)
    draft_seconds: float  # proposing, draft model forwards included
    verify_seconds: float  # the target forward pass
    other_seconds: float  # probabilities, rejection sampling and bookkeeping
    forward_seconds: float  # time inside model forward passes (draft and target), for the overhead figure

    @property
    def emitted_token_ids(self) -> list[int]:
        accepted = self.draft_token_ids[: self.num_accepted]
        return accepted if self.next_token_id is None else [*accepted, self.next_token_id]

    @property
    def wall_seconds(self) -> float:
        return self.draft_seconds + self.verify_seconds + self.other_seconds


def _eos_cut(token_ids: list[int], eos_token_ids: frozenset[int]) -> int:
    """How many tokens to keep: up to and including the first EOS, since nothing after an EOS is emitted."""
    for position, token in enumerate(token_ids):
        if token in eos_token_ids:
            return position + 1
    return len(token_ids)


def _draft_until_eos(draft: Draft, eos_token_ids: frozenset[int]) -> Draft:
    """Drafts after an EOS could never be emitted, so they are neither verified nor counted."""
    keep = _eos_cut(draft.token_ids[0].tolist(), eos_token_ids)
    if keep == draft.token_ids.shape[1]:
        return draft
    probs = None if draft.probs is None else draft.probs[:, :keep]
    return Draft(draft.token_ids[:, :keep], probs, draft.forward_seconds)


def _emitted(drafts: list[int], num_accepted: int, next_token: int, eos_token_ids: frozenset[int]) -> list[int]:
    """The accepted drafts and the resampled or bonus token, up to the first EOS."""
    emitted = [*drafts[:num_accepted], next_token]
    return emitted[: _eos_cut(emitted, eos_token_ids)]


def verify(
    draft: Draft,
    target_logits: torch.Tensor,  # [1, k+1, V]
    candidate_ids: torch.Tensor,  # [1, T+k] the sequence and the draft
    sampling: SamplingConfig,
    warpers: LogitsProcessorList,
    generator: torch.Generator,
) -> RejectionResult:
    """Rejection sampling; at temperature 0 with a deterministic drafter, its exact one-hot special case."""
    if sampling.is_greedy and draft.probs is None:
        target_ids = greedy_token_ids(target_logits, candidate_ids, sampling)  # [1, k+1]
        return greedy_verify(draft.token_ids, target_ids, generator=generator)
    target_probs = logits_to_probs(target_logits, candidate_ids, sampling, warpers)  # [1, k+1, V]
    draft_probs = draft.dense_probs(target_probs.shape[-1])  # [1, k, V]
    return rejection_sample(draft.token_ids, draft_probs, target_probs, generator=generator)


def speculative_generate(
    target: PreTrainedModel,
    drafter: Drafter,
    prompt_ids: torch.Tensor,  # [1, T] int64
    sampling: SamplingConfig,
    speculative: SpeculativeConfig,
    eos_token_ids: frozenset[int],
    generator: torch.Generator | None = None,  # default: seeded from sampling.seed
) -> Iterator[Round]:
    """Yield rounds until max_new_tokens are emitted or an EOS is; the tokens follow the target's distribution."""
    assert prompt_ids.ndim == 2 and prompt_ids.shape[0] == 1 and prompt_ids.shape[1] > 0, (
        f"prompt_ids must be [1, T] with T > 0, got {tuple(prompt_ids.shape)}"
    )
    if generator is None:
        generator = torch.Generator(device=prompt_ids.device).manual_seed(sampling.seed)
    verifier = KVCachedModel(target)
    warpers = build_warpers(sampling)
    sequence_ids = prompt_ids.to(verifier.device)  # [1, T] grows by each round's emitted tokens
    num_generated, index = 0, 0
    while num_generated < speculative.max_new_tokens:
        started = time.perf_counter()
        # Never propose more than can be emitted: K accepted + 1 next token <= tokens still allowed.
        num_draft = min(speculative.num_draft_tokens, speculative.max_new_tokens - num_generated - 1)
        draft = _draft_until_eos(drafter.propose(sequence_ids, num_draft, generator), eos_token_ids)  # [1, k]
        drafted = time.perf_counter()
        candidate_ids = torch.cat([sequence_ids, draft.token_ids], dim=1)  # [1, T+k]
        target_logits = verifier.logits(candidate_ids, num_logits=draft.token_ids.shape[1] + 1)  # [1, k+1, V]
        verified = time.perf_counter()

        result = verify(draft, target_logits, candidate_ids, sampling, warpers, generator)
        drafts, accepted = draft.token_ids[0].tolist(), int(result.num_accepted[0])
        emitted = _emitted(drafts, accepted, int(result.next_token_ids[0]), eos_token_ids)
        has_next = len(emitted) > accepted  # False after an accepted EOS: no bonus token follows it
        sequence_ids = torch.cat([sequence_ids, torch.tensor([emitted], device=sequence_ids.device)], dim=1)
        num_generated += len(emitted)
        yield Round(
            index=index,
            draft_token_ids=drafts,
            target_probs=result.target_draft_probs[0].tolist(),
            draft_probs=result.draft_draft_probs[0].tolist(),
            acceptance_probs=result.acceptance_probs[0].tolist(),
            uniforms=result.uniforms[0].tolist(),
            num_accepted=accepted,
            next_token_id=emitted[-1] if has_next else None,
            next_kind=("bonus" if accepted == len(drafts) else "resampled") if has_next else None,
            next_token_prob=float(result.next_token_probs[0]) if has_next else None,
            num_input_tokens=verifier.last_input_length,
            draft_seconds=drafted - started,
            verify_seconds=verified - drafted,
            other_seconds=time.perf_counter() - verified,
            forward_seconds=draft.forward_seconds + verifier.last_forward_seconds,
        )
        index += 1
        if emitted[-1] in eos_token_ids:
            return


def autoregressive_generate(
    target: PreTrainedModel,
    prompt_ids: torch.Tensor,  # [1, T] int64
    sampling: SamplingConfig,
    max_new_tokens: int,
    eos_token_ids: frozenset[int],
    generator: torch.Generator | None = None,
) -> Iterator[Round]:
    """Target-only decoding, the baseline: the same loop with nothing drafted, one token per round."""
    speculative = SpeculativeConfig(max_new_tokens=max_new_tokens)
    yield from speculative_generate(target, NoDrafter(), prompt_ids, sampling, speculative, eos_token_ids, generator)
