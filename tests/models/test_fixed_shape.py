"""Fixed-shape passes (the GPU's): logits equal uncached ones through joins, candidates and departures, past a sliding
window too; every decoding pass has one shape; a token's logits are the same bits however it is verified (float32 on
this CPU, where tree passes differ); and the engine decodes with them what it decodes with tree passes."""

# R = PASS_ROWS, n = PASS_COLUMNS, L = a row's slots, V = vocab_size

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.engine.decoding import BatchDecoder, speculative_generate
from specdemo.models import fixed_shape, graphs, passes
from specdemo.models.fixed_shape import PASS_COLUMNS, PASS_ROWS, FixedShapeModel, slot_bucket
from specdemo.models.layout import RowRequest
from specdemo.models.tree_cache import TreeCachedModel
from tests.engine.test_batch import PROMPTS, SETTINGS
from tests.helpers import TINY_VOCAB, HostWaits, tiny_drafter, tiny_model
from tests.models.test_tree_cache import tiny_gemma

EOS = frozenset([1])


@pytest.mark.parametrize("model_kind", ["llama", "gemma-window-8"])
def test_fixed_shape_logits_equal_uncached_logits(model_kind, monkeypatch):
    """Random rows join, sit passes out, accept part of a candidate and leave; rows that name no capacity outgrow
    their slots (MIN_SLOTS made small) and move; logits stay those of the row alone, past the sliding window too."""
    monkeypatch.setattr(fixed_shape, "MIN_SLOTS", 16)
    model = tiny_model(0) if model_kind == "llama" else tiny_gemma(1)
    cached, rng, worst, checked = FixedShapeModel(model), random.Random(0), 0.0, 0
    rows = {key: [rng.randrange(TINY_VOCAB) for _ in range(rng.randint(1, 9))] for key in range(3)}
    capacity = {0: 80, 1: 0, 2: 0}
    for step in range(30):
        if step == 10:
            rows[7], capacity[7] = [rng.randrange(TINY_VOCAB) for _ in range(12)], 60
        if step == 20:
            rows.pop(0)
            cached.drop(0)
        keys = [key for key in rows if rng.random() < 0.8] or list(rows)
        asked = {}
        for key in keys:
            branches = [[rng.randrange(TINY_VOCAB) for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(0, 3))]
            asked[key] = RowRequest(rows[key], branches, "all", capacity[key])
        for (key, request), logits in zip(asked.items(), cached.logits(asked), strict=True):
            for w, branch in enumerate(request.branch_ids or [[]]):
                for depth in range(len(branch) + 1):
                    with torch.inference_mode():
                        alone = model(torch.tensor([request.trunk_ids + branch[:depth]])).logits[0, -1]
                    worst, checked = max(worst, float((logits[w, depth] - alone).abs().max())), checked + 1
            branch = rng.choice(request.branch_ids or [[]])  # the row accepts part of a candidate, as after a round
            rows[key] = rows[key] + branch[: rng.randint(0, len(branch))] + [rng.randrange(TINY_VOCAB)]
    assert worst < 1e-9 and checked > 200
    assert max(map(len, rows.values())) > 3 * 16, "no row outgrew its slots"
    for key in list(rows):
        cached.drop(key)
    assert not cached.leased and not any(group.used for group in cached.pools.idle), "a row left, its group held"
    assert cached.pools.idle, "emptied groups are kept for the next run"


def verified_logits(
    cached, sequence: list[int], rng: random.Random, vocab_size: int = TINY_VOCAB
) -> dict[int, torch.Tensor]:
    """The logits after each position of `sequence`, taken from draft verification: the sequence's own tokens as the
    second of two candidates (the first a wrong one), at random depths, beside a second row that decodes too."""
    found, position, other = {}, 8, list(sequence[:5])
    while position < len(sequence) - 1:
        draft = sequence[position : position + rng.randint(1, 6)]
        wrong = [rng.randrange(vocab_size) for _ in range(3)]
        asked = {
            0: RowRequest(sequence[:position], [wrong, draft], "all", 64),
            1: RowRequest(other, [wrong], "all", 64),
        }
        logits = cached.logits(asked)[0]  # [2, K+1, V]
        for depth in range(len(draft)):
            found[position + depth] = logits[1, depth]
        position += rng.randint(0, len(draft)) + 1  # some accepted, then the next token
        other = other + wrong[:1] + [rng.randrange(vocab_size)]
    return found


