"""Pure: how a sample of tokens fits a distribution (TV, Pearson's chi-square, the band of TV that sampling noise
alone reaches), and how two samples compare; one verdict sentence, and one for whether a seed's text is the same
whatever drafted it."""

# V = vocab_size, C = cells (distinct sequences)

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

MIN_P_VALUE = 1e-4  # a position fails when its chi-square p-value is at most this
NOISE_QUANTILE = 0.999  # the top of the band of TV expected from sampling noise alone
MIN_EXPECTED = 5.0  # cells expected to hold fewer tokens are pooled for the chi-square test


def tv_distance(counts: torch.Tensor, probs: torch.Tensor) -> float:  # [V] counts, [V] probs
    """Total-variation distance between the empirical distribution of `counts` and `probs`."""
    counts, probs = counts.double(), probs.double()
    return 0.5 * float((counts / counts.sum() - probs / probs.sum()).abs().sum())


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:  # [V] counts, [V] probs
    """Pearson's goodness-of-fit p-value over the cells with probs > 0 (the others must hold no counts), cells
    expected to hold fewer than MIN_EXPECTED pooled into one."""
    counts, probs = counts.double(), probs.double()
    support = probs > 0
    expected = counts.sum() * probs[support] / probs[support].sum()
    observed = counts[support]
    small = expected < MIN_EXPECTED
    if int(small.sum()) > 1:
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
        observed = torch.cat([observed[~small], observed[small].sum()[None]])
    if len(expected) < 2:
        return 1.0  # one cell: nothing to test
    chi2 = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor((len(expected) - 1) / 2, dtype=torch.float64, device=expected.device)
    return float(torch.special.gammaincc(dof, chi2 / 2))


def noise_tv(probs: torch.Tensor, num_samples: int, quantile: float, draws: int = 4_000) -> float:
    """The `quantile` of the TV between `num_samples` tokens drawn from `probs` and `probs` itself: multinomial
    counts are near-normal, so TV * sqrt(n) has a fixed distribution, drawn here once with a fixed seed."""
    probs = probs.double() / probs.double().sum()
    generator = torch.Generator(device=probs.device).manual_seed(0)
    normal = torch.randn(draws, len(probs), dtype=torch.float64, generator=generator, device=generator.device)
    scaled = normal * probs.sqrt()  # covariance diag(p); minus its projection: diag(p) - p p^T, the multinomial's
    deviation = scaled - probs * scaled.sum(dim=1, keepdim=True)
    tv = 0.5 * deviation.abs().sum(dim=1)
    return float(tv.quantile(quantile)) / math.sqrt(max(num_samples, 1))


@dataclass(frozen=True)
class PositionFit:
    """How the tokens emitted at one position fit the target's distribution there."""

    position: int  # 0: the first token of a round
    samples: int  # rows that emitted a token here
    tv: float
    noise_tv: float  # the NOISE_QUANTILE of TV from sampling noise alone at this many samples
    p_value: float  # chi-square goodness of fit
    impossible: int  # tokens emitted that the target gives probability 0
    label: str = ""  # how a sentence names what was tested, where it is not the position alone

    @property
    def passes(self) -> bool:
        return self.impossible == 0 and self.p_value > MIN_P_VALUE

    @property
    def where(self) -> str:
        return self.label or f"position {self.position + 1}"


def fit(position: int, counts: torch.Tensor, probs: torch.Tensor, label: str = "") -> PositionFit:  # [V], [V]
    samples = int(counts.sum())
    return PositionFit(
        position=position,
        samples=samples,
        tv=tv_distance(counts, probs) if samples else 0.0,
        noise_tv=noise_tv(probs, samples, NOISE_QUANTILE),
        p_value=chi_square_pvalue(counts, probs) if samples else 1.0,
        impossible=int(counts[probs == 0].sum()),
        label=label,
    )


def verdict_sentence(fits: Sequence[PositionFit], what: str) -> str:
    """One sentence: lossless or not, with the statistic that decided it."""
    tested = [f for f in fits if f.samples]
    failing = [f for f in tested if not f.passes]
    if not failing:
        worst = min(tested, key=lambda f: f.p_value)
        widest = max(tested, key=lambda f: f.tv / max(f.noise_tv, 1e-300))
        return (
            f"Lossless: {what} follow the target at every position (smallest chi-square p-value {worst.p_value:.3g} "
            f"at {worst.where}, above {MIN_P_VALUE:g}; largest TV {widest.tv:.4f} at {widest.where}, against "
            f"{widest.noise_tv:.4f} from sampling noise alone)."
        )
    first = failing[0]
    why = (
        f"{first.impossible:,} tokens the target gives probability 0"
        if first.impossible
        else f"chi-square p-value {first.p_value:.3g} ≤ {MIN_P_VALUE:g}"
    )
    return (
        f"Not lossless: at {first.where} {what} do not follow the target ({why}; TV {first.tv:.4f} "
        f"against {first.noise_tv:.4f} from sampling noise alone, over {first.samples:,} samples)."
    )


def invariance_sentence(differing: int, num_seeds: int) -> str:
    """One sentence: whether each seed's speculative text is the target alone's text for that seed."""
    if differing == 0:
        return (
            f"Same text for any drafter: for all {num_seeds:,} seeds the speculative text is the target alone's "
            "text for that seed."
        )
    return (
        f"Not the same text for any drafter: for {differing:,} of {num_seeds:,} seeds the speculative text differs "
        "from the target alone's text for that seed."
    )


def homogeneity_pvalue(first: torch.Tensor, second: torch.Tensor) -> float:  # [C] counts each
    """Pearson's chi-square test that two samples come from one distribution, cells expected to hold fewer than
    MIN_EXPECTED in either sample pooled into one."""
    first, second = first.double(), second.double()
    pooled = first + second
    share = float(first.sum() / pooled.sum())
    expected = torch.stack([pooled * share, pooled * (1 - share)])  # [2, C]
    observed = torch.stack([first, second])
    small = (expected < MIN_EXPECTED).any(dim=0)
    if int(small.sum()) > 1:
        expected = torch.cat([expected[:, ~small], expected[:, small].sum(dim=1, keepdim=True)], dim=1)
        observed = torch.cat([observed[:, ~small], observed[:, small].sum(dim=1, keepdim=True)], dim=1)
    if expected.shape[1] < 2:
        return 1.0
    chi2 = ((observed - expected) ** 2 / expected.clamp(min=1e-300)).sum()
    dof = torch.tensor((expected.shape[1] - 1) / 2, dtype=torch.float64, device=expected.device)
    return float(torch.special.gammaincc(dof, chi2 / 2))


def two_sample_noise_tv(pooled: torch.Tensor, sizes: tuple[int, int], quantile: float, draws: int = 2_000) -> float:
    """The `quantile` of the TV between two samples of these sizes drawn from one distribution (the pooled
    counts'): what sampling noise alone gives, simulated with a fixed seed."""
    probs = pooled.double() / pooled.double().sum()
    generator = torch.Generator(device=probs.device).manual_seed(0)
    empirical = []
    for size in sizes:
        tokens = torch.multinomial(probs, draws * size, replacement=True, generator=generator).reshape(draws, size)
        counts = torch.zeros(draws, len(probs), dtype=torch.float64, device=probs.device).scatter_add_(
            1, tokens, torch.ones_like(tokens, dtype=torch.float64)
        )
        empirical.append(counts / size)
    return float((0.5 * (empirical[0] - empirical[1]).abs().sum(dim=1)).quantile(quantile))
