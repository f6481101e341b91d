"""Modified rejection sampling is lossless, formats its rounds as documented, and is reproducible row by row."""

# B = batch, K = num_draft_tokens, V = vocab_size, N = rows in a statistical test

from __future__ import annotations

import math

import pytest
import torch

import specdemo.core.verify as rejection_module
from specdemo.audit import chi_square_pvalue, tv_distance
from specdemo.config import SamplingConfig
from specdemo.core.sampling import build_warpers, logits_to_probs
from specdemo.core.verify import (
    PADDING_ID,
    RejectionResult,
    rejection_sample,
    residual_probs,
)
from tests.reference import reference_rejection_sample

NUM_ROWS = 100_000  # rows in one batched call; sampling noise then keeps TV near 0.003
MAX_TV = 0.01
MIN_P_VALUE = 1e-4
MIN_ROWS_PER_POSITION = 40_000  # a deeper position is reached by fewer rows; below this TV noise nears MAX_TV
BUGGY_TV = 0.05  # what the deliberately wrong samplers must exceed at some position


def emitted_at(result: RejectionResult, position: int) -> torch.Tensor:  # [rows that reached position]
    """Tokens emitted at `position`: an accepted draft there, or the resampled/bonus token when it stops there."""
    return result.token_ids[result.num_accepted >= position, position]


def position_fits(result: RejectionResult, target_probs: torch.Tensor) -> list[dict]:  # target_probs [K+1, V]
    """Per position j: rows that emitted a token there, its TV and chi-square p-value against p_j, and how many
    tokens with p_j = 0 were emitted. When p and q do not depend on the prefix, the token emitted at j follows p_j."""
    vocab_size = target_probs.shape[-1]
    fits = []
    for position, probs in enumerate(target_probs):
        counts = torch.bincount(emitted_at(result, position), minlength=vocab_size)  # [V]
        fits.append(
            {
                "position": position,
                "rows": int(counts.sum()),
                "tv": tv_distance(counts, probs),
                "p_value": chi_square_pvalue(counts, probs),
                "impossible": int(counts[probs == 0].sum()),
            }
        )
    return fits


def distribution_failures(result: RejectionResult, target_probs: torch.Tensor) -> list[str]:
    """Why the emitted tokens do not follow the target position by position; empty when they do."""
    failures = []
    for fit in position_fits(result, target_probs):
        if fit["impossible"]:
            failures.append(f"{fit}: emitted tokens that the target gives probability 0")
        if fit["tv"] >= MAX_TV:
            failures.append(f"{fit}: TV >= {MAX_TV}")
        if fit["p_value"] <= MIN_P_VALUE:
            failures.append(f"{fit}: chi-square p-value <= {MIN_P_VALUE}")
    return failures


# --- toy distributions --------------------------------------------------------------------------------------------


def normalise(probs: torch.Tensor) -> torch.Tensor:
    return probs / probs.sum(dim=-1, keepdim=True)


