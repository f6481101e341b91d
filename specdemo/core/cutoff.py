"""Pure: where one token stands against the user's top-k and top-p cut-offs in one vector of the target's scores, and
which cut-off it falls on different sides of in two such vectors (two pass shapes that rounded the logits apart)."""

# V = vocab_size

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdemo.config import SamplingConfig
from specdemo.core.sampling import build_warpers


@dataclass(frozen=True)
class CutoffPlace:
    """One token in one vector of scores, against the cut-offs the run's sampling sets."""

    logit: float  # its score after the repetition penalty, before the temperature: the number the format rounds
    rank: int  # 1 + the tokens scoring strictly higher, so tokens tied at one value share the best rank
    kept: bool  # p > 0: decoding's own warpers (temperature, top-k, top-p) left it a finite score
    kth_logit: float | None = None  # top-k's edge, the k-th highest logit; None without top-k
    inside_top_k: bool | None = None  # at or above that edge: transformers' TopKLogitsWarper keeps every score >=
    # the k-th, ties included, so k = 50 may keep 51 tokens; None without top-k
    mass_above: float | None = None  # the probability (after temperature and top-k) of the tokens scoring higher:
    # top-p keeps the token while this is below p (of tokens tied with it, its sort's order keeps the first ones);
    # None without top-p


def cutoff_place(
    logits: torch.Tensor,  # [V] after the repetition penalty (penalised_scores), before the temperature
    token_id: int,
    sampling: SamplingConfig,  # a sampled run's: temperature > 0
) -> CutoffPlace:
    """Where `token_id` stands in `logits` against `sampling`'s top-k and top-p, and whether decoding keeps it."""
    assert not sampling.is_greedy, "greedy decoding takes the argmax: no cut-off applies"
    scores = logits.float()  # [V] as decoding's penalised_scores give them
    empty_context = torch.zeros((1, 0), dtype=torch.long, device=scores.device)  # the warpers ignore the context
    warped = build_warpers(sampling)(empty_context, scores[None])[0]  # [V] -inf where cut
    scaled = scores / sampling.temperature  # [V] what top-k and top-p compare, as TemperatureLogitsWarper divides
    token_score = scaled[token_id]  # []
    kth_logit: float | None = None
    inside_top_k: bool | None = None
    mass_above: float | None = None
    survivors = scaled  # [V] what top-p sees: the tokens top-k kept
    if sampling.top_k > 0:
        k = min(sampling.top_k, scores.shape[-1])
        kth = scaled.topk(k).values[-1]  # [] the warper's edge
        survivors = scaled.masked_fill(scaled < kth, float("-inf"))
        kth_logit, inside_top_k = float(scores.topk(k).values[-1]), bool(token_score >= kth)
    if sampling.top_p < 1.0:
        mass_above = float(survivors.softmax(dim=-1)[survivors > token_score].sum())
    return CutoffPlace(
        logit=float(scores[token_id]),
        rank=int((scores > scores[token_id]).sum()) + 1,
        kept=bool(torch.isfinite(warped[token_id])),
        kth_logit=kth_logit,
        inside_top_k=inside_top_k,
        mass_above=mass_above,
    )


def crossed_cutoff(one: CutoffPlace, other: CutoffPlace, sampling: SamplingConfig) -> tuple[str, float] | None:
    """The cut-off a token falls on different sides of in two vectors of scores, with its setting: ("top-k", k) or
    ("top-p", p); None where both keep it or both cut it."""
    if one.kept == other.kept:
        return None
    if one.inside_top_k != other.inside_top_k:  # top-k cuts first: it decides what top-p then sees
        return "top-k", sampling.top_k
    return "top-p", sampling.top_p


def cutoff_names(sampling: SamplingConfig) -> str:
    """The cut-offs a sampled run sets, as the page names them ("top-k 50 and top-p 0.9"); "" for none."""
    if sampling.is_greedy:
        return ""
    names = [f"top-k {sampling.top_k}"] * (sampling.top_k > 0) + [f"top-p {sampling.top_p:g}"] * (sampling.top_p < 1)
    return " and ".join(names)
