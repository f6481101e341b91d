"""Model mode: a prompt's first tokens drawn many times by speculative decoding (the bug planted in the rule) and by
the target alone, as rows of the engine's batches, compared with a two-sample test. Under the coupled rule, the bug is
planted in the noise, and each seed's speculative text must also be the target alone's text for that seed."""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Generator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace

import torch

from specdemo.audit.bugs import planted_rule
from specdemo.audit.statistics import (
    MIN_P_VALUE,
    NOISE_QUANTILE,
    homogeneity_pvalue,
    invariance_sentence,
    two_sample_noise_tv,
)
from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.core.rules import Rule
from specdemo.drafters.base import Drafter, NoDrafter
from specdemo.engine.scheduler import DecodeRequest, RowStream, Scheduler

MODEL_BATCH_ROWS = 64  # samples decoded together; rows of one prompt read it once (TreeCachedModel)
ROUND_INTERVAL_SECONDS = 0.5 / MODEL_BATCH_ROWS  # a full batch's rounds arrive at most every half second


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
    differing: int | None = None  # coupled rule: seeds whose speculative text is not the target alone's for that seed


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
    lock: AbstractContextManager | None = None,  # held for each round's passes
) -> ModelAudit:
    """audit_draws drawn to its end."""
    draws = audit_draws(
        target, drafter, eos_token_ids, prompt_ids, sampling, speculative, num_tokens, num_samples, bug, lock
    )
    while True:
        try:
            next(draws)
        except StopIteration as done:
            return done.value


def audit_draws(
    target: torch.nn.Module,
    drafter: Drafter,
    eos_token_ids: frozenset[int],
    prompt_ids: Sequence[int],
    sampling: SamplingConfig,
    speculative: SpeculativeConfig,  # K, W and the draft's temperature
    num_tokens: int,  # drawn per sample
    num_samples: int,
    bug: str = "none",
    lock: AbstractContextManager | None = None,  # held for each round's passes
    stop: threading.Event | None = None,  # set: the audit's rows leave at their next round: InterruptedError
    deadline: float = math.inf,  # time.monotonic() past which its rows leave: InterruptedError
) -> Generator[float, None, ModelAudit]:
    """The prompt's first `num_tokens` tokens, drawn num_samples times speculatively (the bug planted in the rule)
    and num_samples times with the target alone, with seeds sampling.seed + i; the two samples' sequences compared
    with a two-sample chi-square test, and their TV with the noise band. Each side's rows are decoded by a Scheduler
    of its own (engine/scheduler.py), as runs are, MODEL_BATCH_ROWS at a time, each round holding `lock`; this yields
    the share of samples drawn as rounds arrive and returns the audit. A row may emit K more tokens than it keeps, so
    that its first rounds draft all K. Under the coupled rule (sampling.is_coupled) the bug is planted in the noise
    (bugs.planted_rule), the target alone samples by the standard rule (code sharing no noise with the rule audited),
    and a third side, the target alone under the same noise with the speculative side's seeds, must write each seed's
    very text."""
    assert not sampling.is_greedy, "greedy decoding has nothing to sample"
    speculative = replace(speculative, max_new_tokens=num_tokens + speculative.num_draft_tokens)
    sides = _sides(target, drafter, eos_token_ids, sampling, bug, lock or nullcontext())
    texts: list[list[tuple[int, ...]]] = []
    for side, (scheduler, side_sampling, seed_block) in enumerate(sides):
        seeds = [sampling.seed + seed_block * num_samples + i for i in range(num_samples)]
        requests = [DecodeRequest(list(prompt_ids), replace(side_sampling, seed=seed), speculative) for seed in seeds]
        stream = scheduler.submit(requests, deadline, stop)
        drawn = yield from _drawn(scheduler, stream, num_tokens, side * num_samples, len(sides) * num_samples)
        texts.append(drawn)
    audit = _compare([Counter(texts[0]), Counter(texts[1])], num_samples, num_tokens)
    if len(texts) == 2:
        return audit
    differing = sum(mine != alone for mine, alone in zip(texts[0], texts[2], strict=True))
    return replace(
        audit,
        passes=audit.passes and differing == 0,
        verdict=f"{audit.verdict} {invariance_sentence(differing, num_samples)}",
        differing=differing,
    )


def _sides(
    target: torch.nn.Module,
    drafter: Drafter,
    eos_token_ids: frozenset[int],
    sampling: SamplingConfig,
    bug: str,
    lock: AbstractContextManager,
) -> list[tuple[Scheduler, SamplingConfig, int]]:
    """Each side's scheduler, settings and block of seeds (block b: seeds sampling.seed + b * num_samples + i): the
    speculative side with the bug planted, the target alone on other seeds, and under the coupled rule the target
    alone under the same noise on the speculative side's seeds. No side cuts its drafts for a shared pass, so every
    round drafts what the drafter offers."""

    def scheduler(drafter_used: Drafter, planted: Rule | None = None) -> Scheduler:
        return Scheduler(
            target,  # type: ignore[arg-type]
            drafter_used,
            eos_token_ids,
            lock,
            MODEL_BATCH_ROWS,
            rule=planted,
            cut_drafts=False,
        )

    planted = planted_rule(sampling.rule if sampling.is_coupled else "standard", bug)
    if not sampling.is_coupled:
        return [(scheduler(drafter, planted), sampling, 0), (scheduler(NoDrafter()), sampling, 1)]
    return [
        (scheduler(drafter, planted), sampling, 0),
        (scheduler(NoDrafter()), replace(sampling, rule="standard"), 1),  # exact by code that shares no noise with it
        (scheduler(NoDrafter(), planted), sampling, 0),  # the same noise and seeds: each seed's very text
    ]


def _drawn(
    scheduler: Scheduler, stream: RowStream, num_tokens: int, before: int, total: int
) -> Generator[float, None, list[tuple[int, ...]]]:
    """One side's samples: each row's first `num_tokens` tokens (a row leaves once it has them); yields the share of
    the audit's `total` samples drawn (`before` drawn by earlier sides) as rounds arrive. Closed early, its rows leave
    at their next round; stopped or past its deadline, InterruptedError."""
    eos_token_ids = scheduler.decoder.eos_token_ids
    tokens: list[list[int]] = [[] for _ in stream.keys]
    finished: set[int] = set()
    for batch in stream.batches(ROUND_INTERVAL_SECONDS):
        for index, round_ in batch:
            tokens[index] += round_.emitted_token_ids
            if index not in finished and (len(tokens[index]) >= num_tokens or tokens[index][-1] in eos_token_ids):
                finished.add(index)
                scheduler.cancel(stream.keys[index])  # it has what the audit keeps
        yield (before + len(finished)) / total
    if len(finished) < len(tokens):  # stopped, or out of time: the rows left with fewer tokens than the audit keeps
        raise InterruptedError("The audit was stopped before it drew all its samples.")
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
