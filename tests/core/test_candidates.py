"""The multi-candidate rule: exact target distribution for W candidates (sampled or deterministic, duplicates
included), two negative controls that the same test must catch, W = 1 == rejection_sample, one-candidate chains ==
the tree rule, vmap == a Python loop."""

from __future__ import annotations

import pytest
import torch

from specdemo.audit import chi_square_pvalue, tv_distance
from specdemo.core.sampling import sample_from_probs, sample_one
from specdemo.core.verify import (
    choose_draft_tokens,
    first_nonfinite,
    rejection_sample,
    verify_candidates,
    verify_chains,
    verify_rows,
    verify_tree,
)

V = 8
START = 0  # the token before the first round
NUM_SAMPLES = 200_000
NUM_POSITIONS = 3  # emitted tokens checked per sample


def markov_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """[V, V] target and draft next-token tables (row = previous token): far apart, with p = 0 < q and q = 0 < p."""
    generator = torch.Generator().manual_seed(7)
    target = torch.rand(V, V, generator=generator) ** 3
    draft = torch.rand(V, V, generator=generator) ** 3
    target[:, 5], draft[:, 6] = 0.0, 0.0  # the target never emits 5; the draft never proposes 6
    return target / target.sum(1, keepdim=True), draft / draft.sum(1, keepdim=True)


def verify_rule(tokens, lengths, draft_probs, target_probs, uniforms):
    verdict = verify_tree(tokens, lengths, draft_probs, target_probs, uniforms)
    return verdict.path, verdict.num_accepted, verdict.next_token_ids


def redrafter_rule(tokens, lengths, draft_probs, target_probs, uniforms):
    """NOT lossless (Apple ReDrafter's _choose_from_candidates): test every candidate on its own with min(1, p/q),
    keep the one accepted longest, then resample from its own residual."""
    rows, num_candidates, depth = tokens.shape
    draws = uniforms[:, :-1].reshape(rows, depth, num_candidates).transpose(1, 2)  # [N, W, K]
    p = target_probs[:, :, :depth].gather(-1, tokens[..., None])[..., 0]
    q = draft_probs.gather(-1, tokens[..., None])[..., 0]
    passed = draws * q < p  # [N, W, K]
    accepted = passed.long().cumprod(-1).sum(-1)  # [N, W]
    path = accepted.argmax(-1)  # [N] the first longest
    num_accepted = accepted.gather(1, path[:, None])[:, 0]
    node = target_probs[torch.arange(rows), path, num_accepted]  # [N, V]
    rejected = (num_accepted < depth)[:, None]
    q_node = draft_probs[torch.arange(rows), path, num_accepted.clamp(max=depth - 1)] * rejected
    residual = (node - q_node).clamp(min=0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, node)
    return path, num_accepted, sample_from_probs(residual, uniforms[:, -1])


def resample_from_p_rule(tokens, lengths, draft_probs, target_probs, uniforms):
    """NOT lossless: the correct acceptance tests, then the next token from p at the node instead of what remains."""
    verdict = verify_tree(tokens, lengths, draft_probs, target_probs, uniforms)
    rows = tokens.shape[0]
    node = target_probs[torch.arange(rows), verdict.path, verdict.num_accepted]  # [N, V]
    return verdict.path, verdict.num_accepted, sample_from_probs(node, uniforms[:, -1])


def draw_candidates(previous, draft_table, num_candidates, depth, deterministic, generator):
    """[N, W, K] candidates continuing `previous` ([N]), drawn i.i.d. from the draft chain; deterministic ones get a
    one-hot q, and their third candidate repeats the first (a duplicate), as n-gram matches can."""
    rows = previous.shape[0]
    tokens = torch.empty(rows, num_candidates, depth, dtype=torch.long)
    draft_probs = torch.empty(rows, num_candidates, depth, V)
    state = previous[:, None].expand(rows, num_candidates)
    for j in range(depth):
        draft_probs[:, :, j] = draft_table[state]
        state = torch.multinomial(draft_table[state].reshape(-1, V), 1, generator=generator).reshape(rows, -1)
        tokens[:, :, j] = state
    if deterministic:
        if num_candidates > 2:
            tokens[:, 2] = tokens[:, 0]
        draft_probs = torch.nn.functional.one_hot(tokens, V).float()
    return tokens, draft_probs


