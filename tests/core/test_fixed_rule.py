"""The rule's per-row sampling in fixed shapes: splitmix64 uniforms bit for bit, each row's probabilities bit for bit
what logits_to_probs gives for that row's own settings, and every function traced whole with no host read."""

# R = chain rows, n = columns of a pass (K+1), T = sequence length, V = vocab_size

from __future__ import annotations

import random

import pytest
import torch

from specdemo.config import SamplingConfig
from specdemo.core.fixed_rule import (
    DRAWS_PER_ROUND,
    RowSettings,
    counter_uniforms,
    greedy_ids,
    processed_probs,
    round_uniforms,
    row_round_uniforms,
    seed_from,
    seen_along,
)
from specdemo.core.sampling import build_warpers, greedy_token_ids, logits_to_probs

NUM_ROWS, NUM_COLUMNS, VOCAB_SIZE, SEQUENCE_LENGTH = 8, 5, 300, 6
GREEDY = SamplingConfig()


def splitmix64(seed: int, index: int) -> float:
    """Output number `index` of splitmix64 seeded with `seed`, in Python ints mod 2^64, as a double in [0, 1)."""
    mask = (1 << 64) - 1
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    z ^= z >> 31
    return (z >> 11) * 2.0**-53


# --- splitmix64 by counter -------------------------------------------------------------------------------------------


def test_counter_uniforms_are_splitmix64_bit_for_bit():
    """Planted bug run: `>>` (arithmetic) instead of shift_right_logical in the first mix step; this test failed."""
    seeds = [0, 1, 2**63 - 1, 2**62 + 12345, 0x5EED, 987654321987654321]
    counters = [0, 3, 2**40, 2**63 - 100, 17, 2**62]
    uniforms = counter_uniforms(torch.tensor(seeds), torch.tensor(counters), 6)  # [R, 6]
    expected = [
        [splitmix64(seed, counter + i) for i in range(6)] for seed, counter in zip(seeds, counters, strict=True)
    ]
    assert uniforms.dtype == torch.float64
    assert uniforms.tolist() == expected


def test_a_row_s_uniforms_depend_on_its_own_seed_and_counter_only():
    """Planted bug run: every row mixed from seeds[:1] instead of its own seed; this test failed."""
    seeds, counters = torch.tensor([5, 6, 7, 8]), torch.tensor([0, 10, 20, 30])
    before = counter_uniforms(seeds, counters, 8)  # [R, 8]
    for row in range(4):
        other_seeds, other_counters = seeds.clone(), counters.clone()
        other_seeds[row] += 1000
        other_counters[row] += 1
        others = [r for r in range(4) if r != row]
        for after in (counter_uniforms(other_seeds, counters, 8), counter_uniforms(seeds, other_counters, 8)):
            assert torch.equal(after[others], before[others])
            assert not torch.equal(after[row], before[row])
    # A counter indexes one stream: two draws on, a row's draws are its earlier draws 2.. .
    assert torch.equal(counter_uniforms(seeds, counters + 2, 6), before[:, 2:])


def test_counter_uniforms_are_uniform_on_the_unit_interval():
    """Planted bug run: `z >> 11` (arithmetic) in the last step, which makes half the draws negative; this test
    failed."""
    uniforms = counter_uniforms(torch.tensor([0, 1, 2**63 - 1, 42]), torch.tensor([0, 0, 5, 2**50]), 50_000)
    uniforms = uniforms.flatten().sort().values  # [200k]
    assert 0.0 <= uniforms[0] and uniforms[-1] < 1.0
    assert abs(uniforms.mean().item() - 0.5) < 0.005
    ranks = torch.arange(1, uniforms.numel() + 1, dtype=torch.float64) / uniforms.numel()  # [200k] the empirical CDF
    assert (ranks - uniforms).abs().max().item() < 0.01  # Kolmogorov-Smirnov distance


def test_seed_from_draws_a_non_negative_int64_from_the_generator():
    seed = seed_from(torch.Generator().manual_seed(7))
    assert isinstance(seed, int) and 0 <= seed < 2**62
    assert seed == seed_from(torch.Generator().manual_seed(7))
    assert seed != seed_from(torch.Generator().manual_seed(8))


# --- per-row settings ------------------------------------------------------------------------------------------------


