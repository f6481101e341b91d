"""The decoding loops: speculative rounds (draft, verify, accept) and target-only decoding, yielding one Round each."""

# B = batch (1 here), T = sequence length, K = num_draft_tokens, V = vocab_size

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
from transformers import PreTrainedModel

from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.drafters import Draft, Drafter, NoDrafter
from specdemo.models import KVCachedModel
from specdemo.rejection import rejection_sample
from specdemo.sampling import build_warpers, logits_to_probs

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
    return Draft(token_ids=draft.token_ids[:, :keep], probs=draft.probs[:, :keep])


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
    assert prompt_ids.ndim == 2 and prompt_ids.shape == (1, prompt_ids.shape[1]) and prompt_ids.shape[1] > 0, (
        f"prompt_ids must be [1, T] with T > 0, got {tuple(prompt_ids.shape)}"
    )
    if generator is None:
        generator = torch.Generator(device=prompt_ids.device).manual_seed(sampling.seed)
    verifier = KVCachedModel(target)
    warpers = build_warpers(sampling)
    sequence_ids = prompt_ids.to(verifier.device)  # [1, T] grows by each round's emitted tokens
    num_generated, index = 0, 0
    draft_forwards = getattr(drafter, "cached", None)  # a model drafter's forward time counts as forward time
    while num_generated < speculative.max_new_tokens:
        started = time.perf_counter()
        draft_forward_before = draft_forwards.forward_seconds if draft_forwards else 0.0
        # Never propose more than can be emitted: K accepted + 1 next token <= tokens still allowed.
        num_draft = min(speculative.num_draft_tokens, speculative.max_new_tokens - num_generated - 1)
        draft = drafter.propose(sequence_ids, num_draft, generator)  # token_ids [1, k], probs [1, k, V]
        draft = _draft_until_eos(draft, eos_token_ids)
        drafted = time.perf_counter()

        candidate_ids = torch.cat([sequence_ids, draft.token_ids], dim=1)  # [1, T+k]
        target_logits = verifier.logits(candidate_ids, num_logits=draft.token_ids.shape[1] + 1)  # [1, k+1, V]
        verified = time.perf_counter()

        target_probs = logits_to_probs(target_logits[..., : draft.probs.shape[-1]], candidate_ids, sampling, warpers)
        result = rejection_sample(draft.token_ids, draft.probs, target_probs, generator=generator)
        drafts = draft.token_ids[0].tolist()
        accepted = int(result.num_accepted[0])
        emitted = [*drafts[:accepted], int(result.next_token_ids[0])]
        emitted = emitted[: _eos_cut(emitted, eos_token_ids)]
        ended_in_draft = len(emitted) <= accepted  # an accepted EOS (the last draft): no bonus token after it
        next_token = None if ended_in_draft else emitted[-1]
        sequence_ids = torch.cat([sequence_ids, torch.tensor([emitted], device=sequence_ids.device)], dim=1)
        num_generated += len(emitted)
        round_ = Round(
            index=index,
            draft_token_ids=drafts,
            target_probs=result.target_draft_probs[0].tolist(),
            draft_probs=result.draft_draft_probs[0].tolist(),
            acceptance_probs=result.acceptance_probs[0].tolist(),
            uniforms=result.uniforms[0].tolist(),
            num_accepted=accepted,
            next_token_id=next_token,
            next_kind=None if ended_in_draft else ("bonus" if accepted == len(drafts) else "resampled"),
            next_token_prob=None if ended_in_draft else float(target_probs[0, accepted, next_token]),
            num_input_tokens=verifier.last_input_length,
            draft_seconds=drafted - started,
            verify_seconds=verified - drafted,
            other_seconds=time.perf_counter() - verified,
            forward_seconds=verified
            - drafted
            + (draft_forwards.forward_seconds - draft_forward_before if draft_forwards else 0.0),
        )
        yield round_
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
    vocab_size = target.get_output_embeddings().weight.shape[0]
    speculative = SpeculativeConfig(max_new_tokens=max_new_tokens)
    yield from speculative_generate(
        target, NoDrafter(vocab_size), prompt_ids, sampling, speculative, eos_token_ids, generator
    )
