"""The coupled rule's parts (core/coupled.py): the noise is splitmix64 of (seed, position, id) bit for bit and depends
on nothing else, it is standard Gumbel noise, the rule is the tree walk written as a plain loop, it is Gumbel-max with
nothing drafted and the greedy walk for one-hot p, and the match chance it predicts is the rate it gets."""

# B = rows, W = num_candidates, K = num_draft_tokens, V = vocab_size

from __future__ import annotations

import math

import pytest
import torch

from specdemo.config import SamplingConfig
from specdemo.core.coupled import (
    POSITION_SALT,
    coupled_choice,
    coupled_top,
    gumbel_noise,
    noise_bits,
    uniform_from_bits,
    verify_coupled,
)
from specdemo.core.match_chance import match_probability, path_choices, top_match_probability
from specdemo.core.verify import verify_rows

MASK = 2**64 - 1
GAMMA, MIX_1, MIX_2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def mix64_reference(value: int) -> int:
    """splitmix64's finaliser on Python's unbounded ints, masked to 64 bits (Vigna's reference, line by line)."""
    z = value & MASK
    z = ((z ^ (z >> 30)) * MIX_1) & MASK
    z = ((z ^ (z >> 27)) * MIX_2) & MASK
    return z ^ (z >> 31)


def bits_reference(seed: int, position: int, token: int) -> int:  # uint64 as a Python int
    key = mix64_reference(seed * POSITION_SALT + (position + 1) * GAMMA)
    return mix64_reference(key + (token + 1) * GAMMA)


def test_the_noise_bits_are_splitmix64_of_the_positions_key_bit_for_bit():
    """Pinned to a plain reference in Python integers, so any device that computes them (the GPU check compares CUDA's)
    has one answer to match."""
    seeds = [0, 1, 12345, 2**53 - 1]
    positions = [[0, 7, 4095], [1, 2, 3], [100, 0, 9], [2047, 2048, 5]]
    got = noise_bits(torch.tensor(seeds), torch.tensor(positions), 50)  # [4, 3, 50] int64
    for r, seed in enumerate(seeds):
        for c, position in enumerate(positions[r]):
            for token in (0, 1, 31, 49):
                assert int(got[r, c, token]) & MASK == bits_reference(seed, position, token), (seed, position, token)


def test_a_positions_noise_depends_on_its_seed_position_and_id_alone():
    """The same G_t whatever rows stand beside it, whichever positions are asked with it, and however large the
    vocabulary asked (a prefix of ids): and another seed or position gives other noise."""
    whole = gumbel_noise(torch.tensor([3, 9]), torch.arange(20).expand(2, -1), 64)  # [2, 20, 64]
    alone = gumbel_noise(torch.tensor([9]), torch.tensor([[5, 6, 7]]), 32)  # [1, 3, 32]
    assert torch.equal(alone[0], whole[1, 5:8, :32])
    assert not torch.equal(whole[0], whole[1])  # seeds
    assert not torch.equal(whole[0, 0], whole[0, 1])  # positions


def test_the_noise_is_standard_gumbel():
    """200,000 values: the mean is Euler's constant and the variance pi^2 / 6, each within 5 standard errors, and
    exp(-exp(-G)) (the uniform it came from) has the uniform's quartiles."""
    noise = gumbel_noise(torch.arange(2000), torch.zeros(2000, 1, dtype=torch.long), 100).flatten()  # [200,000]
    assert bool(torch.isfinite(noise).all())
    count = noise.numel()
    variance = math.pi**2 / 6
    assert abs(float(noise.mean()) - 0.5772156649) < 5 * math.sqrt(variance / count)
    assert abs(float(noise.var()) - variance) < 5 * math.sqrt(4.4 * variance**2 / count)  # kurtosis 5.4
    uniforms = torch.exp(-torch.exp(-noise))
    quartiles = torch.quantile(uniforms[:100_000], torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64))
    assert torch.allclose(quartiles, torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64), atol=0.005)


