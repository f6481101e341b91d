"""Pure: the same-text check of a run that must write the target alone's text (greedy, or sampled under the coupled
rule): identical, or where the texts part and why, told from both runs' passes (app/serving/divergence.py finds it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specdemo.core.cutoff import CutoffPlace

NEAR_TIE_LOGIT_GAPS = {  # top-2 logit gaps that rounding can flip between pass shapes, by number format
    "float32": 1e-2,  # float32 differences between pass shapes stay under 1e-3 in the tests (tests/conftest.py)
    "bfloat16": 0.5,  # bfloat16 keeps 8 significant bits: logits between 16 and 32 move in steps of 0.125
    "float16": 0.0625,  # float16 keeps 11 significant bits: logits between 16 and 32 move in steps of 1/64
}


@dataclass(frozen=True)
class CutoffCrossing:
    """A differing token that one run's pass keeps and the other's cuts (p = 0) at the run's top-k or top-p: the two
    runs' passes rounded its logit, or the logits around it, to either side of the cut-off."""

    token_text: str
    cutoff: str  # "top-k" or "top-p": the cut-off it falls on different sides of
    limit: float  # that cut-off's setting: k, or p
    one_token: CutoffPlace  # in the target alone's pass that emitted the token: one token after its cached prefix
    wide: CutoffPlace  # in the pass of the speculative round that emitted it: the round's drafts at once
    one_token_width: int  # tokens the target alone's pass read (1; the prompt's length at the first generated token)
    wide_width: int  # tokens the round's pass read (K+1; more with several candidates, or with the prompt)

    @property
    def name(self) -> str:
        return f"{self.cutoff} {self.limit:g}"


@dataclass(frozen=True)
class Divergence:
    """Where speculative and target-only tokens first differ (a greedy run, or a sampled run under the coupled rule),
    how close the target's top two were there, and whether either token crosses a top-k or top-p cut-off between
    the two runs' passes."""

    position: int  # the first differing generated token, counted from 1
    speculative_text: str  # the token the speculative run emitted there
    target_text: str  # the token the target alone emitted there
    top2_logit_gap: float  # the target's best score minus its second best, as the target alone computed them: its
    # logits for a greedy run, log p + G (the coupled rule's noise G) for a coupled one
    top2_probs: tuple[float, float]  # the same two as probabilities (p)
    dtype: str  # the number format the target ran in
    temperature: float = 0.0  # 0: greedy; else the coupled run's, which divides the logits' rounding in log p
    cutoffs: str = ""  # the cut-offs checked ("top-k 50 and top-p 0.9"); "" for a greedy run, or a run without any
    crossings: tuple[CutoffCrossing, ...] = ()  # the differing tokens that one run's pass keeps and the other's cuts
    leads: tuple[float, float, int, int] | None = None  # from both runs' passes replayed: how far the target alone's
    # token led the speculative run's in the alone's pass, how far the speculative one led in its own pass (the
    # scores the run took the argmax of), and the two passes' widths; None where the passes were not replayed


def first_difference(speculative_ids: Sequence[int], target_ids: Sequence[int]) -> int | None:
    """The index of the first token where two runs differ; None where they agree as far as both go."""
    return next((i for i, (a, b) in enumerate(zip(speculative_ids, target_ids, strict=False)) if a != b), None)


