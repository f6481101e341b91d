"""Promises of the public API that other projects' speculative-decoding tests (vLLM's, transformers'), ported to it,
found broken: at most W candidates, a draft model with fewer embedding rows than the target, one meaning for the
padding id, depths past the cap, and a device out of memory."""

from __future__ import annotations

import pytest
import torch

from specdemo import (
    PADDING_ID,
    DraftRequest,
    ModelDrafter,
    SamplingConfig,
    SpeculativeConfig,
    rejection_sample,
    speculative_generate,
    verify_rows,
)
from specdemo.config import MAX_NUM_DRAFT_TOKENS
from specdemo.core.stats import emitted_ids
from specdemo.engine.decoding import BatchDecoder
from tests.helpers import TINY_VOCAB, tiny_drafter, tiny_model

EOS = frozenset([1])


@pytest.mark.parametrize("width", [1, 2, 3])
def test_the_hybrid_proposes_at_most_the_candidates_asked_for(tiny_target, tiny_trained_head, width):
    """DraftRequest promises at most num_candidates; the hybrid gave up to 2W - 1 (two at W = 1)."""
    drafter = tiny_drafter("hybrid", None, tiny_trained_head)
    generator = torch.Generator(device="cpu").manual_seed(0)
    sequence = [0, 5, 9, 12, 7, 5, 9, 12, 7, 5, 9]
    width_of_state = len(tiny_trained_head.shape.layers) * tiny_target.config.hidden_size  # the layers it reads
    state = torch.randn(width_of_state, generator=generator, device="cpu").double()
    for sampling in (SamplingConfig(), SamplingConfig(temperature=1.0)):
        request = DraftRequest(0, sequence, 4, width, sampling, generator, state)
        (draft,) = drafter.propose([request])
        assert 0 < len(draft.token_ids) <= width, (width, draft.token_ids)
        assert draft.probs is None or draft.probs.shape[0] == len(draft.token_ids)


def test_a_draft_model_with_fewer_embedding_rows_than_the_target_drafts_after_their_ids():
    """Qwen2.5-0.5B has 151,936 embedding rows and Qwen2.5-7B 152,064: the target may emit an id the draft cannot
    read. It reads a stand-in there (IndexError before), and never drafts such an id; the text stays the target's."""
    target, draft = tiny_model(1, vocab_size=TINY_VOCAB + 8), tiny_model(2, vocab_size=TINY_VOCAB, num_layers=1)
    with torch.no_grad():  # the target favours the ids the draft has no row for
        target.lm_head.weight[TINY_VOCAB:] *= 3.0
    prompt = torch.tensor([[0, 5, 9, 5, 9, 12, 7, TINY_VOCAB + 3]])
    for sampling in (SamplingConfig(), SamplingConfig(temperature=1.0, seed=3)):
        drafter = ModelDrafter(draft, None, TINY_VOCAB + 8)
        spec = SpeculativeConfig(num_draft_tokens=3, max_new_tokens=24)
        rounds = list(speculative_generate(target, drafter, prompt, sampling, spec, EOS))
        emitted = emitted_ids(rounds)
        assert any(token >= TINY_VOCAB for token in emitted), "the target never emitted an id the draft cannot read"
        assert all(token < TINY_VOCAB for r in rounds for token in r.draft_token_ids)
        if sampling.is_greedy:
            alone = speculative_generate(target, tiny_drafter("none", None, None), prompt, sampling, spec, EOS)
            assert emitted == emitted_ids(alone)


def one_hot_setting(num_candidates: int) -> tuple[torch.Tensor, ...]:
    """A row of W candidates of K = 3 whose first candidate holds the padding id at depth 1."""
    ids = torch.tensor([[[2, PADDING_ID, 4]] + [[5, 6, 7]] * (num_candidates - 1)])  # [1, W, 3]
    lengths = torch.full((1, num_candidates), 3)
    draft_probs = torch.full((1, num_candidates, 3, 8), 1 / 8, dtype=torch.float64)
    target_probs = torch.full((1, num_candidates, 4, 8), 1 / 8, dtype=torch.float64)
    uniforms = torch.zeros(1, 3 * num_candidates + 1, dtype=torch.float64)
    return ids, lengths, draft_probs, target_probs, uniforms