def test_the_uniform_is_strictly_inside_0_and_1_at_the_extreme_bit_patterns():
    """All zeros, all ones and the patterns around 2^52 and 2^53 in the top bits give u in [2^-53, 1 - 2^-53] and a
    finite G (planted: the 53-bit (x + 0.5) * 2^-53 gives u = 1.0 for all ones, G = +inf)."""
    top = [0, 1, 2**51, 2**52 - 1]  # top-52-bit values
    patterns = [x << 12 for x in top] + [(x << 12) | (2**12 - 1) for x in top] + [MASK, MASK - 2**11]  # uint64
    signed = [v - 2**64 if v >= 2**63 else v for v in patterns]  # the same bits as int64
    uniforms = uniform_from_bits(torch.tensor(signed, dtype=torch.int64))
    assert float(uniforms.min()) == 2.0**-53 and float(uniforms.max()) == 1.0 - 2.0**-53, uniforms.tolist()
    assert bool(torch.isfinite(-torch.log(-torch.log(uniforms))).all())


def test_the_noise_that_was_infinite_is_finite():
    """Row noise seed 5656014980887990 at position 91, id 25: its bits are all ones in the top 53, which the 53-bit
    uniform rounded to 1.0 (G = +inf, and log p + G = NaN where p = 0, which argmax picked)."""
    noise = gumbel_noise(torch.tensor([5656014980887990]), torch.tensor([[91]]), 49)[0, 0]  # [V]
    assert bool(torch.isfinite(noise).all()), noise[25]
    probs = torch.zeros(49, dtype=torch.float64)
    probs[10] = 1.0  # top-k 1: only id 10 is possible
    assert int(coupled_choice(probs, noise)) == 10


def walk_reference(ids, lengths, target_probs, noise) -> tuple[int, int, int, list[int]]:
    """The rule for one row as a plain loop: at each depth y = argmax(log p + G) at the path's node; the first
    candidate still on the path whose token is y is taken; else y is emitted. (path, accepted, next token, y's)."""
    num_candidates, num_draft = ids.shape
    alive = [w for w in range(num_candidates) if lengths[w] > 0]
    path, accepted, choices = 0, 0, []
    for depth in range(num_draft + 1):
        y = int((target_probs[path, depth].double().log() + noise[depth]).argmax())
        choices.append(y)
        taken = [w for w in alive if lengths[w] > depth and int(ids[w, depth]) == y]
        if depth == num_draft or not taken:
            return path, accepted, y, choices
        path, accepted = taken[0], accepted + 1
        alive = [w for w in alive if lengths[w] > depth and int(ids[w, depth]) == y]
    raise AssertionError("unreachable")


@pytest.mark.parametrize("num_candidates", [1, 3])
def test_the_rule_is_the_tree_walk(num_candidates):
    """Random rows whose candidates share prefixes and often match the target's choice, ragged lengths and empty
    candidates: the vectorised rule equals the loop, row by row, and tests and accepts what the walk does."""
    generator = torch.Generator().manual_seed(num_candidates)
    rows, depth, vocab = 300, 4, 6
    target = torch.softmax(3 * torch.randn(rows, 1, depth + 1, vocab, generator=generator), -1)
    target = target.expand(-1, num_candidates, -1, -1).clone()  # [B, W, K+1, V]: candidates on one path share p
    noise = gumbel_noise(torch.arange(rows), torch.arange(depth + 1).expand(rows, -1), vocab)  # [B, K+1, V]
    choices = coupled_choice(target[:, 0], noise)  # [B, K+1] what each depth's p and G pick
    ids = torch.randint(0, vocab, (rows, num_candidates, depth), generator=generator)
    agree = torch.rand(rows, num_candidates, depth, generator=generator) < 0.6
    ids = torch.where(agree, choices[:, None, :depth], ids)  # often the target's choice
    lengths = torch.randint(0, depth + 1, (rows, num_candidates), generator=generator)
    draft = torch.softmax(torch.randn(rows, num_candidates, depth, vocab, generator=generator), -1)
    verdict = verify_coupled(ids, lengths, draft, target, noise)
    for b in range(rows):
        path, accepted, next_id, walk = walk_reference(ids[b], lengths[b], target[b], noise[b])
        assert (int(verdict.num_accepted[b]), int(verdict.next_token_ids[b])) == (accepted, next_id), b
        assert verdict.choices[b, : accepted + 1].tolist() == walk, b
        if accepted:
            assert int(verdict.path[b]) == path, b
        assert int(verdict.accepted[b].sum()) == accepted, b
    assert 0 < int(verdict.num_accepted.sum()) and bool((verdict.num_accepted == depth).any())