def greedy_check(identical: bool, divergence: Divergence | None, coupled_seed: int | None = None) -> str:
    """The identity check of a greedy run, or of a sampled run under the coupled rule (`coupled_seed`: its seed):
    identical, or where the texts part and how near the target's top two were."""
    check = "Greedy check" if coupled_seed is None else f"Same-text check (coupled rule, seed {coupled_seed})"
    if identical:
        return f"{check}: the two texts are **identical**, token for token."
    flips = "an argmax" if coupled_seed is None else "the largest log p + G"
    if divergence is None:
        return f"{check}: the two texts **differ** (near-ties in the target's scores can flip {flips})."
    d = divergence
    scores = "logits" if coupled_seed is None else "scores log p + G"
    where = (
        f"{check}: the two texts **differ** from generated token {d.position} on ({d.speculative_text!r} "
        f"speculative, {d.target_text!r} target alone), where the target's top two {scores} are "
        f"{d.top2_logit_gap:.3g} apart ({d.top2_probs[0]:.1%} against {d.top2_probs[1]:.1%})"
    )
    if d.crossings:  # a cut-off explains it whatever the gap: p = 0 on one side, so log p + G = -inf there
        edges = "; and at ".join(f"a {c.cutoff} edge: {crossing_clauses(c)}" for c in d.crossings)
        return (
            f"{where}: the texts differ at {edges}. In {d.dtype} the two runs' passes (one token at a time; a round's "
            "drafts at once) round differently, and a token at the cut-off can fall on either side "
            "(docs/how-it-works.md)."
        )
    if d.leads is not None and d.leads[0] > 0 and d.leads[1] > 0:  # each pass chose its own run's token: seen
        alone, wide, alone_width, wide_width = d.leads
        return (
            f"{check}: the two texts **differ** from generated token {d.position} on, at a near-tie that the two runs' "
            f"passes round to opposite orders: in the target alone's {_pass_name(alone_width)} pass "
            f"{d.target_text!r} leads {d.speculative_text!r} by {alone:.3g} in {scores}, and in the speculative "
            f"run's {_pass_name(wide_width)} pass {d.speculative_text!r} leads by {wide:.3g}. In {d.dtype} passes "
            "of other widths round a token's keys and values differently, so such a near-tie can go either way "
            "(docs/how-it-works.md)."
        )
    rounding = NEAR_TIE_LOGIT_GAPS.get(d.dtype, 0.0) / (d.temperature or 1.0)  # log p moves as logits / temperature
    if d.top2_logit_gap <= rounding:
        return (
            f"{where}: in {d.dtype}, a K+1-token verification pass and one-token steps round differently, and at "
            f"such a near-tie that can flip {flips}."
        )
    checked = f", and neither token crosses {d.cutoffs} between the two runs' passes" if d.cutoffs else ""
    return f"{where}: too wide a gap for rounding to flip{checked}, so this is worth reporting, with the trace."


def crossing_clauses(c: CutoffCrossing) -> str:
    """Where the token stands in each run's pass: "in the target alone's one-token pass ' word' has logit 15.94, rank
    50 (the 50th logit is 15.94), so top-k 50 keeps it; in the speculative run's 17-token pass ..."."""
    one, wide = c.one_token, c.wide
    if c.cutoff == "top-k":
        shown = [one.logit, wide.logit, *(x for x in (one.kth_logit, wide.kth_logit) if x is not None)]
        decimals, nth = _decimals_apart(shown, least=2), _ordinal(int(c.limit))

        def place(p: CutoffPlace) -> str:
            return f"logit {p.logit:.{decimals}f}, rank {p.rank} (the {nth} logit is {p.kth_logit:.{decimals}f})"

        def verdict(p: CutoffPlace) -> str:
            return f"so {c.name} keeps it" if p.inside_top_k else f"so {c.name} cuts it: p = 0 there"
    else:
        masses = [100 * m for m in (one.mass_above, wide.mass_above) if m is not None]
        decimals = _decimals_apart([*masses, 100 * c.limit], least=1)

        def place(p: CutoffPlace) -> str:
            return f"rank {p.rank} with {100 * (p.mass_above or 0.0):.{decimals}f}% of p above it"

        def verdict(p: CutoffPlace) -> str:
            return f"so {c.name} keeps it" if p.kept else f"so {c.name} cuts it: p = 0 there"

    return (
        f"in the target alone's {_pass_name(c.one_token_width)} pass {c.token_text!r} has {place(one)}, "
        f"{verdict(one)}; in the speculative run's {_pass_name(c.wide_width)} pass it has {place(wide)}, "
        f"{verdict(wide)}"
    )


def _pass_name(width: int) -> str:
    return "one-token" if width == 1 else f"{width}-token"


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _decimals_apart(values: Sequence[float], least: int) -> int:
    """The fewest decimals, from `least` up to 6, that print different values differently (the two passes' logits
    may part by one bfloat16 step, or far less in float32)."""
    distinct = set(values)
    return next(
        (d for d in range(least, 7) if len({f"{v:.{d}f}" for v in distinct}) == len(distinct)),
        6,
    )
