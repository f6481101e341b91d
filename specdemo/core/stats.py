"""Pure: rounds -> RunStats (α, per-position α, costs), and the speedup explained: measured parts, Leviathan et
al. (2023)'s prediction, and the best number of drafts per round."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from specdemo.core.rounds import Round


@dataclass(frozen=True)
class RunStats:
    """Totals of one run, all measured (engine time only: the consumer's time between rounds is excluded)."""

    num_rounds: int
    num_generated: int
    num_drafted: int
    num_accepted: int
    num_tested: int  # drafts that were reached: the accepted ones and each round's first rejection
    acceptance_rate: float  # accepted / drafted (vLLM's draft_acceptance_rate); counts drafts never tested
    alpha: float  # accepted / tested: Leviathan's α, the chance that a tested draft is accepted
    alpha_by_position: tuple[float, ...]  # α at draft position 1, 2, ...: accepted there / tested there
    tested_by_position: tuple[int, ...]  # how many drafts each position's α rests on
    no_proposal_share: float  # rounds whose drafter proposed nothing (a plain target step) / rounds
    mean_tokens_per_round: float  # tokens per target forward pass
    num_target_forwards: int
    wall_seconds: float
    tokens_per_second: float
    draft_seconds: float
    verify_seconds: float
    other_seconds: float
    overhead_fraction: float  # share of wall time outside model forward passes
    planned_speedup: float | None = None  # a cost-aware drafter's expected tokens / expected steps over the run

    def as_dict(self) -> dict:
        return asdict(self)


def num_tested(round_: Round) -> int:
    """Drafts the target reached in a round: every accepted one, and the first rejected one if there was one."""
    return min(len(round_.draft_token_ids), round_.num_accepted + 1)


def position_counts(rounds: Sequence[Round]) -> tuple[list[int], list[int]]:
    """Per draft position: how often a draft there was tested, and how often accepted."""
    length = max((len(round_.draft_token_ids) for round_ in rounds), default=0)
    tested, accepted = [0] * length, [0] * length
    for round_ in rounds:
        for position in range(num_tested(round_)):
            tested[position] += 1
            accepted[position] += position < round_.num_accepted
    return tested, accepted


def run_stats(rounds: Sequence[Round]) -> RunStats:
    num_generated = sum(len(round_.emitted_token_ids) for round_ in rounds)
    num_drafted = sum(len(round_.draft_token_ids) for round_ in rounds)
    num_accepted = sum(round_.num_accepted for round_ in rounds)
    tested = sum(num_tested(round_) for round_ in rounds)
    tested_by_position, accepted_by_position = position_counts(rounds)
    wall = sum(round_.wall_seconds for round_ in rounds)
    forward = sum(round_.forward_seconds for round_ in rounds)
    return RunStats(
        num_rounds=len(rounds),
        num_generated=num_generated,
        num_drafted=num_drafted,
        num_accepted=num_accepted,
        num_tested=tested,
        acceptance_rate=num_accepted / num_drafted if num_drafted else 0.0,
        alpha=num_accepted / tested if tested else 0.0,
        alpha_by_position=tuple(
            a / t if t else 0.0 for a, t in zip(accepted_by_position, tested_by_position, strict=True)
        ),
        tested_by_position=tuple(tested_by_position),
        no_proposal_share=sum(not round_.draft_token_ids for round_ in rounds) / len(rounds) if rounds else 0.0,
        mean_tokens_per_round=num_generated / len(rounds) if rounds else 0.0,
        num_target_forwards=len(rounds),
        wall_seconds=wall,
        tokens_per_second=num_generated / wall if wall > 0 else 0.0,
        draft_seconds=sum(round_.draft_seconds for round_ in rounds),
        verify_seconds=sum(round_.verify_seconds for round_ in rounds),
        other_seconds=sum(round_.other_seconds for round_ in rounds),
        overhead_fraction=1.0 - forward / wall if wall > 0 else 0.0,
        planned_speedup=planned_speedup(rounds),
    )


def planned_speedup(rounds: Sequence[Round]) -> float | None:
    """What a cost-aware drafter expected of the run against the target alone, in target steps; None when no round
    was planned. Its rounds: the plans' expected tokens over their expected steps (a round it was not asked to
    draft is one token for one step). The prompt's pass, which both runs make and no plan chooses, counts on both
    sides as the first round measured it: the plans expect decoding rounds, and a short run spends much of its
    time reading its prompt."""
    if not any(round_.plan for round_ in rounds):
        return None
    tokens = sum(round_.plan.expected_tokens if round_.plan else 1.0 for round_ in rounds)
    steps = sum(round_.plan.expected_steps if round_.plan else 1.0 for round_ in rounds)
    first = rounds[0].plan
    if first is None:
        return tokens / steps
    # the steps the prompt added to the first round, beyond its plan (none, where timing noise says fewer)
    prompt = max(0.0, (rounds[0].verify_seconds + rounds[0].other_seconds) / first.step_seconds - first.expected_steps)
    return (tokens + prompt) / (steps + prompt)


def expected_tokens_per_round(alpha: float, num_draft_tokens: int) -> float:
    """Leviathan et al. (2023), eq. 1: (1 - α^(k+1)) / (1 - α) tokens from a round proposing k independent drafts."""
    if alpha >= 1.0:
        return num_draft_tokens + 1.0
    return (1 - alpha ** (num_draft_tokens + 1)) / (1 - alpha)


def curve_tokens_per_round(alpha_by_position: Sequence[float], num_draft_tokens: int) -> float:
    """Expected tokens from a round proposing k drafts, from the measured α of each position (no independence
    assumed): 1 + Σ_j Π_{i<=j} α_i."""
    tokens, reach = 1.0, 1.0
    for alpha in alpha_by_position[:num_draft_tokens]:
        reach *= alpha
        tokens += reach
    return tokens


def round_record(round_: Round) -> dict:
    """One round as plain data for JSON: what was proposed, decided and emitted, and where the time went."""
    return {
        "draft_token_ids": round_.draft_token_ids,
        "num_accepted": round_.num_accepted,
        "next_token_id": round_.next_token_id,
        "next_kind": round_.next_kind,
        "target_probs": round_.target_probs,
        "draft_probs": round_.draft_probs,
        "acceptance_probs": round_.acceptance_probs,
        "uniforms": round_.uniforms,
        "noise": round_.noise,  # the coupled rule's G(d) of each test, where it decided them
        "num_input_tokens": round_.num_input_tokens,
        "draft_seconds": round_.draft_seconds,
        "verify_seconds": round_.verify_seconds,
        "other_seconds": round_.other_seconds,
        "num_rows": round_.num_rows,  # rows that shared the pass; each row's seconds are the whole shared pass's
        "path": round_.path,
        "candidates": [asdict(candidate) for candidate in round_.candidates],
        "plan": None if round_.plan is None else {**asdict(round_.plan), "says": round_.plan.describe()},
        "cut": None if round_.cut is None else {**asdict(round_.cut), "says": round_.cut.describe()},
        "views": [asdict(view) for view in round_.views],
    }


@dataclass(frozen=True)
class Comparison:
    """A speculative run against the target alone on the same prompt and settings, explained by measured parts.

    The accounting identity: speedup = tokens_per_pass / round_cost, exactly, where a target step is the
    target-only run's seconds per token (each of its rounds emits one token).
    """

    speedup: float  # speculative tokens/s over target-only tokens/s
    tokens_per_pass: float  # tokens per speculative round (one target pass each)
    round_cost: float  # seconds per speculative round, in target steps: draft_cost + verify_cost + other_cost
    draft_cost: float
    verify_cost: float
    other_cost: float
    verify_cost_by_k: tuple[tuple[int, float], ...]  # (k, v(k)): a pass over k drafts / a one-token step, medians
    verify_rounds_by_k: tuple[tuple[int, int], ...]  # (k, the rounds v(k) is the median of)
    predicted_tokens_per_pass: float  # Leviathan: independent acceptance at the run's α, for each k that occurred
    predicted_speedup: float  # predicted_tokens_per_pass / round_cost
    prediction_error: float  # predicted_speedup / speedup - 1
    best_num_draft_tokens: int  # the cap on k that the α curve and the measured costs favour
    best_speedup: float  # the speedup that cap would give, scaled from this run's
    identical: bool  # the two runs emitted the same tokens


def median(values: Sequence[float]) -> float:
    """The median (the mean of the middle two for an even count); 0 for no values."""
    return statistics.median(values) if values else 0.0


def verify_seconds_by_k(speculative: Sequence[Round]) -> dict[int, list[float]]:
    """The verification seconds of the rounds with k drafts, for every k that occurred. Round 0 reads the whole
    prompt and is left out."""
    by_k: dict[int, list[float]] = {}
    for round_ in speculative[1:]:
        if round_.draft_token_ids:
            by_k.setdefault(len(round_.draft_token_ids), []).append(round_.verify_seconds)
    return dict(sorted(by_k.items()))


def interpolated(costs: dict[int, float], k: int) -> float:
    """v(k) between the measured points, with v(0) = 1: a round with nothing drafted is a one-token step."""
    points = sorted({0: 1.0, **costs}.items())
    if k in costs or k == 0:
        return dict(points)[k]
    below = max((p for p in points if p[0] < k), key=lambda p: p[0])
    above = min((p for p in points if p[0] > k), key=lambda p: p[0], default=below)
    if above == below:
        return below[1]
    return below[1] + (above[1] - below[1]) * (k - below[0]) / (above[0] - below[0])


def capped_speedup_model(
    rounds: Sequence[Round],
    alpha_by_position: Sequence[float],
    costs: dict[int, float],
    cap: int,
    fixed: tuple[float, float],
) -> float:
    """Tokens per round over steps per round had each round proposed at most `cap` of its drafts: tokens from the
    measured α curve, costs from the measured v(k) plus `fixed` = (draft step per token, other steps per round)."""
    draft_step, other_step = fixed
    tokens = cost = 0.0
    for round_ in rounds:
        k = min(len(round_.draft_token_ids), cap)
        tokens += curve_tokens_per_round(alpha_by_position, k)
        cost += interpolated(costs, k) + draft_step * k + other_step
    return tokens / cost if cost else 0.0


def compare_runs(speculative: Sequence[Round], baseline: Sequence[Round], num_draft_tokens: int) -> Comparison:
    """Speedup as tokens per pass over round cost, v(k), Leviathan's prediction and the best cap on k."""
    spec, base = run_stats(speculative), run_stats(baseline)
    step = base.wall_seconds / base.num_generated if base.num_generated else 0.0  # the identity's target step
    one_token_step = median([round_.verify_seconds for round_ in baseline[1:]]) or step  # v(k)'s unit
    by_k = verify_seconds_by_k(speculative)
    costs = {k: median(seconds) / one_token_step for k, seconds in by_k.items()} if one_token_step else {}
    rounds = max(1, spec.num_rounds)
    round_cost = spec.wall_seconds / rounds / step if step else 0.0
    speedup = spec.tokens_per_second / base.tokens_per_second if base.tokens_per_second else 0.0
    predicted = sum(expected_tokens_per_round(spec.alpha, len(r.draft_token_ids)) for r in speculative) / rounds
    predicted_speedup = predicted / round_cost if round_cost else 0.0
    best, best_speedup = best_cap(speculative, spec, costs, one_token_step, speedup, num_draft_tokens)
    return Comparison(
        speedup=speedup,
        tokens_per_pass=spec.mean_tokens_per_round,
        round_cost=round_cost,
        draft_cost=spec.draft_seconds / rounds / step if step else 0.0,
        verify_cost=spec.verify_seconds / rounds / step if step else 0.0,
        other_cost=spec.other_seconds / rounds / step if step else 0.0,
        verify_cost_by_k=tuple(costs.items()),
        verify_rounds_by_k=tuple((k, len(seconds)) for k, seconds in by_k.items()),
        predicted_tokens_per_pass=predicted,
        predicted_speedup=predicted_speedup,
        prediction_error=predicted_speedup / speedup - 1 if speedup else 0.0,
        best_num_draft_tokens=best,
        best_speedup=best_speedup,
        identical=emitted_ids(speculative) == emitted_ids(baseline),
    )


def best_cap(
    speculative: Sequence[Round], spec: RunStats, costs: dict[int, float], step: float, speedup: float, used: int
) -> tuple[int, float]:
    """The cap on k (1..the longest proposal) that the measured α curve and costs favour, and its speedup, scaled
    from this run's measured one by the model's ratio; no α is known beyond the longest proposal."""
    decoding = speculative[1:]  # round 0 reads the prompt: its cost says nothing about k
    longest = len(spec.alpha_by_position)
    if not decoding or not longest or not costs or not step:
        return used, speedup
    drafted = sum(len(r.draft_token_ids) for r in decoding)
    draft_step = sum(r.draft_seconds for r in decoding) / drafted / step if drafted else 0.0
    fixed = (draft_step, sum(r.other_seconds for r in decoding) / len(decoding) / step)
    alphas = spec.alpha_by_position
    modelled = {cap: capped_speedup_model(decoding, alphas, costs, cap, fixed) for cap in range(1, longest + 1)}
    best = max(modelled, key=lambda cap: modelled[cap])
    return best, speedup * modelled[best] / modelled[longest] if modelled[longest] else speedup


def emitted_ids(rounds: Sequence[Round]) -> list[int]:
    return [token for round_ in rounds for token in round_.emitted_token_ids]