def test_with_nothing_drafted_it_is_gumbel_max_and_the_top_w_start_with_it():
    probs = torch.softmax(torch.randn(40, 1, 1, 9, generator=torch.Generator().manual_seed(0)), -1)
    noise = gumbel_noise(torch.arange(40), torch.zeros(40, 1, dtype=torch.long), 9)
    empty = torch.zeros(40, 1, 0, dtype=torch.long)
    verdict = verify_coupled(empty, torch.zeros(40, 1, dtype=torch.long), probs[:, :, :0], probs, noise)
    assert torch.equal(verdict.next_token_ids, (probs[:, 0, 0].log() + noise[:, 0]).argmax(-1))
    top, live = coupled_top(probs[:, 0, 0], noise[:, 0], 3)
    assert torch.equal(top[:, 0], verdict.next_token_ids) and bool((top[:, 0] != top[:, 1]).all())
    assert bool(live.all())  # p > 0 everywhere: all three are live


def test_the_top_w_are_live_only_where_p_allows_them():
    """Top-k 2 of 9 at W = 4: two live ids with p > 0, first; the other two are ties at -inf (any id), not live."""
    probs = torch.tensor([[0.0, 0.6, 0.0, 0.0, 0.4, 0.0, 0.0, 0.0, 0.0]]).expand(50, -1)  # [50, V]
    noise = gumbel_noise(torch.arange(50), torch.zeros(50, 1, dtype=torch.long), 9)[:, 0]  # [50, V]
    top, live = coupled_top(probs, noise, 4)
    assert live.tolist() == [[True, True, False, False]] * 50
    assert sorted(top[0, :2].tolist()) == [1, 4] and bool((probs.gather(1, top[:, :2]) > 0).all())


def test_for_one_hot_p_it_decides_what_the_greedy_rule_decides():
    """Greedy is the same walk with no noise: with one-hot p the coupled rule's verdict is the standard rule's."""
    generator = torch.Generator().manual_seed(1)
    rows, width, depth, vocab = 200, 3, 3, 5
    argmaxes = torch.randint(0, vocab, (rows, 1, depth + 1), generator=generator).expand(-1, width, -1)
    target = torch.nn.functional.one_hot(argmaxes, vocab).float()  # [B, W, K+1, V]
    ids = torch.where(
        torch.rand(rows, width, depth, generator=generator) < 0.7,
        argmaxes[..., :depth],
        torch.randint(0, vocab, (rows, width, depth), generator=generator),
    )
    lengths = torch.randint(1, depth + 1, (rows, width), generator=generator)
    draft = torch.nn.functional.one_hot(ids, vocab).float()
    noise = gumbel_noise(torch.arange(rows), torch.arange(depth + 1).expand(rows, -1), vocab)
    uniforms = torch.rand(rows, depth * width + 1, dtype=torch.float64, generator=generator)
    coupled, standard = (
        verify_coupled(ids, lengths, draft, target, noise),
        verify_rows(ids, lengths, draft, target, uniforms),
    )
    for name in ("num_accepted", "next_token_ids", "accepted", "tested"):
        assert torch.equal(getattr(coupled, name), getattr(standard, name)), name
    assert torch.equal(coupled.path[coupled.num_accepted > 0], standard.path[standard.num_accepted > 0])


