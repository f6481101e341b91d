"""Logits become the probabilities generate() would sample from, position by position, and draws are exact."""

# B = batch, N = positions scored in one pass, T = context length, V = vocab_size

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specdemo.audit import chi_square_pvalue, tv_distance
from specdemo.config import SamplingConfig
from specdemo.core.sampling import build_warpers, draw_uniforms, greedy_token_ids, logits_to_probs, sample_from_probs

MAX_TV = 0.01
MIN_P_VALUE = 1e-4


def generate_step(model, context_ids: torch.Tensor, sampling: SamplingConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """One sampled step of model.generate() on context_ids [B, T], through its public outputs: the raw logits it
    read [B, V] and the probabilities it sampled from [B, V] (its processed scores, softmaxed)."""
    with torch.inference_mode():
        output = model.generate(
            context_ids,
            attention_mask=torch.ones_like(context_ids),
            do_sample=True,
            max_new_tokens=1,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            repetition_penalty=sampling.repetition_penalty,
            output_logits=True,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=1,
        )
    return output.logits[0], output.scores[0].softmax(dim=-1)


def generate_positions(
    model, context_ids: torch.Tensor, num_positions: int, sampling: SamplingConfig
) -> tuple[torch.Tensor, torch.Tensor]:  # context_ids [B, T+N-1] -> logits [B, N, V], probs [B, N, V]
    """What generate() reads and samples from at each of the last N positions, position i on context_ids[:, :T+i]."""
    start = context_ids.shape[1] - num_positions + 1  # T
    steps = [generate_step(model, context_ids[:, : start + i], sampling) for i in range(num_positions)]
    return torch.stack([logits for logits, _ in steps], dim=1), torch.stack([probs for _, probs in steps], dim=1)


def kept_tokens(logits: torch.Tensor, sampling: SamplingConfig) -> set[int]:  # logits [V]
    """The tokens temperature -> top-k -> top-p keep, computed from their definitions (no transformers)."""
    scaled = logits.double() / sampling.temperature
    ranked = scaled.argsort(descending=True)  # [V]
    if sampling.top_k > 0:
        ranked = ranked[: sampling.top_k]
    probs = scaled[ranked].softmax(dim=-1)  # top-p reads the distribution that top-k left, renormalised
    mass_before = probs.cumsum(dim=-1) - probs
    return set(ranked[mass_before < sampling.top_p].tolist())  # the smallest prefix holding top_p of the mass


def context_for(logits: torch.Tensor, seed: int = 0) -> torch.Tensor:  # [B, N, V] -> [B, T+N-1]
    batch_size, num_positions, vocab_size = logits.shape
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(vocab_size, (batch_size, 3 + num_positions - 1), generator=generator)


# --- greedy ---------------------------------------------------------------------------------------------------------


def test_greedy_is_one_hot_at_the_first_maximum_of_every_position():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=generator)  # [B, N, V]
    logits[0, 1, [7, 3]] = 9.0  # a tie: the first index, 3, wins
    logits[1, 4, [9, 2, 10]] = 9.0  # a three-way tie: 2 wins
    logits[1, 0, [0, 10]] = 9.0  # ties at both ends: 0 wins
    sampling = SamplingConfig(temperature=0.0)
    probs = logits_to_probs(logits, context_for(logits), sampling, build_warpers(sampling))
    assert probs.dtype == torch.float32
    for b in range(2):
        for i in range(5):
            row = logits[b, i].tolist()
            first_maximum = row.index(max(row))
            assert probs[b, i].tolist() == torch.nn.functional.one_hot(torch.tensor(first_maximum), 11).tolist()
    assert [int(probs[0, 1].argmax()), int(probs[1, 4].argmax()), int(probs[1, 0].argmax())] == [3, 2, 0]


def test_greedy_takes_the_first_maximum_over_a_whole_vocabulary():
    """The same at the offline model's width, where the kernels reduce in vector lanes: ties in every row, across
    lanes and within one. Planted: the last maximum taken."""
    generator = torch.Generator().manual_seed(1)
    logits = torch.randint(0, 3, (3, 17, 49_152), generator=generator).float()  # [B, N, V]: 2 ties thousands of times
    logits[0, 0, -1] = 5.0  # a lone maximum at the end
    positions = torch.arange(logits.shape[-1]).expand_as(logits)
    first = positions.masked_fill(logits != logits.amax(dim=-1, keepdim=True), logits.shape[-1]).amin(dim=-1)
    chosen = greedy_token_ids(logits, context_for(logits), SamplingConfig(temperature=0.0))
    assert torch.equal(chosen, first)


def test_greedy_builds_no_warpers():
    assert len(build_warpers(SamplingConfig(temperature=0.0, top_k=5, top_p=0.5))) == 0


# --- temperature, top-k, top-p ------------------------------------------------------------------------------------

WARPER_SETTINGS = [
    SamplingConfig(temperature=0.7),
    SamplingConfig(temperature=1.0, top_k=5),
    SamplingConfig(temperature=1.0, top_p=0.8),
    SamplingConfig(temperature=1.3, top_k=10, top_p=0.9),
    SamplingConfig(temperature=0.5, top_k=40, top_p=0.6),  # top_k above the vocabulary keeps everything
    SamplingConfig(temperature=2.0, top_k=3, top_p=0.5),
]