def emitted_counts(rule, num_candidates, depth, deterministic, seed=0, draw=draw_candidates) -> torch.Tensor:
    """[NUM_POSITIONS, V] counts of the emitted token at each position, over NUM_SAMPLES runs of rounds; `draw`
    makes each round's candidates (draw_candidates' signature)."""
    target_table, draft_table = markov_tables()
    generator = torch.Generator().manual_seed(seed)
    emitted = torch.full((NUM_SAMPLES, NUM_POSITIONS + depth + 1), -1)
    filled = torch.zeros(NUM_SAMPLES, dtype=torch.long)
    previous = torch.full((NUM_SAMPLES,), START)
    while bool((filled < NUM_POSITIONS).any()):
        tokens, draft_probs = draw(previous, draft_table, num_candidates, depth, deterministic, generator)
        states = torch.cat([previous[:, None, None].expand(-1, num_candidates, 1), tokens], dim=2)  # [N, W, K+1]
        target_probs = target_table[states]  # [N, W, K+1, V]: p along each candidate's own path
        lengths = torch.full((NUM_SAMPLES, num_candidates), depth)
        uniforms = torch.rand(NUM_SAMPLES, depth * num_candidates + 1, dtype=torch.float64, generator=generator)
        path, num_accepted, next_ids = rule(tokens, lengths, draft_probs, target_probs, uniforms)
        chosen = tokens[torch.arange(NUM_SAMPLES), path]  # [N, K]
        for j in range(depth + 1):
            token = torch.where(num_accepted > j, chosen[:, min(j, depth - 1)], next_ids)
            take = (num_accepted >= j) & (filled < NUM_POSITIONS)
            emitted[take, filled[take]] = token[take]
            filled += take.long()
        previous = torch.where(filled > 0, emitted.gather(1, (filled - 1).clamp(min=0)[:, None])[:, 0], START)
    counts = torch.zeros(NUM_POSITIONS, V)
    for position in range(NUM_POSITIONS):
        counts[position] = torch.bincount(emitted[:, position], minlength=V).float()
    return counts


def exact_marginals() -> torch.Tensor:  # [NUM_POSITIONS, V]
    target_table, _ = markov_tables()
    state = torch.nn.functional.one_hot(torch.tensor(START), V).float()
    marginals = []
    for _ in range(NUM_POSITIONS):
        state = state @ target_table
        marginals.append(state)
    return torch.stack(marginals)


def follows_target(counts: torch.Tensor) -> tuple[bool, list[tuple[float, float]]]:
    exact = exact_marginals()
    stats = [(chi_square_pvalue(c, p), tv_distance(c, p)) for c, p in zip(counts, exact, strict=True)]
    return all(pvalue > 1e-4 and tv < 0.01 for pvalue, tv in stats), stats


def case(num_candidates: int, depth: int, deterministic: bool, thorough: bool = False) -> object:
    kind = "deterministic" if deterministic else "sampled"
    marks = [pytest.mark.thorough] if thorough else []
    return pytest.param(num_candidates, depth, deterministic, id=f"{num_candidates}-{depth}-{kind}", marks=marks)


