"""Pure: batched modified rejection sampling (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023)."""

# B = batch, K = num_draft_tokens, V = vocab_size

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdemo.core.sampling import Generators, draw_uniforms, sample_from_probs

PADDING_ID = -1  # fills token_ids after the one resampled or bonus token


@dataclass(frozen=True)
class RejectionResult:
    """What one verification decided for each row, with the numbers behind every decision."""

    token_ids: torch.Tensor  # [B, K+1] accepted drafts, one resampled or bonus token, then PADDING_ID
    num_accepted: torch.Tensor  # [B] accepted draft tokens; the next token is bonus when == K
    target_draft_probs: torch.Tensor  # [B, K] p(d_i), the target probability of each draft token
    draft_draft_probs: torch.Tensor  # [B, K] q(d_i), the probability the draft token was sampled with
    acceptance_probs: torch.Tensor  # [B, K] float64 min(1, p(d_i) / q(d_i))
    uniforms: torch.Tensor  # [B, K] float64 the draws u_i; d_i is accepted when u_i * q < p
    next_token_ids: torch.Tensor  # [B] the resampled (num_accepted < K) or bonus token
    next_token_probs: torch.Tensor  # [B] float32 the target probability of next_token_ids at its position


def first_rejection_index(accepted: torch.Tensor) -> torch.Tensor:  # [B, K] bool -> [B] int64
    """Number of leading True values per row: how many drafts survive until the first rejection."""
    return accepted.long().cumprod(dim=1).sum(dim=1)


def select_positions(
    probs: torch.Tensor,  # [B, N, V]
    positions: torch.Tensor,  # [B] int64 in [0, N)
) -> torch.Tensor:  # [B, V] probs[b, positions[b]]
    """One position per row, through a flat index_select (several times faster than advanced indexing)."""
    batch_size, num_positions, vocab_size = probs.shape
    if num_positions == 0:
        return probs.new_zeros(batch_size, vocab_size)
    rows = torch.arange(batch_size, device=probs.device)  # [B]
    return probs.reshape(batch_size * num_positions, vocab_size).index_select(0, rows * num_positions + positions)


def residual_probs(
    target_probs: torch.Tensor,  # [B, V] p at the first rejected position
    draft_probs: torch.Tensor,  # [B, V] q at that position
) -> torch.Tensor:  # [B, V] unnormalised max(0, p - q), or p where that is all zero
    """Algorithm 1, line 12: resample from norm(max(0, p - q)); p itself when p == q numerically."""
    residual = (target_probs - draft_probs).clamp_(min=0.0)
    empty = residual.sum(dim=-1) <= 0  # [B]
    if bool(empty.any()):
        residual[empty] = target_probs[empty]
    return residual


def rejection_sample(
    draft_token_ids: torch.Tensor,  # [B, K] int64 proposed tokens
    draft_probs: torch.Tensor,  # [B, K, V] the distributions the draft tokens were sampled from
    target_probs: torch.Tensor,  # [B, K+1, V] target distributions, position i on prefix + d_1..d_i
    *,
    generator: Generators = None,  # one for the batch, or one per row (rows then never interact)
) -> RejectionResult:
    """Accept each draft token with probability min(1, p/q), then emit one resampled or bonus token.

    Row b draws K+1 uniforms from its generator: K acceptance tests, then one for the next token.
    """
    batch_size, num_draft, vocab_size = draft_probs.shape
    assert target_probs.shape == (batch_size, num_draft + 1, vocab_size), (
        f"target_probs {tuple(target_probs.shape)} does not fit draft_probs {tuple(draft_probs.shape)}"
    )
    uniforms = draw_uniforms(generator, batch_size, num_draft + 1, draft_probs.device)  # [B, K+1]

    index = draft_token_ids.unsqueeze(-1)  # [B, K, 1]
    target_draft = target_probs[:, :num_draft].gather(-1, index).squeeze(-1).double()  # [B, K]
    draft_draft = draft_probs.gather(-1, index).squeeze(-1).double()  # [B, K]
    # u * q < p instead of u < p / q: no division, and p == 0 is never accepted, even with u == 0.
    accepted = uniforms[:, :num_draft] * draft_draft < target_draft  # [B, K]
    num_accepted = first_rejection_index(accepted)  # [B]

    # Rows that rejected resample at the first rejection; rows that accepted all K take the bonus from p_K.
    next_target = select_positions(target_probs, num_accepted)  # [B, V]
    rejected = (num_accepted < num_draft).unsqueeze(-1)  # [B, 1] q is 0 at the bonus position
    next_draft = select_positions(draft_probs, num_accepted.clamp(max=max(num_draft - 1, 0))) * rejected
    next_probs = residual_probs(next_target, next_draft)  # [B, V]
    next_token_ids = sample_from_probs(next_probs, uniforms[:, num_draft])  # [B]

    acceptance = torch.where(draft_draft > 0, (target_draft / draft_draft).clamp(max=1.0), 1.0)
    return RejectionResult(
        token_ids=emitted_token_ids(draft_token_ids, num_accepted, next_token_ids),
        num_accepted=num_accepted,
        target_draft_probs=target_draft,
        draft_draft_probs=draft_draft,
        acceptance_probs=acceptance,
        uniforms=uniforms[:, :num_draft],
        next_token_ids=next_token_ids,
        next_token_probs=next_target.gather(1, next_token_ids[:, None]).squeeze(1),
    )


def emitted_token_ids(
    draft_token_ids: torch.Tensor,  # [B, K]
    num_accepted: torch.Tensor,  # [B]
    next_token_ids: torch.Tensor,  # [B]
) -> torch.Tensor:  # [B, K+1] accepted drafts, the next token, then PADDING_ID
    positions = torch.arange(draft_token_ids.shape[1] + 1, device=draft_token_ids.device)  # [K+1]
    padded_ids = torch.nn.functional.pad(draft_token_ids, (0, 1), value=PADDING_ID)  # [B, K+1]
    token_ids = torch.where(positions < num_accepted[:, None], padded_ids, PADDING_ID)
    rows = torch.arange(draft_token_ids.shape[0], device=draft_token_ids.device)
    token_ids[rows, num_accepted] = next_token_ids
    return token_ids


def reference_rejection_sample(
    draft_token_ids: torch.Tensor,  # [B, K]
    draft_probs: torch.Tensor,  # [B, K, V]
    target_probs: torch.Tensor,  # [B, K+1, V]
    generators: list[torch.Generator],  # one per row
) -> tuple[list[list[int]], list[int]]:  # emitted tokens per row, accepted count per row
    """The per-token loop of the papers, one row and one position at a time: the yardstick for
    rejection_sample in tests (same draws, same answer) and in the micro-benchmark."""
    emitted, counts = [], []
    for b, generator in enumerate(generators):
        uniforms = torch.rand(draft_token_ids.shape[1] + 1, dtype=torch.float64, generator=generator)
        row: list[int] = []
        for i, token in enumerate(draft_token_ids[b].tolist()):
            p, q = float(target_probs[b, i, token]), float(draft_probs[b, i, token])
            if float(uniforms[i]) * q < p:
                row.append(token)
                continue
            residual = residual_probs(target_probs[b, i : i + 1], draft_probs[b, i : i + 1])
            row.append(int(sample_from_probs(residual, uniforms[-1:])[0]))
            break
        else:
            row.append(int(sample_from_probs(target_probs[b, -1:], uniforms[-1:])[0]))
        counts.append(len(row) - 1)
        emitted.append(row)
    return emitted, counts
