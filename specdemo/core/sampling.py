"""Pure: logits -> next-token probabilities with transformers' logits processors, and exact token draws."""

# B = batch, N = positions scored in one pass (K+1 when verifying), T = context length, V = vocab_size

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specdemo.config import SamplingConfig

Generators = torch.Generator | Sequence[torch.Generator] | None  # one for the batch, or one per row


def build_warpers(sampling: SamplingConfig) -> LogitsProcessorList:
    """The position-independent processors, in the order generate() applies them."""
    warpers = LogitsProcessorList()
    if sampling.is_greedy:
        return warpers
    if sampling.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_k > 0:
        warpers.append(TopKLogitsWarper(sampling.top_k))
    if sampling.top_p < 1.0:
        warpers.append(TopPLogitsWarper(sampling.top_p))
    return warpers


def penalised_scores(
    logits: torch.Tensor,  # [B, N, V]
    context_ids: torch.Tensor,  # [B, T+N-1]
    sampling: SamplingConfig,
) -> torch.Tensor:  # [B, N, V] float32
    """The scores greedy decoding takes the argmax of: float32, after the repetition penalty on each position's own
    prefix."""
    scores = logits.float()
    if sampling.repetition_penalty == 1.0:
        return scores
    # The penalty reads the prefix, so position i sees prompt + generated + d_1..d_i only.
    penalty = RepetitionPenaltyLogitsProcessor(sampling.repetition_penalty)
    num_positions = logits.shape[1]
    start = context_ids.shape[1] - num_positions + 1
    return torch.stack([penalty(context_ids[:, : start + i], scores[:, i]) for i in range(num_positions)], dim=1)


def greedy_token_ids(
    logits: torch.Tensor,  # [B, N, V] scores for N successive positions of one pass
    context_ids: torch.Tensor,  # [B, T+N-1] position i is conditioned on context_ids[:, :T+i]
    sampling: SamplingConfig,
) -> torch.Tensor:  # [B, N] int64
    """What generate(do_sample=False) picks at each position: the first maximum after the repetition penalty."""
    return penalised_scores(logits, context_ids, sampling).max(dim=-1).indices  # argmax's, in a third of its time


def logits_to_probs(
    logits: torch.Tensor,  # [B, N, V] scores for N successive positions of one pass
    context_ids: torch.Tensor,  # [B, T+N-1] position i is conditioned on context_ids[:, :T+i]
    sampling: SamplingConfig,
    warpers: LogitsProcessorList,  # build_warpers(sampling), built once per run
) -> torch.Tensor:  # [B, N, V] float32; one-hot at the argmax when greedy
    """Apply the user's settings to every position exactly as target-only decoding would."""
    batch_size, num_positions, vocab_size = logits.shape
    if sampling.is_greedy:
        return torch.nn.functional.one_hot(greedy_token_ids(logits, context_ids, sampling), vocab_size).float()
    flat = penalised_scores(logits, context_ids, sampling).reshape(batch_size * num_positions, vocab_size)  # [B*N, V]
    flat = warpers(context_ids, flat)  # temperature, top-k and top-p ignore the context
    return flat.softmax(dim=-1).reshape(batch_size, num_positions, vocab_size)


def uniforms_from(
    generator: torch.Generator | None, shape: tuple[int, ...], device: torch.device
) -> torch.Tensor:  # [*shape] float64 in [0, 1), on `device`
    """Draws from `generator` on the generator's own device (a CUDA generator fills CUDA memory, a CPU one host memory),
    then moved to `device`, where the tensors they meet live."""
    if generator is None:  # the device's default generator
        return torch.rand(shape, dtype=torch.float64, device=device)
    return torch.rand(shape, dtype=torch.float64, generator=generator, device=generator.device).to(device)


def draw_uniforms(
    generator: Generators, batch_size: int, num_draws: int, device: torch.device
) -> torch.Tensor:  # [B, num_draws] float64 in [0, 1)
    """Uniform draws in float64; with one generator per row, row b depends only on generator b."""
    if generator is None or isinstance(generator, torch.Generator):
        return uniforms_from(generator, (batch_size, num_draws), device)
    assert len(generator) == batch_size, f"{len(generator)} generators for a batch of {batch_size}"
    return torch.stack([uniforms_from(g, (num_draws,), device) for g in generator])


def sample_one(
    weights: torch.Tensor,  # [V] non-negative, not necessarily normalised, with some mass
    uniform: torch.Tensor,  # [] float64 in [0, 1)
) -> torch.Tensor:  # [] int64
    """Inverse-CDF draw for one sequence: the first token whose cumulative weight exceeds u * total, so never a
    zero-weight token. Loop-free, for torch.func.vmap over beams and rows."""
    cdf = weights.double().cumsum(dim=-1)  # [V] float64, so a 49k-token tail keeps its precision
    total = cdf[-1]
    # Below the total, so the first cdf value above the threshold always exists and is a step up (weight > 0).
    threshold = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    return (cdf <= threshold).sum()  # searchsorted(cdf, threshold, right=True), which vmap cannot batch


def sample_from_probs(
    probs: torch.Tensor,  # [B, V] non-negative weights, not necessarily normalised
    uniforms: torch.Tensor,  # [B] float64 in [0, 1)
) -> torch.Tensor:  # [B] int64
    """sample_one for every row."""
    assert bool((probs.sum(dim=-1) > 0).all()), "sample_from_probs got a row with no probability mass"
    return sample_rows(probs, uniforms)


def sample_rows(
    probs: torch.Tensor,  # [B, V] non-negative weights, each row with some mass
    uniforms: torch.Tensor,  # [B] float64 in [0, 1)
) -> torch.Tensor:  # [B] int64
    """sample_one for every row, batched: the same operations, so the same draws, with no check that reads a value
    back, so a CUDA graph can capture it."""
    cdf = probs.double().cumsum(dim=-1)  # [B, V]
    total = cdf[:, -1:]  # [B, 1]
    threshold = torch.minimum(uniforms[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return (cdf <= threshold).sum(dim=-1)
