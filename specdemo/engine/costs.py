"""What a round costs on this device: an engine round over n target tokens, measured once per model, number format and
device (a model loaded again, in a format asked for again, is not measured again)."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

import torch
from transformers import PreTrainedModel

from specdemo.config import MAX_NEW_TOKENS_LIMIT, MAX_NUM_DRAFT_TOKENS, SamplingConfig, SpeculativeConfig
from specdemo.core.planning import BatchCosts, PassCosts
from specdemo.core.rounds import Round
from specdemo.drafters.base import Draft, DraftRequest
from specdemo.engine.cost_watch import watch
from specdemo.engine.decoding import BatchDecoder

MEASURED_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 129)  # n; others are interpolated
CONTEXT_TOKENS = 128  # the cached context the measured passes follow
MEASURED_SLOTS = 512  # L of the measurement's groups on a GPU: its rows hold fewer tokens than this (a context and
# one token a round, its random drafts rejected), so two groups of it never take more than the memory plan gives a
# run (models/memory.py)
MEASURED_GROUPS = 2  # groups it holds at once: a decoder of one row and one of a full batch


def measure_pass_seconds(
    model: PreTrainedModel,
    sizes: tuple[int, ...],
    context_tokens: int = CONTEXT_TOKENS,
    repeats: int = 4,
    clock: Callable[[], float] = time.perf_counter,
    sampling: SamplingConfig = SamplingConfig(),  # noqa: B008 (frozen, so a shared default is safe)
) -> dict[int, float]:
    """One row's round seconds by size (measure_round_seconds)."""
    return measure_round_seconds(model, sizes, context_tokens, repeats, rows=(1,), clock=clock, sampling=sampling)[1]


def measure_round_seconds(
    model: PreTrainedModel,
    sizes: tuple[int, ...],
    context_tokens: int,
    repeats: int,
    rows: tuple[int, ...],
    clock: Callable[[], float] = time.perf_counter,
    sampling: SamplingConfig = SamplingConfig(),  # noqa: B008 (frozen); the rows' settings: greedy unless given
) -> dict[int, dict[int, float]]:
    """Seconds of one engine round whose target pass reads n tokens per row (the sequence's last token and n-1
    drafted ones, in candidates of at most MAX_NUM_DRAFT_TOKENS) after a context_tokens prompt of each row's own:
    the pass, the cache's bookkeeping, the probabilities and the rule, as rows with `sampling` spend them. The fastest
    of `repeats` after one warm-up, sizes and row counts interleaved: another process can only add time to a round,
    so the fastest is the least disturbed, where a median on a busy machine is whatever spell it fell in (a busy
    measurement once made drafting look dear and switched it off). By row count, then size. Each row may hold
    MEASURED_SLOTS - 1 tokens; a round that fails (out of memory) is raised, not timed."""
    generator = torch.Generator(device="cpu").manual_seed(0)  # random token ids, made on the host
    vocab_size = model.config.vocab_size
    drafter = _RandomDrafter(generator, vocab_size)
    decoders = {count: BatchDecoder(model, drafter, frozenset()) for count in rows}
    room = SpeculativeConfig(max_new_tokens=min(MAX_NEW_TOKENS_LIMIT, MEASURED_SLOTS - 1 - context_tokens))
    for count, decoder in decoders.items():
        for row in range(count):
            context = torch.randint(
                vocab_size, (context_tokens,), generator=generator, device=generator.device
            ).tolist()
            decoder.add(row, context, sampling, room)
    timings: dict[int, dict[int, list[float]]] = {count: {size: [] for size in sizes} for count in rows}
    try:
        for repeat in range(repeats + 1):
            for size in sizes:
                drafter.num_tokens = size - 1
                for count, decoder in decoders.items():
                    started = clock()
                    outcomes = decoder.step()
                    if repeat:
                        timings[count][size].append(clock() - started)
                    _raise_failure(outcomes)
    finally:  # the groups go back to the model's pools, for runs
        for decoder in decoders.values():
            for row in list(decoder.rows):
                decoder.remove(row)
    return {count: {size: min(t) for size, t in by_size.items()} for count, by_size in timings.items()}


def _raise_failure(outcomes: list[tuple[Hashable, Round | Exception]]) -> None:
    for _, outcome in outcomes:
        if isinstance(outcome, Exception):
            raise outcome


class _RandomDrafter:
    """Proposes `num_tokens` random tokens whatever it is asked (rejected, so the row grows one token a round)."""

    def __init__(self, generator: torch.Generator, vocab_size: int) -> None:
        self.generator, self.vocab_size, self.num_tokens = generator, vocab_size, 0

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        tokens = torch.randint(
            self.vocab_size, (self.num_tokens,), generator=self.generator, device=self.generator.device
        ).tolist()
        candidates = [tokens[i : i + MAX_NUM_DRAFT_TOKENS] for i in range(0, len(tokens), MAX_NUM_DRAFT_TOKENS)]
        return [Draft(candidates, None) for _ in requests]

    def forget(self, key: Hashable) -> None:
        pass


_MEASURED: dict[tuple, PassCosts] = {}
_SHARED: dict[tuple, BatchCosts] = {}


def _key(model: PreTrainedModel) -> tuple:
    """What a round's cost depends on: the architecture and size, the number format and the device."""
    config = model.config
    return (config.name_or_path, config.model_type, model.num_parameters(), str(model.dtype), str(model.device))


SHARED_WIDTHS = (1, 2, 3, 4, 6, 8, 12, MAX_NUM_DRAFT_TOKENS + 1)  # tokens per row of a shared pass; others interpolated
SHARED_CONTEXT_TOKENS = 256  # each row's context: a chat prompt and its first hundred-odd tokens of output


def measured(model: PreTrainedModel) -> PassCosts | None:
    return _MEASURED.get(_key(model))


def pass_costs(model: PreTrainedModel, max_tokens: int) -> PassCosts:
    """This model's pass costs up to max_tokens (measured on first use, a few seconds for a small model; kept per
    model object, which the model cache holds once per name, number format and device; measured again when a larger
    pass is needed, or when its rounds disagree with what the costs expected: engine/cost_watch.py)."""
    known = _MEASURED.get(_key(model))
    largest = next((size for size in MEASURED_SIZES if size >= max_tokens), MEASURED_SIZES[-1])
    if known is None or known.sizes[-1] < largest or watch(model).stale:
        largest = max(largest, known.sizes[-1]) if known is not None else largest
        sizes = tuple(size for size in MEASURED_SIZES if size <= largest)
        known = _MEASURED[_key(model)] = PassCosts.from_seconds(measure_pass_seconds(model, sizes))
        watch(model).measured_again()
    return known


def shared_costs(model: PreTrainedModel) -> BatchCosts | None:
    return _SHARED.get(_key(model))


def batch_costs(model: PreTrainedModel, full_rows: int) -> BatchCosts:
    """This model's shared-round costs with one row and with full_rows rows, each on a context of its own (measured
    on first use, about ten seconds for the offline default on 2 CPU cores; kept per model and format)."""
    known = _SHARED.get(_key(model))
    if known is None or known.full_rows != full_rows:
        seconds = measure_round_seconds(model, SHARED_WIDTHS, SHARED_CONTEXT_TOKENS, 3, rows=(1, full_rows))
        known = _SHARED[_key(model)] = BatchCosts.from_seconds(seconds[1], seconds[full_rows], full_rows)
    return known
