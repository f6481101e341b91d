"""Pure: each chain row's own sampling settings applied in fixed shapes with no host reads, so a captured round (a CUDA
graph) turns logits into the same probabilities `logits_to_probs` gives, and draws its uniforms from a counter-based
splitmix64 stream instead of a generator."""

# R = chain rows, n = columns of a pass (K+1), V = vocab_size

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch

from specdemo.config import MAX_NUM_CANDIDATES, MAX_NUM_DRAFT_TOKENS, SamplingConfig

DRAWS_PER_ROUND = (MAX_NUM_DRAFT_TOKENS + 1) * MAX_NUM_CANDIDATES  # a round's block of a row's stream: every test
# of the widest round, and the next token's draw last
GAMMA = 0x9E3779B97F4A7C15 - (1 << 64)  # splitmix64's constants as the signed int64 values with the same bits
MIX_1 = 0xBF58476D1CE4E5B9 - (1 << 64)
MIX_2 = 0x94D049BB133111EB - (1 << 64)
DRAFT_SALT = 0x6A09E667F3BCC909  # keeps a sampling drafter's draws apart from the rule's stream of the same seed
DRAFT_DRAWS = MAX_NUM_DRAFT_TOKENS * MAX_NUM_CANDIDATES  # a round's block of a drafter's stream: W beams of K tokens


# --- uniforms: splitmix64 by counter ---------------------------------------------------------------------------------


def seed_from(generator: torch.Generator) -> int:
    """One non-negative int64 seed drawn from `generator`, on the generator's own device (CPU or CUDA)."""
    return int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device).item())


def shift_right_logical(values: torch.Tensor, bits: int) -> torch.Tensor:  # [...] int64 -> [...] int64
    """`values >>> bits` on the uint64 bit pattern: torch's `>>` on int64 copies the sign bit in, the mask clears it."""
    return (values >> bits) & ((1 << (64 - bits)) - 1)


def counter_uniforms(
    seeds: torch.Tensor,  # [R] int64
    counters: torch.Tensor,  # [R] int64, how many draws row r has used so far
    count: int,
) -> torch.Tensor:  # [R, count] float64 in [0, 1)
    """Draw i of row r is output number counters[r] + i of splitmix64 seeded with seeds[r]: the same numbers whatever
    the other rows hold, in int64 arithmetic that wraps as uint64 does."""
    steps = torch.arange(1, count + 1, dtype=torch.int64, device=seeds.device)  # [count]
    state = seeds[:, None] + (counters[:, None] + steps) * GAMMA  # [R, count] the state after counters[r] + i + 1 steps
    z = (state ^ shift_right_logical(state, 30)) * MIX_1  # [R, count]
    z = (z ^ shift_right_logical(z, 27)) * MIX_2
    z = z ^ shift_right_logical(z, 31)
    return shift_right_logical(z, 11).double() * 2.0**-53  # the top 53 bits, exact in float64


def round_uniforms(
    seeds: torch.Tensor,  # [R] int64
    counters: torch.Tensor,  # [R] int64: the row's draws before this round, a multiple of DRAWS_PER_ROUND
    num_tests: int,
) -> torch.Tensor:  # [R, num_tests + 1] float64: the tests' draws, then the next token's
    """A round's draws for the rule, at the same places of the row's stream on every path (tree passes, fixed-shape
    passes, a captured round): test i takes draw i of the round's block, the next token the block's last draw, so a
    row's draws depend on its seed and its round alone, never on K, W or the path."""
    tests = counter_uniforms(seeds, counters, num_tests)  # [R, num_tests]
    final = counter_uniforms(seeds, counters + (DRAWS_PER_ROUND - 1), 1)  # [R, 1]
    return torch.cat([tests, final], dim=1)


def draft_uniforms(
    seeds: torch.Tensor,  # [R] int64: each row's stream seed
    starts: torch.Tensor,  # [R] int64: the position of the round's first drafted token (the row's length)
    beams: torch.Tensor,  # [R] int64: the beam each row's draws are for
    depth: int,  # K
) -> torch.Tensor:  # [R, K] float64 in [0, 1)
    """A sampling drafter's draws for beam w of a round, the same on every path (tree passes, a captured program):
    draws w * MAX_NUM_DRAFT_TOKENS .. + K - 1 of the round's block of the row's drafting stream (its seed salted apart
    from the rule's), the block set by the round's first position. A row's length grows every round, so no draw is
    used twice, and a draw never meets the rule's."""
    counters = starts * DRAFT_DRAWS + beams * MAX_NUM_DRAFT_TOKENS  # [R]
    return counter_uniforms(seeds ^ DRAFT_SALT, counters, depth)