# `make test` runs four of the eight cases, every pair of two settings' values in one of them (W = 2 sampled at depth
# 1 is the broken rules' case below); `make test-all` adds the other four, W = 4 deterministic at depth 3 among them.
@pytest.mark.parametrize(
    ("num_candidates", "depth", "deterministic"),
    [
        case(2, 1, False),
        case(2, 3, True),
        case(4, 1, True),
        case(4, 3, False),
        case(2, 1, True, thorough=True),
        case(2, 3, False, thorough=True),
        case(4, 1, False, thorough=True),
        case(4, 3, True, thorough=True),
    ],
)
def test_multi_candidate_rule_follows_the_target(num_candidates, depth, deterministic):
    counts = emitted_counts(verify_rule, num_candidates, depth, deterministic)
    assert bool((counts[:, 5] == 0).all()), "emitted a token the target gives probability 0"
    ok, stats = follows_target(counts)
    assert ok, f"(chi-square p, TV) per position: {stats}"


@pytest.mark.parametrize("rule", [redrafter_rule, resample_from_p_rule], ids=["redrafter-longest", "resample-from-p"])
def test_the_distribution_test_catches_broken_rules(rule):
    ok, stats = follows_target(emitted_counts(rule, num_candidates=2, depth=1, deterministic=False))
    assert not ok, f"a broken rule passed: {stats}"


