"""The recurrent drafter: the vmapped sample_seq is the per-sequence loop; q is what it sampled from (0 off its
sub-vocabulary); the engine's rule with its sampled beams, alone or beside a copy, follows the target at N = 200,000;
greedy decoding with it is target-only decoding; its head file refuses other weights and damage in one sentence."""

from __future__ import annotations

import pytest
import torch

from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.core.planning import PassCosts
from specdemo.core.stats import emitted_ids
from specdemo.drafters.base import DraftRequest
from specdemo.drafters.head_file import load_head, save_head, target_fingerprint
from specdemo.drafters.hybrid import HybridDrafter
from specdemo.drafters.recurrent import RecurrentDrafter
from specdemo.drafters.suffix import SuffixDrafter
from specdemo.engine.decoding import BatchDecoder, autoregressive_generate, speculative_generate
from specdemo.models import graphs, passes
from tests.core.test_candidates import NUM_SAMPLES, V, emitted_counts, follows_target, verify_rule
from tests.helpers import FREE, TINY_VOCAB, StandIn, WarmingStandIn, tiny_drafter, tiny_model, tiny_recurrent_head

EOS = frozenset([1])
PROMPT = torch.tensor([[0, 5, 9, 5, 9, 12, 7]])


@pytest.fixture(scope="module")
def head(tiny_target):
    return tiny_recurrent_head(tiny_target, seed=0, vocabulary_size=24)


def test_vmapped_sample_seq_equals_the_per_sequence_loop(head):
    rows, width, depth = 3, 2, 4
    generator = torch.Generator().manual_seed(0)
    states = torch.randn(rows, head.shape.hidden_size, generator=generator)
    tokens = torch.randint(0, TINY_VOCAB, (rows,), generator=generator)
    uniforms = torch.rand(rows, width, depth, dtype=torch.float64, generator=generator)
    temperatures = torch.tensor([1.0, 0.7, 1.5])
    with torch.no_grad():
        ids, q = head.sample_beams(states, tokens, uniforms, temperatures)
        for r in range(rows):
            for w in range(width):
                alone_ids, alone_q = head.sample_seq(states[r], tokens[r], uniforms[r, w], temperatures[r])
                assert torch.equal(alone_ids, ids[r, w]) and torch.allclose(alone_q, q[r, w])
    assert len({tuple(row) for row in ids.flatten(0, 1).tolist()}) > 1, "every beam alike: the test proves little"


def test_q_is_zero_off_the_sub_vocabulary_and_only_sub_vocabulary_tokens_are_drafted(head):
    drafter = RecurrentDrafter(head, TINY_VOCAB)
    generator = torch.Generator().manual_seed(1)
    request = DraftRequest(
        0, [0, 5, 9], 4, 3, SamplingConfig(temperature=1.0), generator, torch.randn(head.shape.hidden_size)
    )
    (draft,) = drafter.propose([request])
    assert draft.probs is not None and draft.probs.shape == (3, 4, TINY_VOCAB)
    assert torch.all(draft.probs[..., 24:] == 0) and torch.allclose(draft.probs.sum(-1), torch.ones(3, 4))
    assert all(token < 24 for candidate in draft.token_ids for token in candidate)
    (first,) = drafter.propose([DraftRequest(1, [0, 5], 4, 1, SamplingConfig(), generator)])  # no state yet
    assert first.token_ids == []