def row_round_uniforms(seed: int, counter: int, num_tests: int) -> np.ndarray:  # [num_tests + 1] float64
    """round_uniforms for one row, computed on the host in numpy's wrapping uint64 arithmetic: the same bits, for the
    eager rule, where a score of tiny torch calls would cost a CPU round more than the draws are worth."""
    indices = np.append(np.arange(num_tests, dtype=np.uint64), np.uint64(DRAWS_PER_ROUND - 1))  # [num_tests + 1]
    state = np.uint64(seed) + (np.uint64(counter) + indices + np.uint64(1)) * np.uint64(GAMMA % 2**64)
    z = (state ^ (state >> np.uint64(30))) * np.uint64(MIX_1 % 2**64)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(MIX_2 % 2**64)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53


# --- per-row settings ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RowSettings:
    """Each row's SamplingConfig as tensors a captured graph can read; a row with no config is greedy with no
    penalty."""

    greedy: torch.Tensor  # [R] bool
    temperature: torch.Tensor  # [R] float32; 1.0 for greedy rows (dividing by 1.0 changes no bit)
    top_k: torch.Tensor  # [R] int64; 0: off, as in SamplingConfig (a k of V or more keeps everything too)
    top_p_drop: torch.Tensor  # [R] float32: 1 - top_p in double, rounded as torch rounds a Python float it compares
    top_p_on: torch.Tensor  # [R] bool; top_p < 1.0. Off: no top-p step at all, as in transformers
    penalty: torch.Tensor  # [R] float32; 1.0: off (multiplying or dividing by 1.0 changes no bit)

    @classmethod
    def of(cls, samplings: Sequence[SamplingConfig | None], device: torch.device) -> RowSettings:
        greedy = [s is None or s.is_greedy for s in samplings]
        sampled = [None if g else s for g, s in zip(greedy, samplings, strict=True)]
        return cls(
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            temperature=torch.tensor(
                [s.temperature if s else 1.0 for s in sampled], dtype=torch.float32, device=device
            ),
            top_k=torch.tensor([s.top_k if s else 0 for s in sampled], dtype=torch.int64, device=device),
            top_p_drop=torch.tensor([1 - s.top_p if s else 0.0 for s in sampled], dtype=torch.float32, device=device),
            top_p_on=torch.tensor([bool(s and s.top_p < 1.0) for s in sampled], dtype=torch.bool, device=device),
            penalty=torch.tensor(
                [s.repetition_penalty if s else 1.0 for s in samplings], dtype=torch.float32, device=device
            ),
        )

    @staticmethod
    def columns_of(sampling: SamplingConfig) -> tuple[float, ...]:
        """A row's settings as a program's input buffer holds them, in its columns greedy, temperature, top_k,
        top_p_drop, top_p_on and penalty (from_columns reads them back on the device)."""
        return (
            sampling.is_greedy,
            1.0 if sampling.is_greedy else sampling.temperature,
            sampling.top_k,
            1.0 - sampling.top_p,  # in float64, as transformers computes it, then float32 on the device
            sampling.top_p < 1.0,
            sampling.repetition_penalty,
        )

    @classmethod
    def from_columns(cls, column: dict[str, torch.Tensor]) -> RowSettings:
        """The settings a program reads from its input buffer's named float64 columns (each [R])."""
        return cls(
            greedy=column["greedy"].bool(),
            temperature=column["temperature"].float(),
            top_k=column["top_k"].long(),
            top_p_drop=column["top_p_drop"].float(),
            top_p_on=column["top_p_on"].bool(),
            penalty=column["penalty"].float(),
        )

    def copy_into(self, other: RowSettings) -> None:
        """Write these values into `other`'s tensors in place: a captured graph reads the tensors it was captured
        with."""
        for field in fields(self):
            getattr(other, field.name).copy_(getattr(self, field.name))


# --- the repetition penalty's context --------------------------------------------------------------------------------


def seen_along(
    seen: torch.Tensor,  # [R, V] bool: the tokens of each row's sequence, its last token ids[:, 0] included
    ids: torch.Tensor,  # [R, n] int64: the pass's input, ids[:, 0] the sequence's last token, then the draft
    real: torch.Tensor,  # [R, n] bool: False for padding columns
) -> torch.Tensor:  # [R, n, V] bool
    """The tokens position j's context holds: the sequence plus drafted tokens ids[:, 1..j]. Ids outside [0, V) add
    nothing, as transformers' penalty drops them."""
    num_rows, num_columns = ids.shape
    vocab_size = seen.shape[-1]
    columns = torch.arange(num_columns, device=ids.device)  # [n]
    counts = real & (columns > 0) & (ids >= 0) & (ids < vocab_size)  # [R, n] ids[:, 0] is in `seen` already
    # The first column each token is drafted at (n: never); scatter's minimum does not depend on the order of writes.
    first_column = torch.full((num_rows, vocab_size), num_columns, dtype=torch.int64, device=ids.device)  # [R, V]
    first_column.scatter_reduce_(
        1, ids.clamp(0, vocab_size - 1), torch.where(counts, columns, num_columns), reduce="amin"
    )
    return seen[:, None, :] | (first_column[:, None, :] <= columns[None, :, None])


