"""Pure: rounds -> RunStats, and the expected-speedup formula of Leviathan et al. (2023), Theorem 3.8."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from specdemo.config import MAX_NUM_DRAFT_TOKENS
from specdemo.decoding import Round


@dataclass(frozen=True)
class RunStats:
    """Totals of one run, all measured (engine time only: the consumer's time between rounds is excluded)."""

    num_rounds: int
    num_generated: int
    num_drafted: int
    num_accepted: int
    acceptance_rate: float  # accepted / drafted; 0 when nothing was drafted
    mean_tokens_per_round: float  # tokens per target forward pass
    num_target_forwards: int
    wall_seconds: float
    tokens_per_second: float
    draft_seconds: float
    verify_seconds: float
    other_seconds: float
    overhead_fraction: float  # share of wall time outside model forward passes

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def run_stats(rounds: Sequence[Round]) -> RunStats:
    num_generated = sum(len(round_.emitted_token_ids) for round_ in rounds)
    num_drafted = sum(len(round_.draft_token_ids) for round_ in rounds)
    num_accepted = sum(round_.num_accepted for round_ in rounds)
    wall = sum(round_.wall_seconds for round_ in rounds)
    forward = sum(round_.forward_seconds for round_ in rounds)
    return RunStats(
        num_rounds=len(rounds),
        num_generated=num_generated,
        num_drafted=num_drafted,
        num_accepted=num_accepted,
        acceptance_rate=num_accepted / num_drafted if num_drafted else 0.0,
        mean_tokens_per_round=num_generated / len(rounds) if rounds else 0.0,
        num_target_forwards=len(rounds),
        wall_seconds=wall,
        tokens_per_second=num_generated / wall if wall > 0 else 0.0,
        draft_seconds=sum(round_.draft_seconds for round_ in rounds),
        verify_seconds=sum(round_.verify_seconds for round_ in rounds),
        other_seconds=sum(round_.other_seconds for round_ in rounds),
        overhead_fraction=1.0 - forward / wall if wall > 0 else 0.0,
    )


def expected_speedup(acceptance_rate: float, num_draft_tokens: int, cost_ratio: float) -> float:
    """(1 - a^(K+1)) / ((1 - a)(K c + 1)): expected tokens per round over the cost of a round, in target steps.

    `cost_ratio` c is the time of one draft step over one target step (about 0 for prompt lookup).
    """
    alpha, k = acceptance_rate, num_draft_tokens
    tokens_per_round = k + 1 if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens_per_round / (k * cost_ratio + 1)


def best_num_draft_tokens(acceptance_rate: float, cost_ratio: float) -> int:
    """The K in 1..MAX_NUM_DRAFT_TOKENS that maximises expected_speedup."""
    return max(
        range(1, MAX_NUM_DRAFT_TOKENS + 1),
        key=lambda k: expected_speedup(acceptance_rate, k, cost_ratio),
    )


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
        "num_input_tokens": round_.num_input_tokens,
        "draft_seconds": round_.draft_seconds,
        "verify_seconds": round_.verify_seconds,
        "other_seconds": round_.other_seconds,
    }


@dataclass(frozen=True)
class Comparison:
    """A speculative run against the target alone on the same prompt and settings."""

    speedup: float  # speculative tokens/s over target-only tokens/s
    acceptance_rate: float
    tokens_per_pass: float
    cost_ratio: float  # c: drafting one token, over one target step
    verify_cost_ratio: float  # a verification pass over one target step (K+1 tokens are not free on a CPU)
    expected_speedup: float  # the formula at the measured acceptance rate and c
    best_num_draft_tokens: int
    identical: bool  # the two runs emitted the same tokens


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else 0.0


def compare_runs(speculative: Sequence[Round], baseline: Sequence[Round], num_draft_tokens: int) -> Comparison:
    """Speedup, and the formula's prediction from measured parts; round 0 (the prompt's prefill) is left out of
    the per-step costs."""
    spec, base = run_stats(speculative), run_stats(baseline)
    step = _median([round_.verify_seconds for round_ in baseline[1:]]) or base.wall_seconds / max(1, base.num_rounds)
    drafting = [round_ for round_ in speculative[1:] if round_.draft_token_ids]
    draft_per_token = sum(r.draft_seconds for r in drafting) / max(1, sum(len(r.draft_token_ids) for r in drafting))
    cost_ratio = draft_per_token / step if step else 0.0
    verify_cost_ratio = _median([round_.verify_seconds for round_ in drafting]) / step if drafting and step else 1.0
    generated = [token for round_ in speculative for token in round_.emitted_token_ids]
    reference = [token for round_ in baseline for token in round_.emitted_token_ids]
    return Comparison(
        speedup=spec.tokens_per_second / base.tokens_per_second if base.tokens_per_second else 0.0,
        acceptance_rate=spec.acceptance_rate,
        tokens_per_pass=spec.mean_tokens_per_round,
        cost_ratio=cost_ratio,
        verify_cost_ratio=verify_cost_ratio,
        expected_speedup=expected_speedup(spec.acceptance_rate, num_draft_tokens, cost_ratio),
        best_num_draft_tokens=best_num_draft_tokens(spec.acceptance_rate, cost_ratio),
        identical=generated == reference,
    )
