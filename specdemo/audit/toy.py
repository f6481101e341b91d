"""The lossless audit: draw many tokens through the project's own verification and test them against the target's
distribution; the same audit with a planted bug must fail. Toy mode is pure (p and q given); model mode decodes a
prompt's first tokens many times, speculatively and with the target alone, with the engine."""

# N = samples, K = num_draft_tokens, W = num_candidates, V = vocab_size, P = positions (K + 1)

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace

import torch

from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.core.candidates import CandidateVerdict, Verify, verify_rows
from specdemo.core.sampling import sample_from_probs
from specdemo.core.verify import rejection_sample
from specdemo.drafters.base import Drafter, NoDrafter
from specdemo.engine.decoding import BatchDecoder

MIN_P_VALUE = 1e-4  # a position fails when its chi-square p-value is at most this
NOISE_QUANTILE = 0.999  # the top of the band of TV expected from sampling noise alone
MIN_EXPECTED = 5.0  # cells expected to hold fewer tokens are pooled for the chi-square test
RAW_TEMPERATURE = 1.5  # the "wrong q" bug divides by the draft's distribution before this temperature
MAX_TOY_VOCAB = 32
CHUNK = 65_536  # rows verified at once in toy mode (~40 MB of probabilities at V = 32, K = 4)

BUGS = {
    "none": "the project's sampler",
    "resample from p": "after a rejection the next token comes from p instead of norm(max(0, p - q))",
    "always accept": "every draft token is accepted",
    "wrong q": f"the test uses the draft's raw distribution (before its temperature {RAW_TEMPERATURE:g}), not the "
    "one it sampled from",
    "shared uniform": "one uniform draw serves every test and the final draw",
}


def verifier(bug: str) -> Verify:
    """The engine's rule (verify_rows), or that rule with the named bug planted: each bug is a mistake real samplers
    made."""
    if bug not in BUGS:
        raise ValueError(f"Unknown bug {bug!r}: pick one of {', '.join(repr(b) for b in BUGS)}.")
    return {
        "none": verify_rows,
        "resample from p": _resampling_from_p,
        "always accept": _always_accepting,
        "wrong q": _with_raw_q,
        "shared uniform": _with_one_uniform,
    }[bug]


def _resampling_from_p(ids, lengths, draft_probs, target_probs, uniforms) -> CandidateVerdict:
    verdict = verify_rows(ids, lengths, draft_probs, target_probs, uniforms)
    rows = torch.arange(ids.shape[0])
    node = target_probs[rows, verdict.path, verdict.num_accepted]  # [B, V] p where the next token is drawn
    from_p = sample_from_probs(node, uniforms[:, -1])
    stopped = verdict.num_accepted < lengths[rows, verdict.path]  # a rejection, not a bonus
    return replace(verdict, next_token_ids=torch.where(stopped, from_p, verdict.next_token_ids))


def _always_accepting(ids, lengths, draft_probs, target_probs, uniforms) -> CandidateVerdict:
    passing = uniforms.clone()
    passing[:, :-1] = -1.0  # u * q < p for every drafted token (q > 0): every test passes
    return verify_rows(ids, lengths, draft_probs, target_probs, passing)


def _with_raw_q(ids, lengths, draft_probs, target_probs, uniforms) -> CandidateVerdict:
    raw = draft_probs.double() ** RAW_TEMPERATURE  # softmax(l / T) ** T is proportional to softmax(l)
    raw = (raw / raw.sum(dim=-1, keepdim=True).clamp(min=1e-300)).to(draft_probs.dtype)  # padding stays 0
    return verify_rows(ids, lengths, raw, target_probs, uniforms)


def _with_one_uniform(ids, lengths, draft_probs, target_probs, uniforms) -> CandidateVerdict:
    return verify_rows(ids, lengths, draft_probs, target_probs, uniforms[:, :1].expand_as(uniforms).contiguous())


def emitted_by_position(
    verdict: CandidateVerdict,
    draft_ids: torch.Tensor,  # draft_ids [B, W, K]
) -> torch.Tensor:  # [B, K+1] the token emitted at each position, -1 past the row's last
    """Accepted drafts along the path, then the resampled or bonus token."""
    rows = torch.arange(draft_ids.shape[0])
    path_ids = draft_ids[rows, verdict.path]  # [B, K]
    positions = torch.arange(draft_ids.shape[2] + 1)
    padded = torch.nn.functional.pad(path_ids, (0, 1), value=-1)
    emitted = torch.where(positions < verdict.num_accepted[:, None], padded, -1)
    emitted[rows, verdict.num_accepted] = verdict.next_token_ids
    return emitted


