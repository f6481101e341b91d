"""Pure: a race's figures. Lanes decode one prompt as rows of one batch, so they share the target's passes and the
batch's clock counts passes; each lane's own time is estimated as it would run alone: its passes, each priced at this
device's measured cost for the tokens it read (the first, which reads the prompt, at its own measured cost), plus its
own drafting seconds."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specdemo.core.planning import PassCosts
from specdemo.core.rounds import Round
from specdemo.core.stats import emitted_ids

TARGET_LANE = "target"  # the target alone, one token a pass: the lane every speedup is against


@dataclass(frozen=True)
class RaceCosts:
    """What a lane's passes cost alone on this device, measured as the race starts."""

    passes: PassCosts  # t(n) for a pass reading n tokens after the prompt: the last token and the drafts
    prompt_tokens: int
    first_seconds: float  # the first pass of a row alone, which reads the prompt, measured with nothing drafted


@dataclass(frozen=True)
class LaneFigures:
    """One lane's outcome so far: what it wrote, in how many target passes, and what it would cost alone."""

    name: str  # "target", a drafter kind, or "draft" (the pair's draft model)
    token_ids: list[int]
    passes: int  # target passes (rounds) it took
    pass_seconds: float  # its passes priced at the measured cost of each pass's width
    drafting_seconds: float  # its drafter's own time, measured
    error: str | None = None  # the sentence that stopped it, if it failed

    @property
    def estimated_seconds(self) -> float:
        return self.pass_seconds + self.drafting_seconds

    @property
    def tokens_per_pass(self) -> float:
        return len(self.token_ids) / self.passes if self.passes else 0.0


def pass_seconds(rounds: Sequence[Round], costs: RaceCosts) -> float:
    """The rounds' passes as one row alone pays them: t(n) for the n tokens each pass read for the row; the first
    round's pass, which reads the prompt, at the measured first pass and what its drafts add, t(1 + drafts) - t(1)."""
    passes = costs.passes
    total = 0.0
    for round_ in rounds:
        if round_.index == 0:
            drafted = max(0, round_.num_input_tokens - costs.prompt_tokens)
            total += costs.first_seconds + passes.step_seconds * (passes.steps(1 + drafted) - 1)
        else:
            total += passes.step_seconds * passes.steps(round_.num_input_tokens)
    return total


def lane_figures(
    name: str, rounds: Sequence[Round], costs: RaceCosts, drafting_seconds: float, error: str | None = None
) -> LaneFigures:
    token_ids = emitted_ids(list(rounds))
    return LaneFigures(name, token_ids, len(rounds), pass_seconds(rounds, costs), drafting_seconds, error)


def speedup(lane: LaneFigures, target: LaneFigures) -> float | None:
    """The lane's estimated time against the target lane's for the same tokens (its tokens per estimated second over
    the target's); None before either has a token."""
    if not lane.token_ids or not target.token_ids or not lane.estimated_seconds or not target.estimated_seconds:
        return None
    return (len(lane.token_ids) / lane.estimated_seconds) / (len(target.token_ids) / target.estimated_seconds)


def lane_record(lane: LaneFigures, target: LaneFigures, text: str) -> dict:
    """One lane as JSON (the command line's --json, the app's /race): `text` is its tokens decoded."""
    return {
        "name": lane.name,
        "token_ids": lane.token_ids,
        "text": text,
        "passes": lane.passes,
        "tokens_per_pass": lane.tokens_per_pass,
        "estimated_seconds": lane.estimated_seconds,
        "drafting_seconds": lane.drafting_seconds,
        "speedup": speedup(lane, target),
        "error": lane.error,
    }


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where two texts' tokens differ (one ending early counts); None where they are equal."""
    for position, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return position
    return None if len(a) == len(b) else min(len(a), len(b))


def agreement(lanes: Sequence[LaneFigures], same_text_expected: bool) -> str:
    """One sentence on whether the finished lanes wrote the same text: under greedy decoding or the coupled rule they
    must (each lane is the target's own text for the seed), under the standard sampled rule they differ by design."""
    finished = [lane for lane in lanes if lane.error is None]
    if len(finished) < 2:
        return "Only one lane finished, so there is nothing to compare its text with."
    if not same_text_expected:
        return (
            "Under the standard sampled rule each lane is another draw from the target's distribution, so the texts "
            "differ by design; choose greedy or the rule 'same text for any drafter' to see them agree."
        )
    reference = finished[0]
    differing = [
        (lane.name, position)
        for lane in finished[1:]
        if (position := first_difference(reference.token_ids, lane.token_ids)) is not None
    ]
    if not differing:
        return (
            f"All {len(finished)} finished lanes wrote the same {len(reference.token_ids)} tokens, token for token: "
            "every drafter changed the speed, never the text."
        )
    where = "; ".join(f"'{name}' from token {position + 1}" for name, position in differing)
    return (
        f"Lanes differ from the '{reference.name}' lane: {where}. In bfloat16 a near-tie can round apart between pass "
        "shapes; in float32 this would be a bug worth reporting with these settings."
    )