def stepped_logits(cached, sequence: list[int]) -> dict[int, torch.Tensor]:
    """The logits after each position of `sequence` from one-token steps, the row alone."""
    return {t: cached.logits({0: RowRequest(sequence[:t], [], "all", 64)})[0][0, 0] for t in range(8, len(sequence))}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tokens_logits_are_the_same_bits_however_it_is_verified(dtype):
    """Decoded alone one token a step, or verified at any depth of a second candidate beside another row: the same
    logits, bit for bit. Tree passes on this CPU give other bits in float32 for every position (a one-token step
    takes another matrix kernel): the control shows the test can fail here."""
    model = tiny_model(0).to(dtype)
    rng = random.Random(0)
    sequence = [rng.randrange(TINY_VOCAB) for _ in range(48)]
    alone = stepped_logits(FixedShapeModel(model), sequence)
    verified = verified_logits(FixedShapeModel(model), sequence, rng)
    assert len(verified) > 30
    differing = [t for t in verified if not torch.equal(verified[t], alone[t])]
    assert not differing, f"positions {differing} have other bits when verified"
    if dtype == torch.float32:
        tree_alone = stepped_logits(TreeCachedModel(model), sequence)
        tree_verified = verified_logits(TreeCachedModel(model), sequence, random.Random(0))
        assert any(not torch.equal(tree_verified[t], tree_alone[t]) for t in tree_verified), (
            "the control lost its power"
        )


def test_every_decoding_pass_has_one_shape(tiny_target, tiny_draft, tiny_trained_head, monkeypatch):
    """Rows of three lengths, target-only and speculative with up to three candidates, joining a running batch: every
    pass reads R x n tokens over a row's L slots, except the passes that read a prompt, each [1, its length - 1]."""
    monkeypatch.setenv(passes.PASS_SHAPE_VARIABLE, "fixed")
    shapes = []
    hook = tiny_target.register_forward_pre_hook(
        lambda _, args, kwargs: shapes.append((tuple(kwargs["input_ids"].shape), kwargs["attention_mask"].shape[-1])),
        with_kwargs=True,
    )
    try:
        decoder = BatchDecoder(tiny_target, tiny_drafter("hybrid", tiny_draft, tiny_trained_head), EOS)
        for row in range(3):
            spec = SpeculativeConfig(num_draft_tokens=5, max_new_tokens=20, num_candidates=row + 1)
            decoder.add(row, PROMPTS[row], SETTINGS[row][0], spec, drafting=row > 0)
        joined = False
        while decoder.rows:
            decoder.step()
            if len(decoder.rows) == 2 and not joined:  # joins a running batch
                decoder.add(3, PROMPTS[3], SamplingConfig(), SpeculativeConfig(max_new_tokens=10))
                joined = True
    finally:
        hook.remove()
    reads = [shape for shape in shapes if shape[0][0] == 1]
    decodes = [shape for shape in shapes if shape[0][0] != 1]
    expected = [((1, len(p) - 1), slot_bucket(len(p) + 20)) for p in PROMPTS[:3]]
    assert sorted(reads) == sorted([*expected, ((1, len(PROMPTS[3]) - 1), slot_bucket(len(PROMPTS[3]) + 10))])
    assert len(decodes) > 10 and {tokens for tokens, _ in decodes} == {(PASS_ROWS, PASS_COLUMNS)}, decodes


@pytest.mark.parametrize("num_candidates", [1, 3])
@pytest.mark.parametrize("drafter_kind", ["ngram", "suffix", "model", "recurrent", "hybrid"])
def test_the_engine_decodes_with_fixed_shapes_what_it_decodes_with_tree_passes(
    tiny_target, tiny_draft, tiny_trained_head, drafter_kind, num_candidates, monkeypatch
):
    """A ragged batch of greedy and sampled rows, in float64: the same rounds, token for token, with either cache."""

    def decode(shape: str) -> dict[int, list]:
        monkeypatch.setenv(passes.PASS_SHAPE_VARIABLE, shape)
        decoder = BatchDecoder(tiny_target, tiny_drafter(drafter_kind, tiny_draft, tiny_trained_head), EOS)
        assert isinstance(decoder.verifier, FixedShapeModel if shape == "fixed" else TreeCachedModel)
        for row, (sampling, limit) in enumerate(SETTINGS):
            spec = SpeculativeConfig(num_draft_tokens=3, max_new_tokens=limit, num_candidates=num_candidates)
            decoder.add(row, PROMPTS[row], sampling, spec)
        rounds: dict[int, list] = {row: [] for row in range(len(SETTINGS))}
        while decoder.rows:
            for row, round_ in decoder.step():
                rounds[row].append((round_.draft_token_ids, round_.num_accepted, round_.emitted_token_ids))
        return rounds

    fixed, tree = decode("fixed"), decode("tree")
    assert fixed == tree
    assert any(accepted for rounds in fixed.values() for _, accepted, _ in rounds), "nothing was ever accepted"