def head_draws(head, width: int, copy: bool):
    """draw_candidates for test_candidates' Markov chain, by the head: the previous token is the token the target
    chose, its embedding the state of each layer the head reads (scaled apart); W sampled beams, after a copy
    (previous + 1, ...) with a one-hot q if `copy`."""

    def draw(previous, draft_table, num_candidates, depth, deterministic, generator):
        embedded = head.embedding[previous]  # [N, H]
        states = torch.cat([embedded * (i + 1) for i in range(len(head.shape.layers))], dim=-1)  # [N, F]
        uniforms = torch.rand(len(previous), width, depth, dtype=torch.float64, generator=generator)
        with torch.no_grad():
            ids, q = head.sample_beams(states, previous, uniforms, torch.ones(len(previous)))  # [N, W, K], .. U]
        probs = torch.nn.functional.pad(q, (0, V - q.shape[-1]))  # [N, W, K, V]
        if copy:
            copied = (previous[:, None] + torch.arange(1, depth + 1)) % V  # [N, K]
            ids = torch.cat([copied[:, None], ids], dim=1)
            probs = torch.cat([torch.nn.functional.one_hot(copied, V).float()[:, None], probs], dim=1)
        return ids, probs

    return draw


@pytest.mark.slow  # N = 200,000 twice: make test runs it, make test-fast (under a minute) does not
@pytest.mark.parametrize("copy", [False, True], ids=["rnn-beams", "hybrid-copy-and-beams"])
def test_the_rule_with_sampled_rnn_beams_follows_the_target(copy):
    """N = 200,000 runs of rounds of the Markov target of test_candidates, drafted by a head that fuses two layers, over
    6 of its 8 tokens (q = 0 for 6 and 7), W = 2 beams, K = 3; with `copy` a deterministic copy is tried first, as the
    hybrid does."""
    head = tiny_recurrent_head(tiny_model(5, vocab_size=V), seed=3, vocabulary_size=6, layers=(1, -1))
    counts = emitted_counts(verify_rule, 3 if copy else 2, 3, False, draw=head_draws(head, 2, copy))
    ok, stats = follows_target(counts)
    assert ok, f"(chi-square p, TV) per position: {stats}"
    assert counts.sum(1).eq(NUM_SAMPLES).all()


@pytest.mark.parametrize("num_candidates", [1, 3])
def test_greedy_decoding_with_the_head_is_target_only_decoding(tiny_target, tiny_trained_head, num_candidates):
    """Beam search's W deterministic candidates at temperature 0: the same tokens as the target alone, and
    more than one token a pass now and then."""
    spec = SpeculativeConfig(num_draft_tokens=3, max_new_tokens=30, num_candidates=num_candidates)
    drafter = RecurrentDrafter(tiny_trained_head, TINY_VOCAB)
    rounds = list(speculative_generate(tiny_target, drafter, PROMPT, SamplingConfig(), spec, EOS))
    alone = list(autoregressive_generate(tiny_target, PROMPT, SamplingConfig(), 30, EOS))
    assert emitted_ids(rounds) == emitted_ids(alone)
    assert not rounds[0].draft_token_ids, "the first round has no hidden state to draft from"
    assert all(len(r.candidates) == num_candidates for r in rounds[1:-1])
    assert sum(r.num_accepted for r in rounds) > 0, "nothing accepted: the test proves little"


def test_a_head_for_other_weights_or_a_damaged_one_is_refused_in_one_sentence(tiny_target, head, tmp_path):
    path = tmp_path / "head.pt"
    save_head(head, path, target_fingerprint(tiny_target), {})
    assert torch.equal(load_head(tiny_target, path).vocabulary, head.vocabulary)
    with pytest.raises(ValueError, match=r"trained for other target weights \(hash .*train-drafter"):
        load_head(tiny_model(9), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"is damaged or not a head file .*train-drafter"):
        load_head(tiny_target, path)
    path.write_bytes(b"not a head")
    with pytest.raises(ValueError, match="is damaged or not a head file"):
        load_head(tiny_target, path)
    with pytest.raises(ValueError, match="No recurrent head at"):
        load_head(tiny_target, tmp_path / "missing.pt")