def test_row_settings_hold_each_row_s_config_and_copy_in_place():
    samplings = [
        SamplingConfig(temperature=0.7, top_k=5, top_p=0.9, repetition_penalty=1.3),
        None,  # an unused row: greedy, no penalty
        SamplingConfig(repetition_penalty=0.8),  # greedy with a penalty
        SamplingConfig(temperature=1.0),
    ]
    settings = RowSettings.of(samplings, torch.device("cpu"))
    assert settings.greedy.tolist() == [False, True, True, False]
    assert settings.temperature.tolist() == [torch.tensor(0.7).item(), 1.0, 1.0, 1.0]
    assert settings.top_k.tolist() == [5, 0, 0, 0]
    assert settings.top_p_on.tolist() == [True, False, False, False]
    assert settings.top_p_drop[0].item() == torch.tensor(1 - 0.9, dtype=torch.float32).item()  # 0.1f, not 0.09999..
    assert settings.penalty.tolist() == [torch.tensor(1.3).item(), 1.0, torch.tensor(0.8).item(), 1.0]

    captured = RowSettings.of([None] * 4, torch.device("cpu"))
    addresses = [captured.greedy.data_ptr(), captured.top_p_drop.data_ptr()]
    settings.copy_into(captured)
    assert [captured.greedy.data_ptr(), captured.top_p_drop.data_ptr()] == addresses
    assert all(torch.equal(getattr(captured, name), getattr(settings, name)) for name in settings.__dataclass_fields__)


# --- the repetition penalty's context --------------------------------------------------------------------------------


def test_position_j_sees_the_sequence_and_the_real_drafted_tokens_up_to_j():
    """Planted bugs run, each failed this test: `first_column < column` (position j without its own input ids[:, j]),
    and `counts` without `real` (padding columns counted)."""
    generator = torch.Generator().manual_seed(3)
    num_rows, num_columns, vocab_size = 6, 7, 20
    ids = torch.randint(-2, vocab_size + 2, (num_rows, num_columns), generator=generator)  # [R, n] some outside V
    ids[:, 0] = torch.randint(vocab_size, (num_rows,), generator=generator)
    real = torch.rand(num_rows, num_columns, generator=generator) < 0.7  # [R, n] padding anywhere
    seen = torch.rand(num_rows, vocab_size, generator=generator) < 0.2  # [R, V]
    seen[torch.arange(num_rows), ids[:, 0]] = True
    seen_at = seen_along(seen, ids, real)  # [R, n, V]
    for r in range(num_rows):
        context = set(seen[r].nonzero().flatten().tolist())
        for j in range(num_columns):
            if j > 0 and real[r, j] and 0 <= ids[r, j] < vocab_size:
                context.add(ids[r, j].item())
            assert set(seen_at[r, j].nonzero().flatten().tolist()) == context, (r, j)


# --- processed probabilities, row by row -----------------------------------------------------------------------------


def random_sampling(rng: random.Random) -> SamplingConfig | None:
    """A row's settings from the grid the equality runs over; None is an unused row."""
    if rng.random() < 0.25:
        return rng.choice([None, GREEDY, SamplingConfig(repetition_penalty=rng.choice([1.3, 0.8]))])
    return SamplingConfig(
        temperature=rng.choice([0.5, 1.0, 1.7]),
        top_k=rng.choice([0, 1, 5, 1000]),  # 1000 > V: off
        top_p=rng.choice([1.0, 0.9, 0.3]),
        repetition_penalty=rng.choice([1.0, 1.3, 0.8]),
    )