def perturbed_setting(num_draft_tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """p and q in float64 from nearby random logits, differing per position, with p = 0 < q and q = 0 < p tokens.

    Returns target_probs [K+1, V] and draft_probs [K, V], the same for every prefix.
    """
    num_positions, vocab_size = num_draft_tokens, 12
    generator = torch.Generator().manual_seed(seed)
    target_logits = 1.5 * torch.randn(num_positions + 1, vocab_size, generator=generator, dtype=torch.float64)
    noise = 0.4 * torch.randn(num_positions, vocab_size, generator=generator, dtype=torch.float64)
    target_probs = target_logits.softmax(dim=-1)  # [K+1, V]
    draft_probs = (target_logits[:num_positions] + noise).softmax(dim=-1)  # [K, V] a drafter close to the target
    least_likely = target_probs[:num_positions].argsort(dim=-1)  # [K, V]
    positions = torch.arange(num_positions)
    target_probs[positions, least_likely[:, 0]] = 0.0  # p = 0 < q: a token the drafter proposes, the target refuses
    draft_probs[positions, least_likely[:, 1]] = 0.0  # q = 0 < p: only a resample can emit this token
    target_probs[num_positions, target_probs[num_positions].argmin()] = 0.0  # the bonus position has a zero too
    return normalise(target_probs), normalise(draft_probs)


TARGET_SAMPLING = SamplingConfig(temperature=0.9, top_k=13, top_p=0.97)  # cuts 3 or more of 16 tokens
DRAFT_SAMPLING = SamplingConfig(temperature=1.0, top_k=14)  # cuts 2: the drafter proposes tokens the target cut


def processed_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:  # [1, N, V] -> [1, N, V]
    """logits_to_probs without a repetition penalty: the context is never read, so p does not depend on the prefix."""
    context_ids = torch.zeros(1, logits.shape[1], dtype=torch.long)  # [1, T+N-1] with T = 1
    return logits_to_probs(logits, context_ids, sampling, build_warpers(sampling))


def filtered_setting(num_draft_tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """p and q from logits_to_probs with different temperature / top-k / top-p, so the filters decide the zeros.

    Returns target_probs [K+1, V] and draft_probs [K, V] in float32, as the models' processed logits are.
    """
    num_positions, vocab_size = num_draft_tokens, 16
    generator = torch.Generator().manual_seed(seed)
    target_logits = 1.5 * torch.randn(1, num_positions + 1, vocab_size, generator=generator)  # [1, K+1, V]
    noise = 0.3 * torch.randn(1, num_positions, vocab_size, generator=generator)  # a drafter is another model
    target_probs = processed_probs(target_logits, TARGET_SAMPLING)  # [1, K+1, V]
    draft_probs = processed_probs(target_logits[:, :num_positions] + noise, DRAFT_SAMPLING)  # [1, K, V]
    return target_probs[0], draft_probs[0]


SETTINGS = {"perturbed": perturbed_setting, "filtered": filtered_setting}


def sample_rounds(
    target_probs: torch.Tensor,  # [K+1, V] the same for every row
    draft_probs: torch.Tensor,  # [K, V]
    num_rows: int = NUM_ROWS,
    seed: int = 0,
) -> tuple[torch.Tensor, RejectionResult]:  # draft_token_ids [N, K], result
    """One batched round per row: drafts sampled from q, then verified against p in a single call."""
    num_positions, vocab_size = draft_probs.shape
    generator = torch.Generator().manual_seed(seed)
    if num_positions == 0:
        draft_token_ids = torch.zeros(num_rows, 0, dtype=torch.long)
    else:
        draft_token_ids = torch.multinomial(draft_probs, num_rows, replacement=True, generator=generator).T
    result = rejection_sample(
        draft_token_ids,
        draft_probs.expand(num_rows, num_positions, vocab_size),
        target_probs.expand(num_rows, num_positions + 1, vocab_size),
        generator=generator,
    )
    return draft_token_ids, result


def assert_setting_is_informative(target_probs: torch.Tensor, draft_probs: torch.Tensor, result: RejectionResult):
    """Guards the test itself: enough rows reach every position, and the zeros it claims to cover are there."""
    refused = (target_probs[:-1] == 0) & (draft_probs > 0)  # [K, V] p = 0 < q
    assert bool(refused.any()), "no draft token the target refuses: the test would not cover p = 0 < q"
    for position in range(target_probs.shape[0]):
        rows = int((result.num_accepted >= position).sum())
        assert rows >= MIN_ROWS_PER_POSITION, f"only {rows} rows reach position {position}"


# --- the output distribution ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_draft_tokens", [1, 3, 5])
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_emitted_tokens_follow_the_target_at_every_position(setting, num_draft_tokens):
    target_probs, draft_probs = SETTINGS[setting](num_draft_tokens)
    _, result = sample_rounds(target_probs, draft_probs)
    assert_setting_is_informative(target_probs, draft_probs, result)
    assert distribution_failures(result, target_probs) == []


def test_tokens_the_drafter_never_proposes_are_still_emitted_by_resampling():
    target_probs, draft_probs = perturbed_setting(num_draft_tokens=3)
    never_drafted = (draft_probs == 0) & (target_probs[:-1] > 0)  # [K, V] q = 0 < p
    assert bool(never_drafted.any(dim=-1).all()), "every draft position should have a token with q = 0 < p"
    _, result = sample_rounds(target_probs, draft_probs)
    for position in range(3):
        emitted = emitted_at(result, position)
        reachable_only_by_resample = never_drafted[position].nonzero().flatten()
        assert bool(torch.isin(emitted, reachable_only_by_resample).any()), f"position {position} never resampled"


def resample_from_target(monkeypatch):
    """Classic bug: after a rejection, draw from p instead of norm(max(0, p - q))."""
    monkeypatch.setattr(rejection_module, "residual_probs", lambda target_probs, draft_probs: target_probs.clone())


def always_accept(monkeypatch):
    """Classic bug: emit every draft token, then the bonus from p_K."""
    monkeypatch.setattr(
        rejection_module, "first_rejection_index", lambda accepted: torch.full(accepted.shape[:1], accepted.shape[1])
    )


@pytest.mark.parametrize("num_draft_tokens", [3, 5])
@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("inject_bug", [resample_from_target, always_accept], ids=lambda bug: bug.__name__)
def test_the_distribution_check_catches_a_wrong_sampler(monkeypatch, inject_bug, setting, num_draft_tokens):
    target_probs, draft_probs = SETTINGS[setting](num_draft_tokens)
    inject_bug(monkeypatch)
    _, result = sample_rounds(target_probs, draft_probs)
    assert distribution_failures(result, target_probs) != []
    worst_tv = max(fit["tv"] for fit in position_fits(result, target_probs))
    assert worst_tv > BUGGY_TV, f"the wrong sampler is only {worst_tv:.4f} away from the target"


# --- acceptance rate ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_draft_tokens", [1, 3, 5])
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_acceptance_rate_is_the_overlap_of_target_and_draft(setting, num_draft_tokens):
    target_probs, draft_probs = SETTINGS[setting](num_draft_tokens)
    _, result = sample_rounds(target_probs, draft_probs)
    overlap = torch.minimum(target_probs[:-1].double(), draft_probs.double()).sum(dim=-1)  # [K] sum_x min(p, q)
    for position, expected in enumerate(overlap.tolist()):
        reached = result.num_accepted >= position  # [N] rows that tested draft token `position`
        accepted = result.num_accepted[reached] > position
        standard_error = math.sqrt(expected * (1 - expected) / int(reached.sum()))
        rate = float(accepted.double().mean())
        assert abs(rate - expected) < 4 * standard_error, f"position {position}: rate {rate}, expected {expected}"
        # acceptance_probs = min(1, p/q) at the draft token, whose mean under q is the same overlap
        reported = result.acceptance_probs[:, position]  # [N]
        standard_error = float(reported.std()) / math.sqrt(reported.numel())
        assert abs(float(reported.mean()) - expected) < 4 * standard_error


# --- output format ---------------------------------------------------------------------------------------------------

VOCAB_SIZE = 6


def one_hot(token: int) -> torch.Tensor:  # [V]
    return torch.nn.functional.one_hot(torch.tensor(token), VOCAB_SIZE).double()


def weights(**token_probs: float) -> torch.Tensor:  # [V], e.g. weights(t0=0.4, t3=0.6)
    probs = torch.zeros(VOCAB_SIZE, dtype=torch.float64)
    for name, prob in token_probs.items():
        probs[int(name[1:])] = prob
    return probs


def verify_one_row(draft_ids: list[int], draft_rows: list[torch.Tensor], target_rows: list[torch.Tensor], seed=0):
    """rejection_sample on a batch of one hand-built row."""
    return rejection_sample(
        torch.tensor([draft_ids]),
        torch.stack(draft_rows)[None],
        torch.stack(target_rows)[None],
        generator=torch.Generator().manual_seed(seed),
    )


@pytest.mark.parametrize("seed", range(5))
def test_all_drafts_accepted_then_bonus(seed):
    result = verify_one_row(
        [2, 4, 1],
        [one_hot(2), weights(t4=0.5, t0=0.5), one_hot(1)],
        [
            one_hot(2),  # accepts 2: p = q = 1
            weights(t4=0.7, t3=0.3),  # accepts 4: p = 0.7 >= q = 0.5, so u * q < p for every u < 1
            weights(t1=1.0),  # accepts 1
            one_hot(5),  # bonus 5, drawn from p_K
        ],
        seed,
    )
    assert result.token_ids.tolist() == [[2, 4, 1, 5]]
    assert result.num_accepted.tolist() == [3]
    assert result.next_token_ids.tolist() == [5]
    assert result.target_draft_probs.tolist() == [[1.0, 0.7, 1.0]]
    assert result.draft_draft_probs.tolist() == [[1.0, 0.5, 1.0]]
    assert result.acceptance_probs.tolist() == [[1.0, 1.0, 1.0]]


@pytest.mark.parametrize("seed", range(5))
def test_first_draft_rejected_then_one_resampled_token_then_padding(seed):
    result = verify_one_row(
        [2, 4, 1],
        [weights(t2=0.6, t0=0.4), one_hot(4), one_hot(1)],
        [
            weights(t0=0.4, t3=0.6),  # rejects 2: p = 0; resamples 3, the only token with p > q
            one_hot(4),  # never reached
            one_hot(1),
            one_hot(5),
        ],
        seed,
    )
    assert result.token_ids.tolist() == [[3, PADDING_ID, PADDING_ID, PADDING_ID]]
    assert result.num_accepted.tolist() == [0]
    assert result.next_token_ids.tolist() == [3]
    assert result.acceptance_probs[0, 0] == 0.0


@pytest.mark.parametrize("seed", range(5))
def test_accepted_prefix_then_resampled_token_then_padding(seed):
    result = verify_one_row(
        [2, 4, 1],
        [one_hot(2), weights(t4=0.6, t0=0.4), one_hot(1)],
        [
            one_hot(2),  # accepts 2
            weights(t0=0.4, t3=0.6),  # rejects 4: p = 0; resamples 3 (token 0 has p = q, so no residual)
            one_hot(1),  # never reached
            one_hot(5),
        ],
        seed,
    )
    assert result.token_ids.tolist() == [[2, 3, PADDING_ID, PADDING_ID]]
    assert result.num_accepted.tolist() == [1]
    assert result.next_token_ids.tolist() == [3]


def test_every_row_is_accepted_prefix_then_one_token_then_padding():
    target_probs, draft_probs = perturbed_setting(num_draft_tokens=5)
    draft_token_ids, result = sample_rounds(target_probs, draft_probs, num_rows=20_000)
    num_rows, num_positions = draft_token_ids.shape
    assert set(result.num_accepted.tolist()) == set(range(num_positions + 1))
    passes = result.uniforms * result.draft_draft_probs < result.target_draft_probs  # [N, K] u * q < p
    assert result.uniforms.dtype == torch.float64
    assert bool(((result.uniforms >= 0) & (result.uniforms < 1)).all())
    for row in range(num_rows):
        accepted = int(result.num_accepted[row])
        tokens = result.token_ids[row].tolist()
        drafts = draft_token_ids[row].tolist()
        assert tokens[:accepted] == drafts[:accepted]
        assert bool(passes[row, :accepted].all())
        assert tokens[accepted] == int(result.next_token_ids[row]) != PADDING_ID
        assert tokens[accepted + 1 :] == [PADDING_ID] * (num_positions - accepted)
        if accepted < num_positions:
            assert not bool(passes[row, accepted])  # the first rejection failed u * q < p
            # a rejected draft has p < q, so max(0, p - q) is 0 there: the resample never repeats it
            assert tokens[accepted] != drafts[accepted]


# --- batches and seeds ---------------------------------------------------------------------------------------------


def ragged_batch(seed: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Six rows with their own p and q, from identical (row 0) to unrelated; row 5 refuses its first draft."""
    batch_size, num_positions, vocab_size = 6, 4, 10
    generator = torch.Generator().manual_seed(seed)
    target_logits = 2.0 * torch.randn(batch_size, num_positions + 1, vocab_size, generator=generator)
    noise_scale = torch.tensor([0.0, 0.5, 1.0, 2.0, 4.0, 8.0])[:, None, None]  # [B, 1, 1]
    noise = noise_scale * torch.randn(batch_size, num_positions, vocab_size, generator=generator)
    target_probs = target_logits.softmax(dim=-1)  # [B, K+1, V]
    draft_probs = (target_logits[:, :num_positions] + noise).softmax(dim=-1)  # [B, K, V]
    draft_token_ids = torch.multinomial(draft_probs.reshape(-1, vocab_size), 1, generator=generator)
    draft_token_ids = draft_token_ids.reshape(batch_size, num_positions)  # [B, K]
    target_probs[5, 0, draft_token_ids[5, 0]] = 0.0  # row 5 rejects its first draft
    return draft_token_ids, draft_probs, normalise(target_probs)


def row_generators(seeds: list[int]) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed) for seed in seeds]


def test_batched_rows_equal_each_row_run_alone():
    draft_token_ids, draft_probs, target_probs = ragged_batch()
    seeds = [100 + row for row in range(draft_token_ids.shape[0])]
    batched = rejection_sample(draft_token_ids, draft_probs, target_probs, generator=row_generators(seeds))
    accepted_counts = set(batched.num_accepted.tolist())
    assert {0, draft_token_ids.shape[1]} <= accepted_counts and len(accepted_counts) >= 3, accepted_counts
    for row, seed in enumerate(seeds):
        alone = rejection_sample(
            draft_token_ids[row : row + 1],
            draft_probs[row : row + 1],
            target_probs[row : row + 1],
            generator=row_generators([seed]),
        )
        assert torch.equal(batched.token_ids[row : row + 1], alone.token_ids), row
        assert torch.equal(batched.num_accepted[row : row + 1], alone.num_accepted), row
        assert torch.equal(batched.uniforms[row : row + 1], alone.uniforms), row


def test_same_seed_gives_identical_rounds_and_another_seed_does_not():
    target_probs, draft_probs = perturbed_setting(num_draft_tokens=3)
    _, first = sample_rounds(target_probs, draft_probs, num_rows=10_000, seed=7)
    _, again = sample_rounds(target_probs, draft_probs, num_rows=10_000, seed=7)
    _, other = sample_rounds(target_probs, draft_probs, num_rows=10_000, seed=8)
    for name in RejectionResult.__dataclass_fields__:
        assert torch.equal(getattr(first, name), getattr(again, name)), name
    assert not torch.equal(first.token_ids, other.token_ids)


def test_same_row_seeds_give_identical_rounds():
    draft_token_ids, draft_probs, target_probs = ragged_batch()
    seeds = [11, 12, 13, 14, 15, 16]
    first = rejection_sample(draft_token_ids, draft_probs, target_probs, generator=row_generators(seeds))
    again = rejection_sample(draft_token_ids, draft_probs, target_probs, generator=row_generators(seeds))
    for name in RejectionResult.__dataclass_fields__:
        assert torch.equal(getattr(first, name), getattr(again, name)), name


def test_target_equal_to_draft_accepts_everything_and_adds_a_bonus():
    target_probs, _ = perturbed_setting(num_draft_tokens=4)
    draft_probs = target_probs[:-1].clone()  # p == q at every draft position, zeros included
    _, result = sample_rounds(target_probs, draft_probs)
    for name in ("target_draft_probs", "draft_draft_probs", "acceptance_probs", "uniforms"):
        assert not bool(getattr(result, name).isnan().any()), name
    assert bool((result.num_accepted == 4).all())
    assert bool((result.acceptance_probs == 1.0).all())
    assert torch.equal(result.token_ids[:, 4], result.next_token_ids)
    assert bool((result.next_token_ids != PADDING_ID).all())
    assert distribution_failures(result, target_probs) == []  # drafts follow q = p, the bonus follows p_K


def peaked_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """B=16, K=4, V=50: peaked p, with q drifting from p (row 0) to far from it (row 15), zeros in both."""
    batch_size, num_positions, vocab_size = 16, 4, 50
    generator = torch.Generator().manual_seed(seed)
    target_logits = 3.0 * torch.randn(batch_size, num_positions + 1, vocab_size, generator=generator)
    noise_scale = torch.linspace(0.0, 3.0, batch_size)[:, None, None]  # [B, 1, 1]
    draft_logits = target_logits[:, :num_positions] + noise_scale * torch.randn(
        batch_size, num_positions, vocab_size, generator=generator
    )
    target_probs = target_logits.softmax(dim=-1)  # [B, K+1, V]
    draft_probs = draft_logits.softmax(dim=-1)  # [B, K, V]
    target_probs[torch.rand(target_probs.shape, generator=generator) < 0.2] = 0.0
    draft_probs[torch.rand(draft_probs.shape, generator=generator) < 0.2] = 0.0
    target_probs, draft_probs = normalise(target_probs), normalise(draft_probs)
    draft_token_ids = torch.multinomial(draft_probs.reshape(-1, vocab_size), 1, generator=generator)
    return draft_token_ids.reshape(batch_size, num_positions), draft_probs, target_probs


def pad_rows(rows: list[list[int]], width: int) -> torch.Tensor:  # [B, width]
    return torch.tensor([row + [PADDING_ID] * (width - len(row)) for row in rows])


def test_vectorised_sampler_equals_the_per_token_loop():
    seen_counts = set()
    for seed in range(10):
        draft_token_ids, draft_probs, target_probs = peaked_batch(seed)
        seeds = [1000 * seed + row for row in range(draft_token_ids.shape[0])]
        result = rejection_sample(draft_token_ids, draft_probs, target_probs, generator=row_generators(seeds))
        emitted, counts = reference_rejection_sample(draft_token_ids, draft_probs, target_probs, row_generators(seeds))
        assert torch.equal(result.token_ids, pad_rows(emitted, draft_token_ids.shape[1] + 1)), seed
        assert result.num_accepted.tolist() == counts, seed
        seen_counts |= set(counts)
    assert seen_counts == set(range(5)), "the random batches should accept 0, 1, ..., K tokens somewhere"


# --- edge cases ------------------------------------------------------------------------------------------------------


def test_a_token_the_target_refuses_is_never_accepted_even_with_u_zero(monkeypatch):
    def zero_uniforms(generator, batch_size, num_draws, device):
        return torch.zeros(batch_size, num_draws, dtype=torch.float64, device=device)

    monkeypatch.setattr(rejection_module, "draw_uniforms", zero_uniforms)
    result = verify_one_row(
        [1, 3],
        [one_hot(1), weights(t2=0.1, t3=0.9)],
        [
            weights(t0=1.0, t1=1e-300),  # accepts 1: u * q = 0 < p = 1e-300
            weights(t2=0.1, t4=0.9),  # rejects 3: p = 0, even though u * q = 0; residual is 0 at 0..3, so 4
            one_hot(5),
        ],
    )
    assert result.token_ids.tolist() == [[1, 4, PADDING_ID]]
    assert result.uniforms.tolist() == [[0.0, 0.0]]


def test_residual_is_the_positive_part_of_target_minus_draft_or_the_target_when_equal():
    target_probs = torch.tensor(
        [
            [0.5, 0.3, 0.2, 0.0],  # equal to its draft: the residual is empty, so sample from p itself
            [0.5, 0.3, 0.2, 0.0],  # differs: max(0, p - q)
        ],
        dtype=torch.float64,
    )
    draft_probs = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.2, 0.3, 0.1, 0.4]], dtype=torch.float64)
    residual = residual_probs(target_probs, draft_probs)
    assert torch.allclose(residual, torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.3, 0.0, 0.1, 0.0]], dtype=torch.float64))
    assert torch.equal(residual[0], target_probs[0])
    assert torch.equal(draft_probs[1], torch.tensor([0.2, 0.3, 0.1, 0.4], dtype=torch.float64)), "inputs untouched"


def test_nothing_drafted_emits_one_token_from_the_first_target_distribution():
    target_probs, _ = perturbed_setting(num_draft_tokens=0)  # [1, V] with one p = 0 token
    draft_probs = torch.zeros(0, target_probs.shape[-1], dtype=torch.float64)  # [0, V]
    draft_token_ids, result = sample_rounds(target_probs, draft_probs)
    assert result.token_ids.shape == (NUM_ROWS, 1)
    assert result.uniforms.shape == result.acceptance_probs.shape == (NUM_ROWS, 0)
    assert bool((result.num_accepted == 0).all())
    assert torch.equal(result.token_ids[:, 0], result.next_token_ids)
    assert distribution_failures(result, target_probs) == []
    few = [draft_token_ids[:8], draft_probs.expand(8, 0, -1), target_probs.expand(8, 1, -1)]  # the loop is slow
    emitted, counts = reference_rejection_sample(*few, row_generators(range(8)))
    batched = rejection_sample(*few, generator=row_generators(range(8)))
    assert torch.equal(batched.token_ids, pad_rows(emitted, 1)) and counts == [0] * 8