def test_greedy_speculative_text_is_target_only_text_with_fixed_shapes_in_float32(monkeypatch):
    """Every drafter kind with three candidates on a float32 model: speculative text is target-only text, as on a
    GPU in bfloat16; the hidden state the head reads comes from the same passes."""
    monkeypatch.setenv(passes.PASS_SHAPE_VARIABLE, "fixed")
    target = tiny_model(1).float()
    spec = SpeculativeConfig(num_draft_tokens=4, max_new_tokens=40, num_candidates=3)
    prompt = torch.tensor([PROMPTS[2]])
    alone = speculative_generate(target, tiny_drafter("none", None, None), prompt, SamplingConfig(), spec, EOS)
    expected = [token for round_ in alone for token in round_.emitted_token_ids]
    for kind in ("ngram", "suffix", "model"):
        draft = tiny_model(2, num_layers=1).float()
        rounds = list(
            speculative_generate(target, tiny_drafter(kind, draft, None), prompt, SamplingConfig(), spec, EOS)
        )
        assert [token for round_ in rounds for token in round_.emitted_token_ids] == expected, kind


def test_a_pass_makes_the_host_wait_nowhere_so_a_cuda_graph_can_capture_it(tiny_target):
    """The CPU's proxies for a pass that a CUDA graph can capture (issue 37): run_pass reads no value back to the host
    (HostWaits counts none), and torch.compile(fullgraph=True) traces it whole, so no branch on a tensor's value hides
    in it; the traced pass gives the eager pass's logits."""
    passes = FixedShapeModel(tiny_target)
    prompt = PROMPTS[0]
    with torch.inference_mode():
        passes.logits({"row": RowRequest(prompt, [], "all", capacity=len(prompt) + 8)})
        pool = passes.rows["row"].chains[0].group
        ids = torch.zeros(PASS_ROWS, PASS_COLUMNS, dtype=torch.long)
        real = torch.zeros(PASS_ROWS, PASS_COLUMNS, dtype=torch.bool)
        positions = torch.zeros(PASS_ROWS, PASS_COLUMNS, dtype=torch.long)
        ids[0, :3], real[0, :3], positions[0, :3] = (
            torch.tensor([prompt[-1], 5, 6]),
            True,
            torch.arange(3) + len(prompt) - 1,
        )
        given = (pool, 0, ids, positions, torch.where(real, positions, pool.slots - 1), real, PASS_COLUMNS)
        with HostWaits() as waits:
            eager = passes.run_pass(*given)[0]
        assert waits.calls == []
        traced = torch.compile(passes.run_pass, fullgraph=True, backend="eager")(*given)[0]
        assert torch.equal(traced, eager)


def test_a_failed_graph_capture_decodes_eagerly_with_one_line_in_the_log(monkeypatch, caplog):
    """Graphs asked for where none can be captured (the CPU): the passes run eagerly, the text is the eager text,
    and the log says so once."""
    monkeypatch.setenv(passes.PASS_SHAPE_VARIABLE, "fixed")
    target = tiny_model(1)
    spec = SpeculativeConfig(num_draft_tokens=4, max_new_tokens=12)
    prompt = torch.tensor([PROMPTS[1]])

    def text(on: str) -> list[int]:
        monkeypatch.setenv(graphs.GRAPHS_VARIABLE, on)
        rounds = speculative_generate(target, tiny_drafter("ngram", None, None), prompt, SamplingConfig(), spec, EOS)
        return [token for round_ in rounds for token in round_.emitted_token_ids]

    eager = text("0")
    with caplog.at_level("WARNING", logger=fixed_shape.__name__):
        assert text("1") == eager
    assert [record.getMessage()[:50] for record in caplog.records] == [
        "specdemo: decoding without CUDA graphs: capturing "
    ]