def random_pass(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [R, n, V] with ties and -inf, sequences [R, T] (last token = ids[:, 0]), ids [R, n], real [R, n]
    (a real prefix of each row, at least one column)."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(NUM_ROWS, NUM_COLUMNS, VOCAB_SIZE, generator=generator) * (1 + 3 * (seed % 3))
    if seed % 2 == 0:
        logits = (logits * 2).round() / 2  # many exact ties, at the top and at top-p's boundary
    banned = torch.rand(logits.shape, generator=generator) < 0.05
    banned[..., 0] = False  # every position keeps a finite score
    logits = logits.masked_fill(banned, -torch.inf)
    tokens = torch.randint(40, (NUM_ROWS, SEQUENCE_LENGTH + NUM_COLUMNS - 1), generator=generator)  # repeats: penalty
    sequences, ids = tokens[:, :SEQUENCE_LENGTH], tokens[:, SEQUENCE_LENGTH - 1 :]  # ids[:, 0] ends the sequence
    lengths = torch.randint(1, NUM_COLUMNS + 1, (NUM_ROWS,), generator=generator)  # [R]
    real = torch.arange(NUM_COLUMNS) < lengths[:, None]  # [R, n]
    return logits, sequences, ids, real


def seen_of(sequences: torch.Tensor) -> torch.Tensor:  # [R, T] -> [R, V] bool
    return torch.zeros(sequences.shape[0], VOCAB_SIZE, dtype=torch.bool).scatter_(1, sequences, True)


@pytest.mark.parametrize("seed", range(48))
def test_each_row_s_probs_are_logits_to_probs_for_its_own_settings_bit_for_bit(seed):
    """Planted bugs run, each failed this test: top-p's order taken from a sort of the flipped row (ties at the
    boundary fall the other way); top-k's threshold at index k instead of k-1; top-k's 0 not read as off; the penalty
    dividing negative scores too; greedy rows' one-hot at the argmax of the unpenalised logits; the temperature as a
    multiplication by its reciprocal on the CPU (what CUDA does)."""
    rng = random.Random(seed)
    samplings = [random_sampling(rng) for _ in range(NUM_ROWS)]
    logits, sequences, ids, real = random_pass(seed)
    settings = RowSettings.of(samplings, torch.device("cpu"))
    seen_at = seen_along(seen_of(sequences), ids, real)  # [R, n, V]
    probs = processed_probs(logits, seen_at, settings)  # [R, n, V]
    chosen = greedy_ids(logits, seen_at, settings)  # [R, n]
    for r, sampling in enumerate(samplings):
        sampling = sampling or GREEDY
        length = int(real[r].sum())
        row_logits = logits[r : r + 1, :length]  # [1, m, V]
        context = torch.cat([sequences[r], ids[r, 1:length]])[None]  # [1, T+m-1]
        expected = logits_to_probs(row_logits, context, sampling, build_warpers(sampling))  # [1, m, V]
        assert torch.equal(probs[r, :length], expected[0]), (r, sampling)
        assert torch.equal(chosen[r, :length], greedy_token_ids(row_logits, context, sampling)[0]), (r, sampling)


def test_top_p_compares_with_one_minus_top_p_rounded_to_float32():
    """Ten equal tokens: the first cumulative probability is 0.1f, equal to float32(1 - 0.9) but above the double
    0.0999..., so transformers drops one of the ten. Planted bugs run, each failed this test: top_p_drop kept as
    float64; `cumulative < top_p_drop` for `<=`."""
    logits = torch.full((2, 1, 20), -torch.inf)
    logits[:, :, :10] = 0.0
    sampling = SamplingConfig(temperature=1.0, top_p=0.9)
    probs = processed_probs(logits, None, RowSettings.of([sampling, None], torch.device("cpu")))  # [R, 1, V]
    expected = logits_to_probs(logits[:1], torch.zeros(1, 1, dtype=torch.int64), sampling, build_warpers(sampling))
    assert torch.equal(probs[:1], expected)
    assert int((probs[0, 0] > 0).sum()) == 9
    assert torch.equal(probs[1, 0], torch.eye(20)[0])  # the unused row: greedy, the first of the tied maxima


def test_without_a_context_no_row_is_penalised():
    """Planted bug run: penalised() applying the penalty everywhere when seen_at is None; this test failed."""
    logits, _, _, _ = random_pass(1)
    samplings = [SamplingConfig(temperature=t, repetition_penalty=1.3) for t in (0.0, 0.5, 1.0, 1.7)] * 2
    unpenalised = [SamplingConfig(temperature=s.temperature) for s in samplings]
    probs = processed_probs(logits, None, RowSettings.of(samplings, torch.device("cpu")))
    expected = processed_probs(logits, None, RowSettings.of(unpenalised, torch.device("cpu")))
    assert torch.equal(probs, expected)
    context = torch.zeros(1, SEQUENCE_LENGTH + NUM_COLUMNS - 1, dtype=torch.int64)
    for r, sampling in enumerate(unpenalised):
        assert torch.equal(probs[r], logits_to_probs(logits[r : r + 1], context, sampling, build_warpers(sampling))[0])


# --- fixed shapes: traced whole --------------------------------------------------------------------------------------


def traced(fn):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="eager")


def example_arguments(device: torch.device) -> tuple:
    """logits [R, n, V], seen [R, V], ids [R, n], real [R, n] and settings of mixed rows, on `device`."""
    rng = random.Random(5)
    logits, sequences, ids, real = random_pass(5)
    settings = RowSettings.of([random_sampling(rng) for _ in range(NUM_ROWS)], device)
    return logits.to(device), seen_of(sequences).to(device), ids.to(device), real.to(device), settings