def test_one_candidate_is_rejection_sample_bit_for_bit():
    generator = torch.Generator().manual_seed(3)
    rows, depth, vocab = 500, 4, 16
    draft_probs = torch.rand(rows, depth, vocab, generator=generator) ** 3
    target_probs = torch.rand(rows, depth + 1, vocab, generator=generator) ** 3
    draft_probs, target_probs = (
        draft_probs / draft_probs.sum(-1, keepdim=True),
        target_probs / target_probs.sum(-1, keepdim=True),
    )
    tokens = torch.multinomial(draft_probs.reshape(-1, vocab), 1, generator=generator).reshape(rows, depth)
    expected = rejection_sample(tokens, draft_probs, target_probs, generator=torch.Generator().manual_seed(9))
    uniforms = torch.rand(rows, depth + 1, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    verdict = verify_tree(
        tokens[:, None], torch.full((rows, 1), depth), draft_probs[:, None], target_probs[:, None], uniforms
    )
    assert torch.equal(verdict.num_accepted, expected.num_accepted)
    assert torch.equal(verdict.next_token_ids, expected.next_token_ids)
    assert torch.equal(verdict.target_draft_probs[:, 0], expected.target_draft_probs)
    assert torch.equal(verdict.next_token_probs, expected.next_token_probs)


def test_one_candidate_chains_are_the_tree_rule_bit_for_bit():
    """verify_chains (the engine's rule when every row has one candidate) gives verify_tree's whole verdict, on
    ragged lengths 0..K, sampled and one-hot drafts, one-hot (greedy) targets and rows where p == q."""
    generator = torch.Generator().manual_seed(11)
    rows, depth, vocab = 400, 5, 16
    target_probs = torch.softmax(torch.randn(rows, 1, depth + 1, vocab, generator=generator) * 3, -1)
    draft_probs = torch.softmax(torch.randn(rows, 1, depth, vocab, generator=generator) * 3, -1)
    tokens = torch.multinomial(draft_probs.reshape(-1, vocab), 1, generator=generator).reshape(rows, 1, depth)
    one_hot_drafts, greedy, same = slice(100, 200), slice(150, 250), slice(300, 340)  # overlapping kinds of rows
    draft_probs[one_hot_drafts] = torch.nn.functional.one_hot(tokens[one_hot_drafts], vocab).float()
    target_probs[greedy] = torch.nn.functional.one_hot(target_probs[greedy].argmax(-1), vocab).float()
    target_probs[same, :, :depth] = draft_probs[same]
    lengths = torch.randint(0, depth + 1, (rows, 1), generator=generator)
    uniforms = torch.rand(rows, depth + 1, dtype=torch.float64, generator=generator)
    inputs = (tokens, lengths, draft_probs, target_probs, uniforms)
    tree = verify_tree(*inputs)
    chains = verify_chains(*inputs)
    for name in tree.__dataclass_fields__:
        if name in ("choices", "noise"):  # the coupled rule's; None for this one
            assert getattr(chains, name) is None and getattr(tree, name) is None
            continue
        assert torch.equal(getattr(chains, name), getattr(tree, name)), name
    assert 0 < int(tree.num_accepted.sum()) < int(lengths.sum()) and bool((tree.num_accepted < lengths[:, 0]).any())
    assert verify_rows(*inputs).next_token_ids.equal(tree.next_token_ids)


def test_greedy_takes_the_longest_prefix_matching_the_argmax():
    argmax = [3, 1, 4, 1]  # the target's choice after each accepted prefix
    target_probs = torch.nn.functional.one_hot(torch.tensor(argmax), V).float().expand(3, 4, V)
    tokens = torch.tensor([[3, 2, 0], [3, 1, 4], [3, 1, 5]])  # accepts 1, accepts 3 (all), accepts 2
    verdict = verify_tree(
        tokens[None],
        torch.tensor([[3, 3, 3]]),
        torch.nn.functional.one_hot(tokens, V).float()[None],
        target_probs[None],
        torch.rand(1, 10, dtype=torch.float64),
    )
    assert (int(verdict.path), int(verdict.num_accepted), int(verdict.next_token_ids)) == (1, 3, 1)


def test_vmap_equals_the_per_sequence_loop():
    generator = torch.Generator().manual_seed(5)
    rows, num_candidates, depth, vocab = 64, 4, 5, 4096
    target_probs = torch.softmax(torch.randn(rows, num_candidates, depth + 1, vocab, generator=generator) * 3, -1)
    draft_probs = torch.softmax(torch.randn(rows, num_candidates, depth, vocab, generator=generator) * 3, -1)
    tokens = torch.multinomial(draft_probs.reshape(-1, vocab), 1, generator=generator).reshape(rows, num_candidates, -1)
    tokens[:, 1] = tokens[:, 0]  # duplicates, so later depths see several live candidates
    lengths = torch.randint(1, depth + 1, (rows, num_candidates), generator=generator)
    uniforms = torch.rand(rows, depth * num_candidates + 1, dtype=torch.float64, generator=generator)
    lifted = verify_tree(tokens, lengths, draft_probs, target_probs, uniforms)
    looped = [
        verify_candidates(*(t[b] for t in (tokens, lengths, draft_probs, target_probs, uniforms))) for b in range(rows)
    ]
    for b, (tested, accepted, _, _, path, num_accepted, next_id, next_prob) in enumerate(looped):
        assert torch.equal(tested, lifted.tested[b]) and torch.equal(accepted, lifted.accepted[b])
        assert (int(path), int(num_accepted), int(next_id)) == (
            int(lifted.path[b]),
            int(lifted.num_accepted[b]),
            int(lifted.next_token_ids[b]),
        )
        assert float(next_prob) == float(lifted.next_token_probs[b])
    draft_tokens = choose_draft_tokens(draft_probs[:, :, 0], uniforms[:, :num_candidates])  # [B, W]
    for b in range(rows):
        for w in range(num_candidates):
            assert int(draft_tokens[b, w]) == int(sample_one(draft_probs[b, w, 0], uniforms[b, w]))


@pytest.mark.parametrize("overflow", [float("inf"), -float("inf"), float("nan")])
def test_the_first_nonfinite_position_is_found_for_inf_minus_inf_and_nan_where_read(overflow: float) -> None:
    """Each candidate's first verified position whose scores hold `overflow`, N where none is read. Planted: only the
    largest score looked at (-inf missed)."""
    scores = torch.randn(3, 5, 49_152, generator=torch.Generator().manual_seed(0))  # [W, N, V]
    scores[0, 3, 17] = scores[0, 4, 0] = overflow  # found at 3
    scores[1, 1, -1] = overflow  # not read there: none found
    read = torch.ones(3, 5, dtype=torch.bool)
    read[1, 1] = False
    assert first_nonfinite(scores, read).tolist() == [3, 5, 5]