@pytest.mark.parametrize("sampling", WARPER_SETTINGS, ids=repr)
def test_probs_equal_what_generate_samples_from(tiny_target, sampling):
    context_ids = torch.randint(32, (2, 3 + 4 - 1), generator=torch.Generator().manual_seed(1))  # [B, T+N-1]
    logits, expected = generate_positions(tiny_target, context_ids, 4, sampling)  # [B, N, V] each
    probs = logits_to_probs(logits, context_ids, sampling, build_warpers(sampling))
    assert torch.allclose(probs, expected, rtol=1e-6, atol=1e-8)
    assert torch.allclose(probs.sum(dim=-1), torch.ones(2, 4))
    for b in range(2):
        for i in range(4):
            kept = kept_tokens(logits[b, i], sampling)
            assert set(probs[b, i].nonzero().flatten().tolist()) == kept, (b, i)  # exactly 0 outside the kept set


def test_temperature_applies_before_top_p():
    sampling = SamplingConfig(temperature=0.5, top_p=0.9)
    logits = torch.tensor([[[3.0, 2.0, 1.0, 0.0]]])  # [1, 1, V]
    probs = logits_to_probs(logits, torch.zeros(1, 0, dtype=torch.long), sampling, build_warpers(sampling))
    # at temperature 0.5 the top two hold 0.982 of the mass: top-p keeps 2 tokens
    # (top-p before temperature would keep 3: the raw top two hold only 0.881)
    assert probs[0, 0, 2:].tolist() == [0.0, 0.0]
    assert torch.allclose(probs[0, 0, :2].double(), torch.tensor([6.0, 4.0], dtype=torch.float64).softmax(dim=-1))


def test_top_p_reads_the_distribution_top_k_left():
    sampling = SamplingConfig(temperature=1.0, top_k=2, top_p=0.6)
    logits = torch.tensor([0.5, 0.3, 0.2]).log()[None, None]  # [1, 1, V]
    probs = logits_to_probs(logits, torch.zeros(1, 0, dtype=torch.long), sampling, build_warpers(sampling))
    # top-k leaves 0.625 / 0.375, and 0.625 >= 0.6 already: only token 0 survives
    # (top-p on the raw 0.5 / 0.3 / 0.2 would keep two tokens)
    assert probs[0, 0].tolist() == [1.0, 0.0, 0.0]


# --- repetition penalty, per position -------------------------------------------------------------------------------


def penalty_case() -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows, K=3 drafts [4, 6, 5]; token 6 (the second draft) is in row 1's prompt but not in row 0's."""
    prefix = torch.tensor([[1, 2, 3], [6, 2, 3]])  # [B, T]
    drafts = torch.tensor([[4, 6, 5], [4, 6, 5]])  # [B, K]
    context_ids = torch.cat([prefix, drafts], dim=1)  # [B, T+K]
    row = torch.linspace(-1.0, 1.0, 10)  # [V]
    row[6], row[8] = 2.0, 1.5  # 6 leads until penalised: 2.0 / 1.5 = 1.33 < 1.5, then 8 leads
    logits = row.expand(2, 4, 10).clone()  # [B, K+1, V] the same scores at every position
    return logits, context_ids


def test_repetition_penalty_reads_only_each_positions_own_prefix_greedy():
    logits, context_ids = penalty_case()
    sampling = SamplingConfig(temperature=0.0, repetition_penalty=1.5)
    probs = logits_to_probs(logits, context_ids, sampling, build_warpers(sampling))
    assert probs.argmax(dim=-1).tolist() == [
        [6, 6, 8, 8],  # positions 0 and 1 have not seen draft 6 yet; positions 2 and 3 have
        [8, 8, 8, 8],  # 6 is in this row's prompt: penalised everywhere
    ]


def test_repetition_penalty_reads_only_each_positions_own_prefix_sampled():
    logits, context_ids = penalty_case()
    sampling = SamplingConfig(temperature=1.0, repetition_penalty=1.5)
    probs = logits_to_probs(logits, context_ids, sampling, build_warpers(sampling))
    # token 8 is never in a context, so p(6) / p(8) shows whether 6 was penalised at each position
    ratio = (probs[0, :, 6] / probs[0, :, 8]).double()  # [K+1]
    unpenalised, penalised = torch.tensor(0.5).exp(), torch.tensor(2.0 / 1.5 - 1.5).exp()
    assert torch.allclose(ratio, torch.stack([unpenalised, unpenalised, penalised, penalised]).double(), rtol=1e-5)


def test_sampled_settings_with_everything_on_equal_generate(tiny_target):
    """Per position, with the penalty reading each position's own prefix, as generate() does step by step."""
    sampling = SamplingConfig(temperature=0.8, top_k=12, top_p=0.9, repetition_penalty=1.3)
    context_ids = torch.randint(8, (3, 4 + 5), generator=torch.Generator().manual_seed(2))  # [B, T+K] repeats
    logits, expected = generate_positions(tiny_target, context_ids, 6, sampling)  # [B, K+1, V] each
    probs = logits_to_probs(logits, context_ids, sampling, build_warpers(sampling))
    assert torch.allclose(probs, expected, rtol=1e-6, atol=1e-8)
    assert torch.equal(probs == 0, expected == 0)
    unpenalised = replace(sampling, repetition_penalty=1.0)
    assert not torch.allclose(probs, logits_to_probs(logits, context_ids, unpenalised, build_warpers(unpenalised)))


