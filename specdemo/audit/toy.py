"""Toy mode, pure: N rounds of K drafts from a draft q, verified against a target p by the rule (or a planted bug);
the tokens emitted at each position must follow p."""

# N = samples, K = num_draft_tokens, W = num_candidates, V = vocab_size

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specdemo.audit.bugs import verifier
from specdemo.audit.statistics import NOISE_QUANTILE, PositionFit, fit, noise_tv, tv_distance, verdict_sentence
from specdemo.core.verify import CandidateVerdict

MAX_TOY_VOCAB = 32
CHUNK = 65_536  # rows verified at once in toy mode (~40 MB of probabilities at V = 32, K = 4)

TOY_PRESETS: dict[str, tuple[list[float], list[float]]] = {  # name -> (target p, draft q), unnormalised weights
    "overlapping": ([30, 20, 15, 10, 10, 8, 5, 2], [10, 30, 5, 20, 5, 10, 15, 5]),
    "disjoint supports": ([40, 30, 20, 10, 0, 0, 0, 0], [0, 0, 0, 0, 25, 25, 25, 25]),
    "one-hot draft": ([30, 20, 15, 10, 10, 8, 5, 2], [0, 1, 0, 0, 0, 0, 0, 0]),
    "identical": ([30, 20, 15, 10, 10, 8, 5, 2], [30, 20, 15, 10, 10, 8, 5, 2]),
    "32 tokens, peaked target": (
        [2.0**-i for i in range(MAX_TOY_VOCAB)],
        [1.0] * MAX_TOY_VOCAB,
    ),
}


def parse_weights(text: str, name: str) -> torch.Tensor:  # -> [V] float64, normalised
    """Comma- or space-separated non-negative weights, normalised; a sentence naming the problem otherwise."""
    parts = [part for part in text.replace(",", " ").split() if part]
    try:
        values = [float(part) for part in parts]
    except ValueError:
        raise ValueError(f"The {name} must be numbers separated by commas, got {text[:60]!r}.") from None
    if not 2 <= len(values) <= MAX_TOY_VOCAB:
        raise ValueError(f"The {name} has {len(values)} weights; give between 2 and {MAX_TOY_VOCAB}, one per token.")
    if any(not math.isfinite(v) or v < 0 for v in values):
        raise ValueError(f"The {name} has a negative or non-finite weight; weights must be 0 or more.")
    weights = torch.tensor(values, dtype=torch.float64, device="cpu")
    if float(weights.sum()) <= 0:
        raise ValueError(f"The {name} is all zeros; give at least one token a positive weight.")
    return weights / weights.sum()


@dataclass(frozen=True)
class ToyAudit:
    """Counts of the emitted tokens by position, how they fit p, and TV against N as N grew."""

    target: list[float]  # p
    draft: list[float]  # q, what the draft sampled from
    counts: list[list[int]]  # [K+1][V]
    fits: list[PositionFit]
    tv_curve: list[tuple[int, float, float]]  # (N so far, TV at the first position, its noise band top)
    verdict: str
    passes: bool


def toy_audit(
    target: torch.Tensor,  # [V] p
    draft: torch.Tensor,  # [V] q
    num_draft_tokens: int,
    num_samples: int,
    num_candidates: int = 1,
    bug: str = "none",
    seed: int = 0,
) -> ToyAudit:
    """N rounds of K drafts (W i.i.d. candidates each) from q, verified against p; the tokens emitted at each
    position must follow p. The engine's rule decides (verify_rows), with the bug planted around it."""
    assert target.shape == draft.shape and target.ndim == 1, "p and q are [V] alike"
    vocab_size, k, w = len(target), num_draft_tokens, num_candidates
    generator = torch.Generator(device=target.device).manual_seed(seed)
    p, q = target.float(), draft.float()
    verify = verifier(bug)
    counts = torch.zeros(k + 1, vocab_size, dtype=torch.long, device=target.device)
    curve, done = [], 0
    for size in _chunks(num_samples):
        ids = torch.multinomial(q, size * w * k, replacement=True, generator=generator).reshape(size, w, k)
        uniforms = torch.rand(
            size, k * w + 1, dtype=torch.float64, generator=generator, device=generator.device
        )  # [N, K*W + 1]
        lengths = torch.full((size, w), k, device=target.device)  # [N, W]
        verdict = verify(ids, lengths, q.expand(size, w, k, -1), p.expand(size, w, k + 1, -1), uniforms)
        emitted = emitted_by_position(verdict, ids)  # [N, K+1]
        for position in range(k + 1):
            column = emitted[:, position]
            counts[position] += torch.bincount(column[column >= 0], minlength=vocab_size)
        done += size
        curve.append((done, tv_distance(counts[0], p), noise_tv(p, done, NOISE_QUANTILE)))
    fits = [fit(position, counts[position], p) for position in range(k + 1)]
    return ToyAudit(
        target=target.tolist(),
        draft=draft.tolist(),
        counts=counts.tolist(),
        fits=fits,
        tv_curve=curve,
        verdict=verdict_sentence(fits, "the emitted tokens"),
        passes=all(f.passes for f in fits),
    )


def _chunks(total: int) -> list[int]:
    """Chunk sizes 1000, 1000, 2000, 4000, ... up to CHUNK, then CHUNK: TV is recorded after each, so the curve
    has points at every scale of N."""
    sizes: list[int] = []
    while (done := sum(sizes)) < total:
        sizes.append(min(max(done, 1_000), CHUNK, total - done))  # N so far doubles, up to CHUNK at a time
    return sizes


def emitted_by_position(
    verdict: CandidateVerdict,
    draft_ids: torch.Tensor,  # draft_ids [B, W, K]
) -> torch.Tensor:  # [B, K+1] the token emitted at each position, -1 past the row's last
    """Accepted drafts along the path, then the resampled or bonus token."""
    rows = torch.arange(draft_ids.shape[0], device=draft_ids.device)
    path_ids = draft_ids[rows, verdict.path]  # [B, K]
    positions = torch.arange(draft_ids.shape[2] + 1, device=draft_ids.device)
    padded = torch.nn.functional.pad(path_ids, (0, 1), value=-1)
    emitted = torch.where(positions < verdict.num_accepted[:, None], padded, -1)
    emitted[rows, verdict.num_accepted] = verdict.next_token_ids
    return emitted