def test_the_predicted_match_chance_brackets_the_exact_sum_and_the_measured_rate():
    """sum_v 1 / sum_u max(p(u)/p(v), q(u)/q(v)) on a toy vocabulary, against 200,000 seeds' draws; its bounds hold
    the exact value, are tight when they cover the vocabulary, sit at or above (1 - TV) / (1 + TV) and at or below
    1 - TV, and equal p(x) for a one-hot q at x."""
    generator = torch.Generator().manual_seed(2)
    vocab, draws = 12, 200_000
    noise = gumbel_noise(torch.arange(draws), torch.zeros(draws, 1, dtype=torch.long), vocab)[:, 0]  # [N, V]
    for _ in range(3):
        p = torch.softmax(2 * torch.randn(vocab, generator=generator, dtype=torch.float64), -1)
        q = torch.softmax(2 * torch.randn(vocab, generator=generator, dtype=torch.float64), -1)
        exact = sum(1 / sum(max(p[u] / p[v], q[u] / q[v]) for u in range(vocab)) for v in range(vocab))
        low, high = match_probability(p, q, top=4, support=6)
        assert float(low) <= float(exact) <= float(high)
        tight_low, tight_high = match_probability(p, q)
        assert float(tight_low) == pytest.approx(float(exact), abs=1e-12) == float(tight_high)
        measured = float(
            (coupled_choice(p.expand(draws, -1), noise) == coupled_choice(q.expand(draws, -1), noise)).double().mean()
        )
        assert abs(measured - float(exact)) < 5 * math.sqrt(float(exact) * (1 - float(exact)) / draws)
        tv = 0.5 * float((p - q).abs().sum())
        assert (1 - tv) / (1 + tv) - 1e-12 <= float(exact) <= 1 - tv + 1e-12
    one_hot = torch.nn.functional.one_hot(torch.tensor(3), vocab).double()
    assert float(match_probability(p, one_hot)[0]) == pytest.approx(float(p[3]), abs=1e-12)