def test_whole_number_settings_work_like_floats():
    """transformers' warpers refuse int temperature or penalty; SamplingConfig stores them as floats."""
    logits = torch.randn(1, 2, 8, generator=torch.Generator().manual_seed(3))
    context_ids = torch.tensor([[1, 2, 3]])
    as_ints = SamplingConfig(temperature=2, repetition_penalty=2)
    as_floats = SamplingConfig(temperature=2.0, repetition_penalty=2.0)
    expected = logits_to_probs(logits, context_ids, as_floats, build_warpers(as_floats))
    assert torch.equal(logits_to_probs(logits, context_ids, as_ints, build_warpers(as_ints)), expected)


# --- exact draws -----------------------------------------------------------------------------------------------------

JUST_BELOW_ONE = float(torch.nextafter(torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64)))


def draw(weights: list[float], u: float) -> int:
    return int(sample_from_probs(torch.tensor([weights], dtype=torch.float64), torch.tensor([u], dtype=torch.float64)))


def test_sample_from_probs_never_returns_a_zero_weight_token():
    weights = [0.0, 0.0, 0.3, 0.0, 0.7, 0.0, 0.0]
    assert draw(weights, 0.0) == 2  # not 0 or 1, whose cumulative weight is still 0
    assert draw(weights, 0.3) == 4  # the cdf steps to 0.3 at token 2, so u = 0.3 is already past it
    assert draw(weights, JUST_BELOW_ONE) == 4  # not the zero-weight tail 5, 6, nor V
    # a subnormal total: u * total rounds up to the total itself, and only the nextafter guard keeps the draw at 1
    assert draw([0.0, 5e-324, 0.0], JUST_BELOW_ONE) == 1


def test_sample_from_probs_reads_unnormalised_weights():
    weights = [0.0, 3.0, 0.0, 5.0, 0.0]  # token 1 for u < 3/8, token 3 after
    assert [draw(weights, u) for u in (0.0, 0.374, 0.375, 0.9, JUST_BELOW_ONE)] == [1, 1, 3, 3, 3]


def test_sample_from_probs_on_random_sparse_weights_at_the_extreme_uniforms():
    generator = torch.Generator().manual_seed(4)
    num_rows, vocab_size = 3000, 20
    scale = 10.0 ** torch.randint(-30, 1, (num_rows, vocab_size), generator=generator)  # wide dynamic range
    weights = torch.rand(num_rows, vocab_size, generator=generator) * scale  # [B, V]
    weights[torch.rand(num_rows, vocab_size, generator=generator) < 0.7] = 0.0
    weights[weights.sum(dim=-1) == 0, 0] = 1.0  # every row has some mass
    for dtype in (torch.float32, torch.float64):
        for u in (0.0, JUST_BELOW_ONE, 0.5):
            tokens = sample_from_probs(weights.to(dtype), torch.full((num_rows,), u, dtype=torch.float64))
            assert bool(((tokens >= 0) & (tokens < vocab_size)).all())
            assert bool((weights.to(dtype).gather(-1, tokens[:, None]) > 0).all()), (dtype, u)


def test_sample_from_probs_follows_the_weights():
    weights = torch.tensor([0.0, 2.0, 0.0, 5.0, 1.0, 0.0, 0.5, 1.5, 0.0, 0.25])  # [V] unnormalised, zeros inside
    num_draws = 100_000
    uniforms = torch.rand(num_draws, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    tokens = sample_from_probs(weights.expand(num_draws, -1), uniforms)  # [N]
    counts = torch.bincount(tokens, minlength=weights.numel())
    assert int(counts[weights == 0].sum()) == 0
    assert tv_distance(counts, weights) < MAX_TV
    assert chi_square_pvalue(counts, weights) > MIN_P_VALUE


def row_generators(seeds: list[int]) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed) for seed in seeds]


def test_draw_uniforms_row_depends_only_on_its_own_generator():
    first = draw_uniforms(row_generators([10, 11, 12]), 3, 5, torch.device("cpu"))  # [B, 5]
    changed = draw_uniforms(row_generators([10, 99, 12]), 3, 5, torch.device("cpu"))
    assert first.dtype == torch.float64 and first.shape == (3, 5)
    assert bool(((first >= 0) & (first < 1)).all())
    assert torch.equal(first[[0, 2]], changed[[0, 2]])
    assert not bool((first[1] == changed[1]).any())
    for row, seed in enumerate([10, 11, 12]):
        alone = torch.rand(5, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(first[row], alone)
    with pytest.raises(AssertionError):
        draw_uniforms(row_generators([1, 2]), 3, 5, torch.device("cpu"))
