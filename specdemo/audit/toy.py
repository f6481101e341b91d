"""Toy mode, pure: N rounds of K drafts from a draft q, verified against a target p by the rule (or a planted bug);
the tokens emitted at each position must follow p. Under the coupled rule, N texts of K + 2 tokens, one seed each,
drafted and verified round by round with the noise (or a planted noise bug): each position and the first two tokens
together must follow p, and each text must be the target alone's text for its seed."""

# N = samples, K = num_draft_tokens, W = num_candidates, V = vocab_size, T = text length under the coupled rule (K+2)

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specdemo.audit.bugs import COUPLED_BUGS, batch_noise, verifier
from specdemo.audit.statistics import (
    NOISE_QUANTILE,
    PositionFit,
    fit,
    invariance_sentence,
    noise_tv,
    tv_distance,
    verdict_sentence,
)
from specdemo.core.coupled import coupled_choice, coupled_top, gumbel_noise, mix64, verify_coupled
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
    counts: list[list[int]]  # [K+1][V] by position in the round; coupled rule: [T][V] by position in the text
    fits: list[PositionFit]
    tv_curve: list[tuple[int, float, float]]  # (N so far, TV at the first position, its noise band top)
    verdict: str
    passes: bool
    pair: PositionFit | None = None  # coupled rule: the first two tokens together against p × p
    differing: int | None = None  # coupled rule: seeds whose text is not the target alone's for that seed


def toy_audit(
    target: torch.Tensor,  # [V] p
    draft: torch.Tensor,  # [V] q
    num_draft_tokens: int,
    num_samples: int,
    num_candidates: int = 1,
    bug: str = "none",
    seed: int = 0,
    rule: str = "standard",  # SamplingConfig.rule: "coupled" runs coupled_toy_audit
) -> ToyAudit:
    """N rounds of K drafts (W i.i.d. candidates each) from q, verified against p; the tokens emitted at each
    position must follow p. The engine's rule decides (verify_rows), with the bug planted around it."""
    assert target.shape == draft.shape and target.ndim == 1, "p and q are [V] alike"
    if rule == "coupled":
        return coupled_toy_audit(target, draft, num_draft_tokens, num_samples, num_candidates, bug, seed)
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


def coupled_toy_audit(
    target: torch.Tensor,  # [V] p
    draft: torch.Tensor,  # [V] q
    num_draft_tokens: int,
    num_samples: int,
    num_candidates: int = 1,
    bug: str = "none",  # one of COUPLED_BUGS, planted in the noise
    seed: int = 0,
) -> ToyAudit:
    """N texts of K + 2 tokens (a round's worth and the next round's first), one seed each: drafted from q with the
    rule's noise and verified against p by verify_coupled with the noise `bug` names, round by round, as the engine
    does. Each position, and the first two tokens together, must follow p; each text must be the target alone's."""
    if bug not in COUPLED_BUGS:
        raise ValueError(f"Unknown bug {bug!r} for the coupled rule: pick one of {', '.join(map(repr, COUPLED_BUGS))}.")
    p, q, vocab_size, length = target.double(), draft.double(), len(target), num_draft_tokens + 2
    first_seed = mix64(torch.tensor([seed], dtype=torch.int64, device=target.device))  # [1] far from seed + 1's rows
    counts = torch.zeros(length, vocab_size, dtype=torch.long, device=target.device)  # [T, V]
    pairs = torch.zeros(vocab_size * vocab_size, dtype=torch.long, device=target.device)  # [V * V]
    curve, done, differing = [], 0, 0
    for size in _chunks(num_samples):
        seeds = first_seed + torch.arange(done, done + size, device=target.device)  # [n]
        texts = _coupled_texts(p, q, num_draft_tokens, num_candidates, bug, seeds, length)  # [n, T]
        differing += int((texts != _target_alone_texts(p, bug, seeds, length)).any(dim=1).sum())
        for position in range(length):
            counts[position] += torch.bincount(texts[:, position], minlength=vocab_size)
        pairs += torch.bincount(texts[:, 0] * vocab_size + texts[:, 1], minlength=vocab_size * vocab_size)
        done += size
        curve.append((done, tv_distance(counts[0], p), noise_tv(p, done, NOISE_QUANTILE)))
    fits = [fit(position, counts[position], p) for position in range(length)]
    pair = fit(0, pairs, torch.outer(p, p).flatten(), "positions 1 and 2 together")
    verdict = verdict_sentence([*fits, pair], "the emitted tokens")
    return ToyAudit(
        target=target.tolist(),
        draft=draft.tolist(),
        counts=counts.tolist(),
        fits=fits,
        tv_curve=curve,
        verdict=f"{verdict} {invariance_sentence(differing, num_samples)}",
        passes=all(f.passes for f in [*fits, pair]) and differing == 0,
        pair=pair,
        differing=differing,
    )


