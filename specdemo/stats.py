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
