"""Cost-aware drafting, pure: a round's cost in one-token steps from measured sizes (costs.py measures them), and the
choice of how much to draft (k tokens on each of W candidates, or nothing) that maximises expected tokens per step."""

# W = num_candidates, K = num_draft_tokens, n = tokens read by one verification pass (1 + the drafted tokens)

from __future__ import annotations

import bisect
from dataclasses import dataclass


def monotone(values: list[float]) -> list[float]:
    """The closest non-decreasing sequence (pool adjacent violators): a pass over more tokens never costs less,
    whatever the noise of one measurement says."""
    blocks: list[list[float]] = []  # [mean, weight]
    for value in values:
        blocks.append([value, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (mean_a, weight_a), (mean_b, weight_b) = blocks[-2], blocks.pop()
            blocks[-1] = [(mean_a * weight_a + mean_b * weight_b) / (weight_a + weight_b), weight_a + weight_b]
    return [mean for mean, weight in blocks for _ in range(int(weight))]


@dataclass(frozen=True)
class PassCosts:
    """A target pass's cost in one-token steps, t(n) / t(1), from measured sizes; linear in between."""

    sizes: tuple[int, ...]
    steps_at: tuple[float, ...]  # t(size) / t(1), non-decreasing
    step_seconds: float  # t(1)

    @classmethod
    def from_seconds(cls, seconds: dict[int, float]) -> PassCosts:
        sizes = tuple(sorted(seconds))
        smooth = monotone([seconds[size] for size in sizes])
        return cls(sizes, tuple(value / smooth[0] for value in smooth), smooth[0])

    def steps(self, num_tokens: int) -> float:
        """t(n) / t(1); beyond the largest measured size, extrapolated from the last two."""
        return _interpolate(self.sizes, self.steps_at, num_tokens)


def _interpolate(sizes: tuple[int, ...], values: tuple[float, ...], size: int) -> float:
    """values at size: linear between measured sizes, extrapolated from the nearest two outside them."""
    at = bisect.bisect_left(sizes, size)
    if at < len(sizes) and sizes[at] == size:
        return values[at]
    low = min(max(at - 1, 0), len(sizes) - 2)
    (n0, n1), (v0, v1) = sizes[low : low + 2], values[low : low + 2]
    return v0 + (v1 - v0) * (size - n0) / (n1 - n0)


@dataclass(frozen=True)
class BatchCosts:
    """A shared round's cost in steps of a one-row, one-token round, by rows and width (the tokens each row reads:
    every row is padded to the widest), measured with one row and with `full_rows` rows at each width; linear in the
    rows in between, and in the width beyond the measured ones. Rows are measured apart because each row attends to
    its own context, which a one-row pass over as many tokens does not."""

    widths: tuple[int, ...]
    one_row: tuple[float, ...]  # non-decreasing in the width
    full: tuple[float, ...]
    full_rows: int

    @classmethod
    def from_seconds(cls, one_row: dict[int, float], full: dict[int, float], full_rows: int) -> BatchCosts:
        widths = tuple(sorted(one_row))
        assert widths == tuple(sorted(full)) and widths[0] == 1 and full_rows > 1
        alone, shared = monotone([one_row[w] for w in widths]), monotone([full[w] for w in widths])
        return cls(widths, tuple(t / alone[0] for t in alone), tuple(t / alone[0] for t in shared), full_rows)

    def steps(self, rows: int, width: int) -> float:
        alone = _interpolate(self.widths, self.one_row, width)
        shared = _interpolate(self.widths, self.full, width)
        return alone + (shared - alone) * (rows - 1) / (self.full_rows - 1)


@dataclass(frozen=True)
class Plan:
    """What a row drafted in a round and why: the option with the most expected tokens per step."""

    num_tokens: int  # k drafted on each candidate (0: nothing drafted, a plain target step)
    num_candidates: int  # W' candidates kept
    expected_tokens: float  # emitted by the round, the bonus or resampled token included
    expected_steps: float  # its cost in one-token target steps: the pass over 1 + W'k tokens
    available_tokens: int  # the longest draft the drafter had to offer
    step_seconds: float  # t(1) of the costs it planned with: what a step is, in seconds

    def describe(self) -> str:
        if self.num_tokens == 0:
            offer = f" (it had {self.available_tokens} to offer)" if self.available_tokens else ""
            return f"drafted nothing{offer}: a plain step, {self.expected_steps:.2f} steps for 1 token"
        across = f" on {self.num_candidates} candidates" if self.num_candidates > 1 else ""
        return (
            f"drafted {self.num_tokens}{across}: expected {self.expected_tokens:.2f} tokens for "
            f"{self.expected_steps:.2f} steps"
        )


def reach_chances(acceptance: list[list[float]]) -> list[list[float]]:
    """[W][<=K]: the chance that each candidate token and its prefix are accepted (the products along the prefix)."""
    reach = []
    for candidate in acceptance:
        chance, row = 1.0, []
        for accept in candidate:
            chance *= accept
            row.append(chance)
        reach.append(row)
    return reach


def plan_draft(
    acceptance: list[list[float]],  # [W][<=K]: the estimated chance that each candidate token is accepted, given
    # its candidate's earlier tokens were; the candidates' first tokens are different, so their chances add up
    costs: PassCosts,
) -> Plan:
    """Every (W', k) with W' <= W, k <= K, and drafting nothing; the one with the most expected tokens per step.
    Expected tokens = 1 + the sum over drafted tokens of the chance that they and their prefix are accepted."""
    reach = reach_chances(acceptance)
    available = max(map(len, acceptance), default=0)
    best = Plan(0, 0, 1.0, 1.0, available, costs.step_seconds)
    for num_candidates in range(1, len(acceptance) + 1):
        for num_tokens in range(1, available + 1):
            kept = [row[:num_tokens] for row in reach[:num_candidates]]
            drafted = sum(map(len, kept))
            tokens = 1.0 + sum(map(sum, kept))
            steps = costs.steps(1 + drafted)
            if tokens / steps > best.expected_tokens / best.expected_steps:
                best = Plan(num_tokens, num_candidates, tokens, steps, available, costs.step_seconds)
    return best


@dataclass(frozen=True)
class Cut:
    """A row's drafts cut for a pass shared with other rows: every row is padded to the widest, so one row's long
    draft costs every row's time."""

    num_tokens: int  # tokens each candidate kept (0: nothing drafted)
    available_tokens: int  # the row's longest candidate before the cut
    num_rows: int  # rows sharing the pass
    tokens_per_step: float  # the batch's expected tokens per step with this cut, the best of every cut
    uncut_tokens_per_step: float  # the same without cutting

    def describe(self) -> str:
        return (
            f"cut from {self.available_tokens} to {self.num_tokens} drafted tokens for a pass shared by "
            f"{self.num_rows} rows, each padded to the widest: the batch expected {self.tokens_per_step:.2f} tokens "
            f"per step so, {self.uncut_tokens_per_step:.2f} uncut"
        )


def plan_shared_pass(
    rows: list[list[list[float]]],  # per row, [W][<=K] the chance of each candidate token given its prefix
    costs: BatchCosts,
) -> tuple[int, float, float]:
    """The depth every row's candidates are cut to that maximises the batch's expected tokens per step, with that
    rate and the uncut one. A pass reads every row padded to the widest: 1 + the most candidate tokens of one row.
    On a tie the deeper cut wins: no needless cut."""
    reaches = [reach_chances(row) for row in rows]
    deepest = max((len(candidate) for row in rows for candidate in row), default=0)
    rates = []
    for depth in range(deepest + 1):
        slots = max(sum(min(len(candidate), depth) for candidate in row) for row in rows)
        tokens = sum(1.0 + sum(sum(candidate[:depth]) for candidate in reach) for reach in reaches)
        rates.append(tokens / costs.steps(len(rows), 1 + slots))
    best = max(range(deepest + 1), key=lambda depth: (rates[depth], depth))
    return best, rates[best], rates[deepest]