def test_an_older_head_or_one_for_other_layers_is_refused_in_one_sentence(tiny_target, tiny_trained_head, tmp_path):
    """A head file of format 1 (it read the final state alone), one naming layers this target has not, and one whose
    fusion was trained for another number of layers are each refused, naming train-drafter; never misread."""
    path = tmp_path / "head.pt"
    save_head(tiny_trained_head, path, target_fingerprint(tiny_target), {})
    record = torch.load(path, weights_only=True)
    assert load_head(tiny_target, path).shape.layers == tiny_trained_head.shape.layers
    cases = [
        ({"format": "specdemo-recurrent-head/1"}, r"made by another version of specdemo \(specdemo-recurrent-head/1"),
        ({"layers": [1, 7]}, r"layers \[1, 7\] are not among the target's hidden states 0\.\.2"),
        ({"layers": [2]}, r"is damaged or not a head file .*fuse"),
    ]
    for change, message in cases:
        torch.save(record | change, path)
        with pytest.raises(ValueError, match=message) as refusal:
            load_head(tiny_target, path)
        assert "`python -m specdemo train-drafter`" in str(refusal.value) and "\n" not in str(refusal.value)


@pytest.mark.parametrize("num_candidates", [1, 3])
def test_the_engine_hands_the_head_the_targets_state_at_the_last_accepted_position(
    tiny_target, tiny_trained_head, num_candidates
):
    """After every round (a row batched with another, sampled), the state a row keeps is the target's hidden states of
    the layers the head reads (an early one and the final one, concatenated) over its sequence but the last token,
    computed alone: the states whose logits chose that token."""
    layers = tiny_trained_head.shape.layers
    assert len(layers) == 2 and layers[-1] == tiny_target.config.num_hidden_layers, layers
    decoder = BatchDecoder(tiny_target, RecurrentDrafter(tiny_trained_head, TINY_VOCAB), EOS)
    spec = SpeculativeConfig(num_draft_tokens=3, max_new_tokens=24, num_candidates=num_candidates)
    decoder.add("a", PROMPT[0].tolist(), SamplingConfig(temperature=0.8, seed=1), spec)
    decoder.add("b", [0, 3, 4], SamplingConfig(), spec)
    accepted = 0
    while decoder.rows:
        for key, round_ in decoder.step():
            accepted += round_.num_accepted
            row = decoder.rows.get(key)
            if row is None:
                continue
            with torch.no_grad():
                alone = tiny_target(torch.tensor([row.sequence_ids[:-1]]), output_hidden_states=True)
            expected = torch.cat([alone.hidden_states[layer][0, -1] for layer in layers])
            assert torch.allclose(row.hidden_state, expected, atol=1e-9), key
    assert accepted > 0


@pytest.mark.parametrize("width", [1, 2, 3])
def test_the_hybrid_proposes_at_most_w_candidates_and_greedy_is_target_only(tiny_target, tiny_trained_head, width):
    """Greedy, a repetitive prompt: the tokens of the target alone, never more than W candidates (DraftRequest's
    promise; it once gave 2W - 1), each named in the trace; at W = 1 the copy wins some rounds and the head others,
    at W >= 2 some rounds test both."""
    prompt = torch.tensor([[0, 5, 9, 12, 7, 5, 9, 12, 7, 5, 9]])
    head = RecurrentDrafter(tiny_trained_head, TINY_VOCAB)
    drafter = HybridDrafter(SuffixDrafter(FREE, cache_tokens=0), head, lambda n: FREE, TINY_VOCAB)
    spec = SpeculativeConfig(num_draft_tokens=4, max_new_tokens=40, num_candidates=width)
    rounds = list(speculative_generate(tiny_target, drafter, prompt, SamplingConfig(), spec, EOS))
    alone = list(autoregressive_generate(tiny_target, prompt, SamplingConfig(), 40, EOS))
    assert emitted_ids(rounds) == emitted_ids(alone)
    sources = [tuple(c.source for c in r.candidates) for r in rounds]
    assert max(map(len, sources)) <= width, sources
    if width == 1:
        assert {("copy",), ("head",)} <= set(sources), sources
    else:
        assert ("copy", "head") in sources or ("head", "copy") in sources, sources


STEEP = PassCosts.from_seconds({n: float(n) for n in (1, 2, 4, 8, 16, 32)})  # t(n) = n t(1): no draft can pay