def pair(vocab: int, zeros: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random p and q on a toy vocabulary ([V] each, float64), each with its `zeros` smallest set to 0 (top-k)."""
    p, q = (torch.softmax(2 * torch.randn(vocab, generator=generator, dtype=torch.float64), -1) for _ in range(2))
    for probs in (p, q):
        probs[probs.argsort()[:zeros]] = 0.0
    return p / p.sum(), q / q.sum()


def among_top_rate(p, q, width: int, fixed: list[int], offset: int, draws: int = 200_000) -> float:
    """The share of `draws` seeds whose y = argmax(log p + G) is a fixed token or among the live W best of
    log q + G: what W candidates drafted with the noise (coupled_top) would match."""
    noise = gumbel_noise(torch.arange(draws) + offset, torch.zeros(draws, 1, dtype=torch.long), len(p))[:, 0]
    y = coupled_choice(p.expand(draws, -1), noise)  # [N]
    ids, live = coupled_top(q.expand(draws, -1), noise, width)  # [N, W] each
    hit = ((ids == y[:, None]) & live).any(dim=1) | torch.isin(y, torch.tensor(fixed, dtype=torch.long))
    return float(hit.double().mean())


def exact(p, q, width: int, fixed: torch.Tensor | None = None) -> float:
    """top_match_probability over the whole toy vocabulary: its bounds meet."""
    low, high = top_match_probability(p, q, width, fixed, top=len(p), support=len(p))
    assert float(high) - float(low) < 1e-9, (float(low), float(high))
    return float(low)


@pytest.mark.parametrize("width", [1, 3, 8])
def test_the_chance_y_is_among_the_w_best_of_log_q_plus_g_is_the_rate_it_happens(width):
    """y among the W best of log q + G (a sampling drafter's W first tokens) against 200,000 seeds' draws, on six
    random pairs of 12 to 40 tokens, three of them with top-k zeros in p and q: within 4 standard errors."""
    generator = torch.Generator().manual_seed(width)
    for case, (vocab, zeros) in enumerate([(12, 0), (24, 0), (40, 0), (12, 4), (24, 9), (40, 25)]):
        p, q = pair(vocab, zeros, generator)
        predicted = exact(p, q, width)
        measured = among_top_rate(p, q, width, [], offset=1_000_000 * case)
        error = 4 * math.sqrt(predicted * (1 - predicted) / 200_000)
        assert abs(measured - predicted) < error, (
            f"V {vocab}, W {width}: predicted {predicted:.4f}, measured {measured:.4f}"
        )


def test_fixed_tokens_beside_the_w_best_count_whole():
    """The hybrid's node: a copy's fixed tokens F beside the head's m best: p(F) + the chance y is among the m best
    and not in F, against 200,000 draws; F alone (no sampled candidate's share) is less."""
    generator = torch.Generator().manual_seed(7)
    for case, (vocab, zeros, width) in enumerate([(16, 0, 1), (24, 6, 2), (32, 0, 3)]):
        p, q = pair(vocab, zeros, generator)
        fixed_ids = [int(p.argsort()[-2]), int(q.argsort()[-1])]  # p's second token, and q's first (also drafted)
        fixed = torch.zeros(vocab, dtype=torch.bool)
        fixed[fixed_ids] = True
        predicted = exact(p, q, width, fixed)
        measured = among_top_rate(p, q, width, fixed_ids, offset=7_000_000 + 1_000_000 * case)
        assert abs(measured - predicted) < 4 * math.sqrt(predicted * (1 - predicted) / 200_000), (vocab, width)
        assert float(p[fixed].sum()) < predicted < float(p[fixed].sum()) + exact(p, q, width)


def top_match_reference(p, q, width: int) -> float:
    """The race's integral the plain way: for each v the Poisson-binomial count of the u ahead by a loop over u, on
    20,001 points of a geometric grid in t from 1e-12 to 60 (the trapezoid rule in log t)."""
    logs = torch.linspace(math.log(1e-12), math.log(60.0), 20_001, dtype=torch.float64)
    t = logs.exp()  # [T]
    total = 0.0
    for v in range(len(p)):
        if p[v] == 0 or q[v] == 0:
            continue
        count = torch.zeros(len(t), width + 1, dtype=torch.float64)  # [T, m + 1] P(N = k), k < m, after each u
        count[:, 1] = 1.0  # column 0 stays 0: the shift in the loop below
        for u in range(len(p)):
            ahead = -torch.expm1(-t * max(0.0, float(p[v] * q[u] / q[v] - p[u])))[:, None]  # [T, 1]
            count[:, 1:] = count[:, 1:] * (1 - ahead) + count[:, :-1] * ahead
        integrand = torch.exp(-t) * count[:, 1:].sum(dim=1) * t  # [T] dt = t d(log t)
        total += float(p[v]) * (float(((integrand[1:] + integrand[:-1]) / 2).sum() * (logs[1] - logs[0])) + 1e-12)
    return total


def test_the_integral_over_t_is_within_1e_4_of_a_plain_fine_grid_and_w_1_is_match_probability():
    """The quadrature (about 40 nodes) against 20,001 points and a loop over u, on peaked and flat pairs, W 1 to 4;
    at W = 1 the integral is match_probability's closed sum (the exponential race's m = 1 case)."""
    generator = torch.Generator().manual_seed(5)
    for scale in (0.5, 2.0, 5.0, 8.0):
        p, q = (torch.softmax(scale * torch.randn(16, generator=generator, dtype=torch.float64), -1) for _ in "pq")
        for width in (1, 2, 4):
            assert abs(exact(p, q, width) - top_match_reference(p, q, width)) < 1e-4, (scale, width)
        assert exact(p, q, 1) == pytest.approx(float(match_probability(p, q)[0]), abs=1e-6)


def test_the_bounds_hold_the_exact_chance_when_the_vocabulary_is_cut():
    """Few outer tokens, a small support and few pieces for the rest (the page's cut of 49,152 ids), or no outer token
    at all (the Poisson and inclusion bounds alone): the lower bound is at most and the upper at least the chance on
    the whole vocabulary, with fixed tokens too; both are at most 1."""
    generator = torch.Generator().manual_seed(11)
    for vocab, zeros in [(40, 0), (40, 10), (64, 0)]:
        p, q = pair(vocab, zeros, generator)
        fixed = torch.zeros(vocab, dtype=torch.bool)
        fixed[int(p.argmax())] = True
        for width in (1, 3, 8):
            for marked in (None, fixed):
                whole = exact(p, q, width, marked)
                for top, support, pieces in [(0, 4, 1), (2, 4, 1), (4, 8, 3), (8, 24, 128)]:
                    low, high = top_match_probability(p, q, width, marked, top, support, pieces)
                    assert float(low) - 1e-6 <= whole <= float(high) + 1e-6 <= 1 + 1e-6, (vocab, width, top, support)
                assert float(high) - float(low) < 0.05  # the last cut's bounds are close: not vacuous


def test_a_nodes_chance_counts_every_candidate_alive_there():
    """path_choices: at the first position three candidates drafted from one q (its three best of log q + G) have the
    top-3 chance and num_alive 3; past it the path's candidate is alone (match_probability's chance); one candidate
    (W = 1) is match_probability's at every position; a one-hot q beside them is a fixed token."""
    generator = torch.Generator().manual_seed(3)
    vocab = 20
    target = torch.softmax(2 * torch.randn(3, vocab, generator=generator, dtype=torch.float64), -1)  # [K+1, V]
    draft = torch.softmax(2 * torch.randn(3, 2, vocab, generator=generator, dtype=torch.float64), -1)  # [W, K, V]
    draft[:, 0] = draft[0, 0]  # the three beams' first tokens come from one q
    noise = gumbel_noise(torch.tensor([4]), torch.arange(3)[None], vocab)[0]  # [K+1, V]
    first = coupled_top(draft[0, 0], noise[0], 3)[0].tolist()
    y = coupled_choice(target, noise).tolist()  # [K+1]
    candidates = [[first[0], 1], [first[1], 2], [first[2], 3]]
    path = first.index(y[0]) if y[0] in first else 0
    shown = path_choices(target, draft, noise, candidates, path, int(y[0] in first), y)
    assert shown[0].num_alive == 3 and shown[0].draft_id == candidates[path][0]
    assert shown[0].coupled_chance - 1e-6 <= exact(target[0], draft[0, 0], 3) <= shown[0].coupled_chance_high + 1e-6
    assert shown[0].standard_chance == pytest.approx(1 - 0.5 * float((target[0] - draft[path, 0]).abs().sum()))
    if y[0] in first:
        assert shown[1].num_alive == 1
        assert shown[1].coupled_chance == pytest.approx(float(match_probability(target[1], draft[path, 1])[0]))
    alone = path_choices(target, draft[:1], noise, candidates[:1], 0, 0, y)
    assert alone[0].num_alive == 1 and alone[0].coupled_chance == float(match_probability(target[0], draft[0, 0])[0])
    copy = torch.nn.functional.one_hot(torch.tensor([[7, 8]]), vocab).double()  # [1, K, V] a fixed candidate
    mixed = path_choices(target, torch.cat([draft, copy]), noise, [*candidates, [7, 8]], path, 0, y)
    fixed = torch.zeros(vocab, dtype=torch.bool)
    fixed[7] = True
    assert mixed[0].num_alive == 4 and mixed[0].draft_id == shown[0].draft_id
    low, high = mixed[0].coupled_chance, mixed[0].coupled_chance_high
    assert low - 1e-6 <= exact(target[0], draft[0, 0], 3, fixed) <= high + 1e-6 and low > shown[0].coupled_chance_high
    copies = torch.nn.functional.one_hot(torch.tensor([[y[0], 0], [y[0], 5]]), vocab).double()  # [2, K, V]
    ended = path_choices(target, copies, noise, [[y[0]], [y[0], 5]], 0, 1, y)  # the path (first of the longest) ends
    assert (ended[1].draft_id, ended[1].num_alive) == (5, 1)  # and the longer copy was tested where it ended
    assert ended[1].coupled_chance == ended[1].coupled_chance_high == pytest.approx(float(target[1, 5]))


def test_a_seed_outside_the_range_gets_one_sentence_naming_it():
    for seed in (-1, 2**63):
        with pytest.raises(ValueError, match=r"^seed must be between 0 and 9223372036854775807, got -?\d+\.$"):
            SamplingConfig(temperature=0.7, rule="coupled", seed=seed)
    with pytest.raises(ValueError, match=r"^rule must be 'standard' or 'coupled', got 'gumbel'\.$"):
        SamplingConfig(rule="gumbel")