# --- statistics ---------------------------------------------------------------------------------------------------


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
    dof = torch.tensor((len(expected) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, chi2 / 2))


def noise_tv(probs: torch.Tensor, num_samples: int, quantile: float, draws: int = 4_000) -> float:
    """The `quantile` of the TV between `num_samples` tokens drawn from `probs` and `probs` itself: multinomial
    counts are near-normal, so TV * sqrt(n) has a fixed distribution, drawn here once with a fixed seed."""
    probs = probs.double() / probs.double().sum()
    normal = torch.randn(draws, len(probs), dtype=torch.float64, generator=torch.Generator().manual_seed(0))
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

    @property
    def passes(self) -> bool:
        return self.impossible == 0 and self.p_value > MIN_P_VALUE


def fit(position: int, counts: torch.Tensor, probs: torch.Tensor) -> PositionFit:  # [V], [V]
    samples = int(counts.sum())
    return PositionFit(
        position=position,
        samples=samples,
        tv=tv_distance(counts, probs) if samples else 0.0,
        noise_tv=noise_tv(probs, samples, NOISE_QUANTILE),
        p_value=chi_square_pvalue(counts, probs) if samples else 1.0,
        impossible=int(counts[probs == 0].sum()),
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
            f"at position {worst.position + 1}, above {MIN_P_VALUE:g}; largest TV {widest.tv:.4f} at position "
            f"{widest.position + 1}, against {widest.noise_tv:.4f} from sampling noise alone)."
        )
    first = failing[0]
    why = (
        f"{first.impossible:,} tokens the target gives probability 0"
        if first.impossible
        else f"chi-square p-value {first.p_value:.3g} ≤ {MIN_P_VALUE:g}"
    )
    return (
        f"Not lossless: at position {first.position + 1} {what} do not follow the target ({why}; TV {first.tv:.4f} "
        f"against {first.noise_tv:.4f} from sampling noise alone, over {first.samples:,} samples)."
    )