@pytest.mark.parametrize("num_candidates", [1, 2, 3])
def test_the_padding_id_in_a_draft_is_refused_alike_with_any_number_of_candidates(num_candidates):
    """-1 pads the rule's output; inside a draft it was refused with one candidate and accepted with two."""
    with pytest.raises(ValueError, match=r"Draft token 1 of candidate 0 in row 0 is -1, not a token id in \[0, 8\)"):
        verify_rows(*one_hot_setting(num_candidates))
    ids, lengths, draft_probs, target_probs, uniforms = one_hot_setting(num_candidates)
    lengths[0, 0] = 1  # past a candidate's length the id is padding, and ignored
    verify_rows(ids, lengths, draft_probs, target_probs, uniforms)


def test_rejection_sample_refuses_the_padding_id_and_ids_past_the_vocabulary():
    probs = torch.full((1, 3, 8), 1 / 8, dtype=torch.float64)
    for bad in (PADDING_ID, 8):
        with pytest.raises(ValueError, match=rf"is {bad}, not a token id in \[0, 8\)"):
            rejection_sample(torch.tensor([[1, bad]]), probs[:, :2], probs)


@pytest.mark.parametrize("kind", ["ngram", "suffix", "recurrent", "hybrid"])
def test_a_depth_past_the_cap_is_refused_in_one_sentence(kind, tiny_trained_head):
    drafter = tiny_drafter(kind, None, tiny_trained_head)
    generator = torch.Generator(device="cpu")
    with pytest.raises(ValueError, match=f"num-draft-tokens must be between 0 and {MAX_NUM_DRAFT_TOKENS}, got 17"):
        drafter.propose([DraftRequest(0, [0, 5, 9], MAX_NUM_DRAFT_TOKENS + 1, 1, SamplingConfig(), generator)])


def test_out_of_device_memory_fails_the_row_that_joined_and_the_others_go_on(tiny_target, monkeypatch):
    """A row joins with a prompt the device cannot hold: it leaves with one sentence naming the memory, and the rows
    already decoding go on to the tokens they emit alone. When no row joined, every row leaves with the sentence."""
    decoder = BatchDecoder(tiny_target, tiny_drafter("ngram", None, None), EOS)
    prompts = {0: [0, 5, 9, 5, 9, 12, 7], 1: [0, 10, 19, 5, 21, 5, 13], 2: [0, 3] * 40}
    spec = SpeculativeConfig(num_draft_tokens=3, max_new_tokens=20)
    for row in (0, 1):
        decoder.add(row, prompts[row], SamplingConfig(temperature=0.9, seed=row + 10), spec)
    rounds: dict[int, list] = {0: [], 1: []}
    for row, round_ in decoder.step():
        rounds[row].append(round_)
    original = type(decoder.verifier).logits

    def logits(verifier, asked):
        if any(len(request.trunk_ids) > 50 for request in asked.values()):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return original(verifier, asked)

    monkeypatch.setattr(type(decoder.verifier), "logits", logits)
    decoder.add(2, prompts[2], SamplingConfig(), spec)
    outcomes = dict(decoder.step())
    assert isinstance(outcomes[2], ValueError) and 2 not in decoder.rows
    for row in (0, 1):  # the others took their round
        rounds[row].append(outcomes[row])
    assert str(outcomes[2]).startswith("This run needed more memory than the cpu device had (")
    assert "GiB free): lower max-new-tokens, the batch size or num-candidates" in str(outcomes[2])
    while decoder.rows:
        for row, round_ in decoder.step():
            rounds[row].append(round_)
    for row in (0, 1):
        alone = speculative_generate(
            tiny_target, tiny_drafter("ngram", None, None), torch.tensor([prompts[row]]),
            SamplingConfig(temperature=0.9, seed=row + 10), spec, EOS,
        )  # fmt: skip
        assert emitted_ids(rounds[row]) == emitted_ids(alone), row
    decoder.add(3, prompts[2], SamplingConfig(), spec)
    decoder.add(4, prompts[0], SamplingConfig(), spec)
    for row, round_ in decoder.step():  # both joined: both leave
        assert isinstance(round_, ValueError), row
    assert not decoder.rows
