"""Test oracles: the papers' per-token loops, one row and one position at a time, that the vectorised code must equal
on the same draws."""

# B = batch, K = num_draft_tokens, V = vocab_size

from __future__ import annotations

import torch

from specdemo.core.sampling import sample_from_probs


def reference_rejection_sample(
    draft_token_ids: torch.Tensor,  # [B, K]
    draft_probs: torch.Tensor,  # [B, K, V]
    target_probs: torch.Tensor,  # [B, K+1, V]
    generators: list[torch.Generator],  # one per row
) -> tuple[list[list[int]], list[int]]:  # emitted tokens per row, accepted count per row
    """Leviathan et al. (2023), Algorithm 1, as a loop: accept d_i while u_i * q(d_i) < p(d_i); at the first rejection
    draw from norm(max(0, p - q)) (p itself when that is empty); after K acceptances draw the bonus from p_K."""
    emitted, counts = [], []
    for b, generator in enumerate(generators):
        uniforms = torch.rand(draft_token_ids.shape[1] + 1, dtype=torch.float64, generator=generator)
        row: list[int] = []
        for i, token in enumerate(draft_token_ids[b].tolist()):
            p, q = float(target_probs[b, i, token]), float(draft_probs[b, i, token])
            if float(uniforms[i]) * q < p:
                row.append(token)
                continue
            residual = (target_probs[b, i] - draft_probs[b, i]).clamp(min=0.0)
            residual = residual if float(residual.sum()) > 0 else target_probs[b, i]
            row.append(int(sample_from_probs(residual[None], uniforms[-1:])[0]))
            break
        else:
            row.append(int(sample_from_probs(target_probs[b, -1:], uniforms[-1:])[0]))
        counts.append(len(row) - 1)
        emitted.append(row)
    return emitted, counts