def _coupled_texts(
    target: torch.Tensor,  # [V] p
    draft: torch.Tensor,  # [V] q
    num_draft_tokens: int,
    num_candidates: int,
    bug: str,
    seeds: torch.Tensor,  # [N] int64
    length: int,  # T
) -> torch.Tensor:  # [N, T] the speculative texts
    """Rounds until every text has T tokens: the drafter draws with the rule's noise (as every drafter does: W distinct
    first tokens by Gumbel-top-k, then each beam's argmax), the rule decides with the noise `bug` names."""
    k, vocab_size, device = num_draft_tokens, len(target), seeds.device
    width = min(num_candidates, vocab_size)  # W distinct first tokens at most
    texts = torch.full((len(seeds), length), -1, dtype=torch.int64, device=device)
    lengths = torch.zeros(len(seeds), dtype=torch.int64, device=device)  # [N] each NoiseAsk.start
    rounds = torch.zeros_like(lengths)  # [N] each NoiseAsk.round_index
    while (active := (lengths < length).nonzero().squeeze(1)).numel():
        starts = lengths[active]  # [n]
        drafter_noise = gumbel_noise(seeds[active], starts[:, None] + torch.arange(k, device=device), vocab_size)
        firsts, live = coupled_top(draft, drafter_noise[:, 0], width)  # [n, W] each: q may allow fewer than W
        rest = coupled_choice(draft, drafter_noise[:, 1:])  # [n, K-1]
        ids = torch.cat([firsts[..., None], rest[:, None].expand(-1, width, -1)], dim=2)  # [n, W, K]
        noise = batch_noise(bug, seeds[active], starts, k + 1, rounds[active], ids[:, 0], vocab_size)  # [n, K+1, V]
        n = len(active)
        verdict = verify_coupled(
            ids,
            torch.where(live, k, 0),  # a first token with q = 0 is not drafted
            draft.expand(n, width, k, -1),
            target.expand(n, width, k + 1, -1),
            noise,
        )
        emitted = emitted_by_position(verdict, ids)  # [n, K+1]
        places = starts[:, None] + torch.arange(k + 1, device=device)  # [n, K+1] in the text
        kept = (emitted >= 0) & (places < length)
        texts[active[:, None].expand_as(places)[kept], places[kept]] = emitted[kept]
        lengths[active] += verdict.num_accepted + 1
        rounds[active] += 1
    return texts


def _target_alone_texts(
    target: torch.Tensor,  # [V] p
    bug: str,
    seeds: torch.Tensor,  # [N] int64
    length: int,  # T
) -> torch.Tensor:  # [N, T]
    """Target-only decoding under the same noise: one token a round, as the engine asks for it (start t, round t, no
    draft)."""
    alone = torch.empty(len(seeds), length, dtype=torch.int64, device=seeds.device)
    no_draft = torch.empty(len(seeds), 0, dtype=torch.int64, device=seeds.device)  # [N, 0]
    for position in range(length):
        at = torch.full_like(seeds, position)  # [N]
        noise = batch_noise(bug, seeds, at, 1, at, no_draft, len(target))  # [N, 1, V]
        alone[:, position] = coupled_choice(target, noise[:, 0])
    return alone


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