@pytest.mark.parametrize("rule", ["standard", "coupled"])
@pytest.mark.parametrize("drafter_kind", ["ngram", "model"])
def test_a_round_decided_on_the_device_reports_what_the_eager_rule_reports(
    tiny_target, tiny_draft, tiny_trained_head, drafter_kind, rule, monkeypatch
):
    """Greedy and sampled rows (top-k, top-p, a penalty), one candidate each, the sampled ones under either rule: every
    number a Round carries from a round decided whole in one program (core/chain_round.py, read back from its packed
    tensor) is what the eager rule on tree passes reports: the trace's columns, the next token's kind and probability,
    the inspector's views (their tokens, p, q and residual, and the rest) and the coupled rule's choices. Planted:
    views read one position late (read_views), the residual left unnormalised (_view_entries), and the choices' x
    scored with y's column (read_choices); each fails."""

    def decode(shape: str) -> list:
        monkeypatch.setenv(passes.PASS_SHAPE_VARIABLE, shape)
        decoder = BatchDecoder(tiny_target, tiny_drafter(drafter_kind, tiny_draft, tiny_trained_head), EOS)
        for row, (sampling, limit) in enumerate(SETTINGS):
            sampling = replace(sampling, rule=rule)
            decoder.add(row, PROMPTS[row], sampling, SpeculativeConfig(num_draft_tokens=3, max_new_tokens=limit))
        found = []
        while decoder.rows:
            found += sorted(decoder.step(), key=lambda outcome: outcome[0])
        return found

    fixed, tree = decode("fixed"), decode("tree")
    assert [key for key, _ in fixed] == [key for key, _ in tree]
    views = choices = 0
    for (_, ours), (_, theirs) in zip(fixed, tree, strict=True):
        assert ours.draft_token_ids == theirs.draft_token_ids and ours.next_kind == theirs.next_kind
        for name in ("target_probs", "draft_probs", "acceptance_probs", "uniforms"):
            assert getattr(ours, name) == pytest.approx(getattr(theirs, name), abs=1e-6), name
        assert ours.next_token_prob == pytest.approx(theirs.next_token_prob, abs=1e-6)
        assert len(ours.views) == len(theirs.views)
        for mine, other in zip(ours.views, theirs.views, strict=True):
            mine_by_id, other_by_id = _entries(mine), _entries(other)
            assert set(mine_by_id) == set(other_by_id) or _ties(mine, other), (mine, other)
            for token in set(mine_by_id) & set(other_by_id):
                assert mine_by_id[token] == pytest.approx(other_by_id[token], abs=1e-6)
            for name in ("target_rest", "draft_rest", "residual_rest"):
                assert getattr(mine, name) == pytest.approx(getattr(other, name), abs=1e-5), name
            views += 1
        assert len(ours.coupled) == len(theirs.coupled)
        for mine, other in zip(ours.coupled, theirs.coupled, strict=True):
            assert _same_choice(mine, other), (mine, other)
            choices += 1
    assert views > 20
    assert choices > 20 if rule == "coupled" else choices == 0


def _same_choice(mine, other) -> bool:
    """Two CoupledChoices alike: ids and counts equal, scores, noise and chances within 1e-6."""
    for name in ("target_id", "draft_id", "num_alive"):
        if getattr(mine, name) != getattr(other, name):
            return False
    names = ("target_score", "target_noise", "draft_score", "draft_noise", "standard_chance", "coupled_chance",
             "coupled_chance_high")  # fmt: skip
    for name in names:
        ours, theirs = getattr(mine, name), getattr(other, name)
        if (ours is None) != (theirs is None) or (
            theirs is not None and ours != pytest.approx(theirs, rel=1e-6, abs=1e-9)
        ):
            return False
    return True


def _entries(view) -> dict[int, tuple[float, float, float]]:
    """A view's (p, q, residual) by token."""
    residual = view.residual or [0.0] * len(view.token_ids)
    return dict(zip(view.token_ids, zip(view.target, view.draft, residual, strict=True), strict=True))


def _ties(mine, other) -> bool:
    """Two views that keep different tokens only where the top entries tie (topk breaks ties its own way)."""
    least = min(max(t, d) for t, d in zip(mine.target, mine.draft, strict=True))
    return all(max(t, d) == pytest.approx(least, abs=1e-6) for t, d in zip(other.target, other.draft, strict=True)
               if t not in mine.token_ids)  # fmt: skip