@pytest.mark.parametrize("costs", ["steep", "free"])
def test_the_hybrids_head_runs_only_where_and_as_deep_as_its_draft_could_pay(tiny_target, tiny_trained_head, costs):
    """Where a pass costs in proportion to its tokens (a machine where drafting does not pay), no draft is worth its
    tokens: the head never runs and every round is a one-token step, as cheap as the target's own. Where passes are
    free, the head runs on every round that has a state, at the full depth. Greedy, the text is the target's."""
    prompt = torch.tensor([[0, 5, 9, 12, 7, 5, 9, 12, 7, 5, 9]])
    planned = STEEP if costs == "steep" else FREE
    head = RecurrentDrafter(tiny_trained_head, TINY_VOCAB)
    asked: list[list[int]] = []  # the depths the head was asked for, per call
    propose = head.propose
    head.propose = lambda requests: asked.append([r.num_draft_tokens for r in requests]) or propose(requests)
    drafter = HybridDrafter(SuffixDrafter(lambda n: planned, cache_tokens=0), head, lambda n: planned, TINY_VOCAB)
    spec = SpeculativeConfig(num_draft_tokens=4, max_new_tokens=30, num_candidates=2)
    rounds = list(speculative_generate(tiny_target, drafter, prompt, SamplingConfig(), spec, EOS))
    alone = list(autoregressive_generate(tiny_target, prompt, SamplingConfig(), 30, EOS))
    assert emitted_ids(rounds) == emitted_ids(alone)
    if costs == "steep":
        assert asked == [] and all(not r.candidates for r in rounds)
    else:
        kept = sum("head" in [c.source for c in r.candidates] for r in rounds)  # all but the first and last
        assert kept >= len(rounds) - 2 and asked == [[4]] * kept, (asked, kept)


@pytest.mark.parametrize("kind", ["recurrent", "hybrid"])
def test_the_heads_steps_as_programs_draft_what_the_head_drafts_eagerly(
    tiny_target, tiny_trained_head, kind, monkeypatch
):
    """Where the target's rounds replay graphs, the head's K steps are one program per (rows, rule, W, K)
    (drafters/head_steps.py): with captures that warm up as CUDA's do, greedy and sampled rows at W = 1 and 3 get
    the rounds they get from the head run eagerly; a second run captures nothing new. Planted: programs keyed without
    K (a shorter last round replays the longer one's steps); it fails."""
    monkeypatch.setenv(passes.PASS_SHAPE_VARIABLE, "fixed")
    settings = [SamplingConfig(), SamplingConfig(temperature=0.9, seed=5), SamplingConfig(temperature=1.2, seed=6)]

    def rounds(graphs_on: str, drafter) -> dict:
        monkeypatch.setenv(graphs.GRAPHS_VARIABLE, graphs_on)
        decoder = BatchDecoder(tiny_target, drafter, EOS)
        for row, sampling in enumerate(settings):
            spec = SpeculativeConfig(num_draft_tokens=4, max_new_tokens=15, num_candidates=1 + 2 * (row == 2))
            decoder.add(row, [1 + row, 5, 9, 5, 9], sampling, spec)
        found: dict[int, list] = {row: [] for row in range(len(settings))}
        while decoder.rows:
            for row, round_ in decoder.step():
                found[row].append((round_.draft_token_ids, round_.num_accepted, round_.emitted_token_ids))
        return found

    eager = rounds("0", tiny_drafter(kind, None, tiny_trained_head))
    drafter = tiny_drafter(kind, None, tiny_trained_head)
    with graphs.standing_in(WarmingStandIn):
        StandIn.captures = 0
        assert rounds("1", drafter) == eager
        captured = StandIn.captures
        assert rounds("1", drafter) == eager and StandIn.captures == captured
    head = drafter if kind == "recurrent" else drafter.head
    assert head.steps.programs and all(captured for (_, _, captured) in head.steps.programs)