# --- the processors, row by row --------------------------------------------------------------------------------------


def divide_as_by_a_python_float(
    scores: torch.Tensor,  # [R, n, V] float32
    divisors: torch.Tensor,  # [R] float32
) -> torch.Tensor:  # [R, n, V] float32
    """`scores / divisor` as transformers computes it with a Python float: on CUDA torch multiplies by the float32
    reciprocal instead (aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu), which can differ in the last bit."""
    if scores.is_cuda:
        return scores * divisors.reciprocal()[:, None, None]
    return scores / divisors[:, None, None]


def penalised(
    logits: torch.Tensor,  # [R, n, V]
    seen_at: torch.Tensor | None,  # [R, n, V] bool, seen_along's; None: no penalty anywhere
    penalty: torch.Tensor,  # [R] float32
) -> torch.Tensor:  # [R, n, V] float32
    """RepetitionPenaltyLogitsProcessor at every position: a seen token's negative score is multiplied by the
    penalty, any other seen score divided by it."""
    scores = logits.float()
    if seen_at is None:
        return scores
    multiplied = scores * penalty[:, None, None]
    divided = divide_as_by_a_python_float(scores, penalty)
    return torch.where(seen_at, torch.where(scores < 0, multiplied, divided), scores)


def top_k_filtered(
    scores: torch.Tensor,  # [R, n, V] float32
    top_k: torch.Tensor,  # [R] int64; 0: off
) -> torch.Tensor:  # [R, n, V] float32
    """TopKLogitsWarper with each row's k: remove the scores below the row's k-th largest value."""
    vocab_size = scores.shape[-1]
    descending = torch.sort(scores, dim=-1, descending=True).values  # [R, n, V]
    kth = (top_k.clamp(1, vocab_size) - 1)[:, None, None].expand(*scores.shape[:-1], 1)  # [R, n, 1]
    threshold = torch.where(top_k[:, None, None] > 0, descending.gather(-1, kth), -torch.inf)  # [R, n, 1]
    return scores.masked_fill(scores < threshold, -torch.inf)


def top_p_filtered(
    scores: torch.Tensor,  # [R, n, V] float32
    top_p_drop: torch.Tensor,  # [R] float32
    top_p_on: torch.Tensor,  # [R] bool
) -> torch.Tensor:  # [R, n, V] float32
    """TopPLogitsWarper with each row's top_p, step by step as transformers takes it: sort ascending, remove the
    tokens whose cumulative probability is at most 1 - top_p, always keep the largest."""
    ascending, order = torch.sort(scores, descending=False)  # [R, n, V] the same call, so ties fall the same way
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)  # [R, n, V]
    remove = (cumulative <= top_p_drop[:, None, None]) & top_p_on[:, None, None]  # [R, n, V] in sorted order
    remove[..., -1] = False  # min_tokens_to_keep=1
    return scores.masked_fill(remove.scatter(-1, order, remove), -torch.inf)


def one_hot_first_max(scores: torch.Tensor) -> torch.Tensor:  # [R, n, V] float32 -> [R, n, V] float32
    """1.0 at the first maximum of each position: what `one_hot(argmax).float()` gives, in a fixed shape."""
    return torch.zeros_like(scores).scatter_(-1, scores.argmax(dim=-1, keepdim=True), 1.0)


def greedy_ids(
    logits: torch.Tensor,  # [R, n, V]
    seen_at: torch.Tensor | None,  # [R, n, V] bool; None: no penalty
    settings: RowSettings,
) -> torch.Tensor:  # [R, n] int64
    """What greedy decoding picks at each position: the first maximum of the penalised scores."""
    return penalised(logits, seen_at, settings.penalty).argmax(dim=-1)


def processed_probs(
    logits: torch.Tensor,  # [R, n, V]
    seen_at: torch.Tensor | None,  # [R, n, V] bool, seen_along's; None: no penalty anywhere
    settings: RowSettings,
) -> torch.Tensor:  # [R, n, V] float32; one-hot at the first maximum for greedy rows
    """Row r's probabilities exactly as `logits_to_probs` gives them for row r's SamplingConfig: penalty, then
    greedy one-hot or temperature, top-k, top-p and softmax. Every step runs on every row; a step that is off for a
    row changes none of its bits."""
    scores = penalised(logits, seen_at, settings.penalty)  # [R, n, V]
    warped = divide_as_by_a_python_float(scores, settings.temperature)
    warped = top_k_filtered(warped, settings.top_k)
    warped = top_p_filtered(warped, settings.top_p_drop, settings.top_p_on)
    greedy = settings.greedy[:, None, None]  # [R, 1, 1]
    return torch.where(greedy, one_hot_first_max(scores), warped.softmax(dim=-1))
