"""Model mode: a prompt's first tokens drawn many times by speculative decoding (the bug planted in the rule) and by
the target alone, as rows of the engine's batches, compared with a two-sample test."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace

import torch

from specdemo.audit.bugs import verifier
from specdemo.audit.statistics import MIN_P_VALUE, NOISE_QUANTILE, homogeneity_pvalue, two_sample_noise_tv
from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.core.verify import verify_rows
from specdemo.drafters.base import Drafter, NoDrafter
from specdemo.engine.decoding import BatchDecoder

MODEL_BATCH_ROWS = 64  # samples decoded together; rows of one prompt read it once (TreeCachedModel)


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
        seeds = [sampling.seed + side * num_samples + i for i in range(num_samples)]

        def report(finished: int, side: int = side) -> None:
            on_progress((side * num_samples + finished) / (2 * num_samples))

        firsts = _draw(decoder, prompt_ids, sampling, speculative, seeds, num_tokens, report, should_stop, lock)
        samples.append(Counter(firsts))
    return _compare(samples, num_samples, num_tokens)


def _draw(
    decoder: BatchDecoder,
    prompt_ids: Sequence[int],
    sampling: SamplingConfig,
    speculative: SpeculativeConfig,
    seeds: list[int],
    num_tokens: int,
    report: Callable[[int], None],
    should_stop: Callable[[], bool],
    lock: AbstractContextManager | None,
) -> list[tuple[int, ...]]:
    """One side's samples: each seed's first `num_tokens` tokens, MODEL_BATCH_ROWS rows at a time."""
    tokens: list[list[int]] = [[] for _ in seeds]
    waiting, finished = list(range(len(seeds))), 0
    while waiting or decoder.rows:
        while waiting and len(decoder.rows) < MODEL_BATCH_ROWS:
            index = waiting.pop(0)
            decoder.add(index, list(prompt_ids), replace(sampling, seed=seeds[index]), speculative)
        if should_stop():
            raise InterruptedError("The audit was stopped before it drew all its samples.")
        with lock or nullcontext():
            outcomes = decoder.step()
        for index, outcome in outcomes:
            if isinstance(outcome, Exception):
                raise outcome
            tokens[index] += outcome.emitted_token_ids
            done = len(tokens[index]) >= num_tokens or tokens[index][-1] in decoder.eos_token_ids
            if index in decoder.rows and done:
                decoder.remove(index)  # it has what the audit keeps
            if index not in decoder.rows:
                finished += 1
                report(finished)
    return [tuple(t[:num_tokens]) for t in tokens]


def _compare(samples: list[Counter], num_samples: int, num_tokens: int) -> ModelAudit:
    """The two samples' sequences, a two-sample chi-square test, and their TV against the noise band."""
    sequences = sorted(set(samples[0]) | set(samples[1]), key=lambda s: -(samples[0][s] + samples[1][s]))
    first = torch.tensor([samples[0][s] for s in sequences], dtype=torch.float64, device="cpu")
    second = torch.tensor([samples[1][s] for s in sequences], dtype=torch.float64, device="cpu")
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