def test_every_function_traces_whole():
    """fullgraph=True fails on a graph break, such as a Python branch on a tensor's value. Planted bug run:
    `if bool((top_k > 0).any()):` around top_k_filtered's threshold; this test failed."""
    logits, seen, ids, real, settings = example_arguments(torch.device("cpu"))
    seen_at = seen_along(seen, ids, real)
    seeds, counters = torch.tensor([3, 2**63 - 1]), torch.tensor([0, 2**40])
    assert torch.equal(traced(counter_uniforms)(seeds, counters, 9), counter_uniforms(seeds, counters, 9))
    assert torch.equal(traced(seen_along)(seen, ids, real), seen_at)
    assert torch.equal(traced(greedy_ids)(logits, seen_at, settings), greedy_ids(logits, seen_at, settings))
    for context in (seen_at, None):
        assert torch.equal(
            traced(processed_probs)(logits, context, settings), processed_probs(logits, context, settings)
        )


def test_every_function_runs_on_the_meta_device_so_reads_nothing_on_the_host():
    """A meta tensor has a shape and no values: .item(), .tolist(), bool(t), nonzero and boolean-mask indexing all
    raise on it (this torch's fullgraph trace captures .item() and nonzero without a break, so the trace alone would
    not see them). Planted bug run: `int(top_k.max())` as top_k_filtered's clamp bound; this test failed."""
    meta = torch.device("meta")
    logits, seen, ids, real, settings = example_arguments(meta)
    seen_at = seen_along(seen, ids, real)
    assert seen_at.shape == (NUM_ROWS, NUM_COLUMNS, VOCAB_SIZE)
    assert greedy_ids(logits, seen_at, settings).shape == (NUM_ROWS, NUM_COLUMNS)
    for context in (seen_at, None):
        assert processed_probs(logits, context, settings).shape == (NUM_ROWS, NUM_COLUMNS, VOCAB_SIZE)
    seeds = torch.zeros(NUM_ROWS, dtype=torch.int64, device=meta)
    assert counter_uniforms(seeds, seeds, 9).shape == (NUM_ROWS, 9)


# --- on a GPU --------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_cuda_each_row_s_probs_are_logits_to_probs_bit_for_bit():
    """On CUDA torch divides by a Python float as a multiplication by its float32 reciprocal; processed_probs must
    follow it there, and the uniforms must be the CPU's."""
    cuda = torch.device("cuda")
    seeds, counters = torch.tensor([0, 2**63 - 1]), torch.tensor([5, 2**40])
    assert torch.equal(
        counter_uniforms(seeds.to(cuda), counters.to(cuda), 64).cpu(), counter_uniforms(seeds, counters, 64)
    )
    for seed in range(16):
        rng = random.Random(seed)
        samplings = [random_sampling(rng) for _ in range(NUM_ROWS)]
        logits, sequences, ids, real = (t.to(cuda) for t in random_pass(seed))
        seen_at = seen_along(seen_of(sequences.cpu()).to(cuda), ids, real)
        probs = processed_probs(logits, seen_at, RowSettings.of(samplings, cuda))
        for r, sampling in enumerate(samplings):
            sampling = sampling or GREEDY
            length = int(real[r].sum())
            context = torch.cat([sequences[r], ids[r, 1:length]])[None]
            expected = logits_to_probs(logits[r : r + 1, :length], context, sampling, build_warpers(sampling))
            assert torch.equal(probs[r, :length], expected[0]), (seed, r, sampling)


@pytest.mark.parametrize("seed", [0, 1, 987_654_321, 2**53 - 1])
def test_a_rows_round_draws_on_the_host_are_the_devices_bit_for_bit(seed: int) -> None:
    """row_round_uniforms (numpy, for the eager rule) gives round_uniforms' bits (torch, for a captured round), for
    rounds far into a stream too, so a row's text does not depend on which path decided its rounds. Planted: the
    host's stream one step behind (state without the + 1); it fails."""
    for counter in (0, DRAWS_PER_ROUND, 7 * DRAWS_PER_ROUND, 2**40):
        for num_tests in (0, 3, 16, 48):
            host = row_round_uniforms(seed, counter, num_tests)
            device = round_uniforms(torch.tensor([seed]), torch.tensor([counter]), num_tests)[0]
            assert torch.equal(torch.from_numpy(host), device), (counter, num_tests)