# --- toy mode -----------------------------------------------------------------------------------------------------

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
    weights = torch.tensor(values, dtype=torch.float64)
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
    position must follow p. With W = 1 and no bug, rejection_sample itself decides; otherwise the multi-candidate
    rule (bit for bit rejection_sample at W = 1), with the bug planted."""
    assert target.shape == draft.shape and target.ndim == 1, "p and q are [V] alike"
    vocab_size, k, w = len(target), num_draft_tokens, num_candidates
    generator = torch.Generator().manual_seed(seed)
    p, q = target.float(), draft.float()
    verify = verifier(bug)
    counts = torch.zeros(k + 1, vocab_size, dtype=torch.long)
    curve, done = [], 0
    for size in _chunks(num_samples):
        ids = torch.multinomial(q, size * w * k, replacement=True, generator=generator).reshape(size, w, k)
        if w == 1 and bug == "none":
            result = rejection_sample(ids[:, 0], q.expand(size, k, -1), p.expand(size, k + 1, -1), generator=generator)
            emitted = result.token_ids  # [B, K+1], PADDING_ID (-1) past the last
        else:
            uniforms = torch.rand(size, k * w + 1, dtype=torch.float64, generator=generator)
            lengths = torch.full((size, w), k)
            verdict = verify(ids, lengths, q.expand(size, w, k, -1), p.expand(size, w, k + 1, -1), uniforms)
            emitted = emitted_by_position(verdict, ids)
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


# --- model mode ---------------------------------------------------------------------------------------------------

MODEL_BATCH_ROWS = 64  # samples decoded together; rows of one prompt read it once (TreeCachedModel)


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
    dof = torch.tensor((expected.shape[1] - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, chi2 / 2))


def two_sample_noise_tv(pooled: torch.Tensor, sizes: tuple[int, int], quantile: float, draws: int = 2_000) -> float:
    """The `quantile` of the TV between two samples of these sizes drawn from one distribution (the pooled
    counts'): what sampling noise alone gives, simulated with a fixed seed."""
    probs = pooled.double() / pooled.double().sum()
    generator = torch.Generator().manual_seed(0)
    empirical = []
    for size in sizes:
        tokens = torch.multinomial(probs, draws * size, replacement=True, generator=generator).reshape(draws, size)
        counts = torch.zeros(draws, len(probs), dtype=torch.float64).scatter_add_(
            1, tokens, torch.ones_like(tokens, dtype=torch.float64)
        )
        empirical.append(counts / size)
    return float((0.5 * (empirical[0] - empirical[1]).abs().sum(dim=1)).quantile(quantile))


@dataclass(frozen=True)
class ModelAudit:
    """M samples of the first tokens by speculative decoding and M by the target alone, and how they compare."""

    sequences: list[tuple[int, ...]]  # every sequence drawn, most frequent first
    speculative: list[int]  # its count among the speculative samples
    target_only: list[int]  # ... among the target-only samples
    tv: float
    noise_tv: float
    p_value: float
    passes: bool
    verdict: str


def model_audit(
    target: torch.nn.Module,
    drafter: Drafter,
    eos_token_ids: frozenset[int],
    prompt_ids: Sequence[int],
    sampling: SamplingConfig,
    speculative: SpeculativeConfig,  # K, W and the draft's temperature
    num_tokens: int,  # drawn per sample
    num_samples: int,
    bug: str = "none",
    on_progress: Callable[[float], None] = lambda done: None,  # the share of samples drawn
    should_stop: Callable[[], bool] = lambda: False,  # checked every round: InterruptedError when it says so
    lock: AbstractContextManager | None = None,  # held for each round's passes
) -> ModelAudit:
    """The prompt's first `num_tokens` tokens, drawn num_samples times speculatively (the bug planted in the rule)
    and num_samples times with the target alone, as rows of batches with seeds sampling.seed + i; the two samples'
    sequences compared with a two-sample chi-square test, and their TV with the noise band. A row may emit K more
    tokens than it keeps, so that its first rounds draft all K."""
    assert not sampling.is_greedy, "greedy decoding has nothing to sample"
    speculative = replace(speculative, max_new_tokens=num_tokens + speculative.num_draft_tokens)
    samples: list[Counter] = []
    for side, (drafter_used, verify) in enumerate(((drafter, verifier(bug)), (NoDrafter(), verify_rows))):
        decoder = BatchDecoder(target, drafter_used, eos_token_ids, verify)  # type: ignore[arg-type]
        tokens: list[list[int]] = [[] for _ in range(num_samples)]
        waiting, finished = list(range(num_samples)), 0
        while waiting or decoder.rows:
            while waiting and len(decoder.rows) < MODEL_BATCH_ROWS:
                index = waiting.pop(0)
                row_sampling = replace(sampling, seed=sampling.seed + side * num_samples + index)
                decoder.add(index, list(prompt_ids), row_sampling, speculative)
            if should_stop():
                raise InterruptedError("The audit was stopped before it drew all its samples.")
            with lock or nullcontext():
                outcomes = decoder.step()
            for index, outcome in outcomes:
                if isinstance(outcome, Exception):
                    raise outcome
                tokens[index] += outcome.emitted_token_ids
                if index in decoder.rows and (len(tokens[index]) >= num_tokens or tokens[index][-1] in eos_token_ids):
                    decoder.remove(index)  # it has what the audit keeps
                if index not in decoder.rows:
                    finished += 1
                    on_progress((side * num_samples + finished) / (2 * num_samples))
        samples.append(Counter(tuple(t[:num_tokens]) for t in tokens))
    sequences = sorted(set(samples[0]) | set(samples[1]), key=lambda s: -(samples[0][s] + samples[1][s]))
    first = torch.tensor([samples[0][s] for s in sequences], dtype=torch.float64)
    second = torch.tensor([samples[1][s] for s in sequences], dtype=torch.float64)
    tv = 0.5 * float((first / num_samples - second / num_samples).abs().sum())
    noise = two_sample_noise_tv(first + second, (num_samples, num_samples), NOISE_QUANTILE)
    p_value = homogeneity_pvalue(first, second)
    passes = p_value > MIN_P_VALUE
    what = f"{num_samples:,} speculative and {num_samples:,} target-only samples of the first {num_tokens} tokens"
    verdict = (
        f"Lossless: the {what} agree (chi-square p-value {p_value:.3g}, above {MIN_P_VALUE:g}; TV {tv:.3f}, against "
        f"{noise:.3f} from sampling noise alone)."
        if passes
        else f"Not lossless: the {what} differ (chi-square p-value {p_value:.3g} ≤ {MIN_P_VALUE:g}; TV {tv:.3f}, "
        f"against {noise:.3f} from sampling noise alone)."
    )
    return ModelAudit(
        sequences=sequences,
        speculative=first.long().tolist(),
        target_only=second.long().tolist(),
        tv=tv,
        noise_tv=noise,
        p_value=p_value,
        passes=passes,
        verdict=verdict,
    )
