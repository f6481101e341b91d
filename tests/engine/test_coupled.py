"""Same seed, same text: under the coupled rule a sampled speculative run writes the target-only run's text for its
seed, token for token, for every drafter kind, K in {1, 4, 16}, W in {1, 3}, B in {1, 8}, T in {0.7, 1.0}, with and
without top-p 0.9, on the tiny models (float64) and on the offline model (float32 and bfloat16: a smaller grid here,
the whole one in `python -m benchmarks.coupled identity`); beside standard-rule rows in one batch; and on the GPU's
fixed-shape passes dry-run on the CPU."""

# B = rows, K = num_draft_tokens, W = num_candidates

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import replace

import pytest
import torch

from specdemo.audit.bugs import noise_for
from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.core.coupled import Noise, position_noise
from specdemo.core.rules import CoupledRule
from specdemo.drafters import Drafter, ModelDrafter, NoDrafter
from specdemo.engine.decoding import BatchDecoder, DrafterFailed
from specdemo.engine.drafting import build_drafter
from specdemo.models import passes
from tests.helpers import TINY_VOCAB, tiny_drafter, tiny_model

KINDS = ("ngram", "suffix", "model", "recurrent", "hybrid")
SETTINGS = [(0.7, 1.0), (0.7, 0.9), (1.0, 1.0), (1.0, 0.9)]  # temperature, top-p
TINY_PROMPTS = ([0, 5, 9, 5, 9, 12, 7, 5, 9], [0, 10, 19, 5, 21, 5, 13, 13, 21, 4])


def samplings(seed: int = 0) -> list[SamplingConfig]:
    """Eight rows: each setting with two seeds."""
    return [
        SamplingConfig(temperature=t, top_p=p, rule="coupled", seed=seed + 2 * i + j)
        for i, (t, p) in enumerate(SETTINGS)
        for j in range(2)
    ]


def texts(
    target: torch.nn.Module,
    drafter: Drafter,
    prompts: Sequence[list[int]],
    rows: Sequence[SamplingConfig],
    spec: SpeculativeConfig,
    batch_size: int,
    noise: Noise = position_noise,
) -> list[list[int]]:
    """Each row's tokens, `batch_size` rows decoded at a time (a finished row's place goes to the next)."""
    decoder = BatchDecoder(target, drafter, frozenset(), rule=CoupledRule(noise))
    out: dict[Hashable, list[int]] = {i: [] for i in range(len(rows))}
    waiting = list(range(len(rows)))
    while waiting or decoder.rows:
        while waiting and len(decoder.rows) < batch_size:
            i = waiting.pop(0)
            decoder.add(i, prompts[i % len(prompts)], rows[i], spec)
        for key, outcome in decoder.step():
            assert not isinstance(outcome, Exception), outcome
            out[key].extend(outcome.emitted_token_ids)
    return [out[i] for i in range(len(rows))]


NEW_TOKENS = 24


@pytest.fixture(scope="module")
def tiny(tiny_target, tiny_draft, tiny_trained_head):
    """The tiny models, and each row's target-only coupled text, decoded one row at a time."""
    rows, spec = samplings(), SpeculativeConfig(max_new_tokens=NEW_TOKENS)
    alone = texts(tiny_target, NoDrafter(), TINY_PROMPTS, rows, spec, 1)
    return tiny_target, tiny_draft, tiny_trained_head, alone


def grid() -> list:
    """The grid's 60 cases (kind, K, W, B), each `thorough` unless it is in the covering design `make test` runs: every
    pair of values of any two settings at least once (kind i's K index j takes the (W, B) pair (i + j) mod 4 of
    `width_rows`: 15 cases), and every draft-model case, which the planted "noise by round" fails (docs/testing.md)."""
    width_rows = [(1, 1), (3, 8), (1, 8), (3, 1)]
    covered = {
        (kind, num_draft, *width_rows[(i + j) % 4])
        for i, kind in enumerate(KINDS)
        for j, num_draft in enumerate(DEPTHS)
    }
    return [
        pytest.param(kind, k, w, b, marks=() if kind == "model" or (kind, k, w, b) in covered else pytest.mark.thorough)
        for kind in KINDS
        for k in DEPTHS
        for w in (1, 3)
        for b in (1, 8)
    ]


DEPTHS = (1, 4, 16)


@pytest.mark.parametrize(("kind", "num_draft", "width", "batch_size"), grid())
def test_coupled_speculative_text_is_target_only_text(tiny, kind, num_draft, width, batch_size):
    """Eight rows (T 0.7 and 1.0, top-p 1 and 0.9, two seeds each) as one batch, or one row of each setting decoded
    alone, against the target alone, token for token."""
    target, draft, head, alone = tiny
    spec = SpeculativeConfig(num_draft_tokens=num_draft, num_candidates=width, max_new_tokens=NEW_TOKENS)
    rows = samplings() if batch_size > 1 else samplings()[::2]  # rows 0, 2, 4, 6: the first prompt, each setting
    got = texts(target, tiny_drafter(kind, draft, head), TINY_PROMPTS[:1] if batch_size == 1 else TINY_PROMPTS, rows,
                spec, batch_size)  # fmt: skip
    expected = alone if batch_size > 1 else alone[::2]
    assert got == expected, [i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b]


def test_seeds_matter_and_the_drafts_are_tested(tiny):
    """The identity is not vacuous: other seeds give other texts, and the drafts are often accepted."""
    target, draft, head, alone = tiny
    assert len({tuple(text) for text in alone}) == len(alone)
    spec = SpeculativeConfig(num_draft_tokens=4, num_candidates=3, max_new_tokens=NEW_TOKENS)
    decoder = BatchDecoder(target, tiny_drafter("model", draft, head), frozenset())
    decoder.add(0, TINY_PROMPTS[0], samplings()[0], spec)
    rounds = []
    while decoder.rows:
        rounds += [outcome for _, outcome in decoder.step()]
    assert sum(r.num_accepted for r in rounds) >= 4 and len(rounds) < NEW_TOKENS
    assert all(len(r.coupled) == r.num_accepted + 1 for r in rounds)


def test_the_chance_recorded_at_a_rounds_first_position_is_the_share_that_matched(tiny):
    """A coupled draft model at W = 3 drafts the three best first tokens of log q + G: over 32 rows' rounds, the mean
    chance recorded at the first position (that one of the three is y) holds the share of rounds whose first position
    matched within 4 standard errors (planted: one candidate's chance at W = 3 falls short); past it the path's
    candidate is alone."""
    target, draft, head, _ = tiny
    spec = SpeculativeConfig(num_draft_tokens=2, num_candidates=3, max_new_tokens=NEW_TOKENS)
    rounds = []
    for start in range(0, 32, 8):
        decoder = BatchDecoder(target, tiny_drafter("model", draft, head), frozenset())
        for seed in range(start, start + 8):
            decoder.add(seed, TINY_PROMPTS[seed % 2], SamplingConfig(temperature=1.0, rule="coupled", seed=seed), spec)
        while decoder.rows:
            rounds += [outcome for _, outcome in decoder.step()]
    firsts = [r.coupled[0] for r in rounds if r.coupled[0].draft_id is not None]  # [rounds that drafted]
    assert len(firsts) > 300 and {c.num_alive for c in firsts} == {3}
    assert {c.num_alive for r in rounds for c in r.coupled[1:] if c.draft_id is not None} == {1}
    measured = sum(c.draft_id == c.target_id for c in firsts) / len(firsts)
    low = sum(c.coupled_chance for c in firsts) / len(firsts)
    high = sum(c.coupled_chance_high for c in firsts) / len(firsts)
    spread = math.sqrt(sum(c.coupled_chance * (1 - c.coupled_chance) for c in firsts)) / len(firsts)
    assert low - 4 * spread <= measured <= high + 4 * spread, (low, high, measured, spread)


@pytest.mark.parametrize("bug", ["noise by round", "noise from the draft"])
def test_planted_noise_bugs_change_the_text_with_the_drafter(tiny, bug):
    """What the identity tests catch (the audit's planted bugs): noise by round, or noise that reads the draft, gives
    text that changes with the drafter and K."""
    target, draft, head, _ = tiny
    planted = noise_for(bug)
    rows = samplings()
    spec = SpeculativeConfig(num_draft_tokens=4, max_new_tokens=NEW_TOKENS)
    alone = texts(target, NoDrafter(), TINY_PROMPTS, rows, spec, 8, planted)
    got = texts(target, tiny_drafter("model", draft, head), TINY_PROMPTS, rows, spec, 8, planted)
    assert sum(a != b for a, b in zip(got, alone, strict=True)) >= 3


def test_coupled_and_standard_rows_share_passes_and_each_writes_its_own_text(tiny):
    """A batch of both rules: the coupled rows write their target-only text, the standard rows what they write alone."""
    target, draft, head, alone = tiny
    rows = samplings()
    mixed = [row if i % 2 else replace(row, rule="standard") for i, row in enumerate(rows)]
    spec = SpeculativeConfig(num_draft_tokens=4, num_candidates=3, max_new_tokens=NEW_TOKENS)
    together = texts(target, tiny_drafter("model", draft, head), TINY_PROMPTS, mixed, spec, 8)
    one_by_one = texts(target, tiny_drafter("model", draft, head), TINY_PROMPTS, mixed, spec, 1)
    assert together == one_by_one
    assert [together[i] for i in range(1, 8, 2)] == [alone[i] for i in range(1, 8, 2)]


@pytest.mark.parametrize("kind", ["model", "hybrid"])
def test_coupled_text_on_the_gpus_fixed_shape_passes(tiny, kind, monkeypatch):
    """The GPU's path dry-run: fixed-shape passes; coupled rows with one candidate run in the round program, with
    three the eager rule on the fixed-shape logits."""
    monkeypatch.setenv(passes.PASS_SHAPE_VARIABLE, "fixed")
    target, draft, head, alone = tiny
    spec = SpeculativeConfig(num_draft_tokens=4, num_candidates=3, max_new_tokens=NEW_TOKENS)
    assert texts(target, tiny_drafter(kind, draft, head), TINY_PROMPTS, samplings(), spec, 8) == alone
    spec = replace(spec, num_candidates=1)
    assert texts(target, tiny_drafter(kind, draft, head), TINY_PROMPTS, samplings(), spec, 8) == alone


OFFLINE_ROWS = samplings()[::2]  # one row a setting, both prompts
OFFLINE_TEXTS = ("The quick brown fox jumps over the lazy dog. The quick brown", "Name three rivers in Europe:")


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def offline(request, offline_model):
    """The offline model in float32 and bfloat16 (the session's), and each row's target-only text."""
    if request.param == "bfloat16":
        loaded = request.getfixturevalue("offline_bfloat16")  # the session's (it skips where bfloat16 is not native)
    else:
        loaded = offline_model
    prompts = [loaded.tokenizer(text)["input_ids"] for text in OFFLINE_TEXTS]
    alone = texts(loaded.model, NoDrafter(), prompts, OFFLINE_ROWS, SpeculativeConfig(max_new_tokens=12), 1)
    return loaded, prompts, alone


@pytest.mark.parametrize("kind", ["ngram", "suffix", "recurrent", "hybrid"])
def test_coupled_text_on_the_offline_model(offline, kind):
    """Four rows (one a setting) in one batch, K = 4 and W = 3, against each row's target-only text; in bfloat16 the
    kinds that sample (the head, alone and in the hybrid)."""
    loaded, prompts, alone = offline
    if loaded.model.dtype == torch.bfloat16 and kind in ("ngram", "suffix"):
        pytest.skip("in float32 here; every kind in bfloat16: python -m benchmarks.coupled identity --dtype bfloat16")
    spec = SpeculativeConfig(num_draft_tokens=4, num_candidates=3, max_new_tokens=12)
    assert texts(loaded.model, build_drafter(kind, loaded), prompts, OFFLINE_ROWS, spec, 4) == alone


def test_a_row_whose_noise_was_infinite_emits_the_only_token_top_k_allows(tiny_target):
    """Row noise seed 5656014980887990 has its largest noise at position 91, id 25 (infinite under the 53-bit
    uniform): a 91-token prompt under top-k 1 must still emit the target's argmax, the one token with p > 0 (planted:
    the 53-bit uniform without the p = 0 guard in coupled_scores emits id 25)."""
    prompt = [(7 * i + 3) % 32 for i in range(91)]
    argmax = int(tiny_target(torch.tensor([prompt])).logits[0, -1].argmax())
    assert argmax != 25, "the prompt must make another token the argmax"
    decoder = BatchDecoder(tiny_target, NoDrafter(), frozenset())
    decoder.add(
        0, prompt, SamplingConfig(temperature=1.0, top_k=1, rule="coupled"), SpeculativeConfig(max_new_tokens=1)
    )
    decoder.rows[0].seed = 5656014980887990  # the row's noise seed, as drawn from its generator
    [(_, outcome)] = decoder.step()
    assert not isinstance(outcome, Exception), outcome
    assert outcome.emitted_token_ids == [argmax]


@pytest.mark.parametrize("draft_vocab", [TINY_VOCAB - 8, TINY_VOCAB + 8], ids=["smaller", "larger"])
def test_a_coupled_draft_model_drafts_only_ids_q_allows_whatever_its_vocabulary(tiny_target, draft_vocab):
    """Top-k 5 at W = 8 with a draft vocabulary smaller or larger than the target's: the first tokens are the live
    ones of Gumbel-top-W (q > 0, so inside both vocabularies), at most 5 candidates, and every row, coupled or
    standard, writes what it writes alone; the coupled ones the target's own text (planted: filling the W with the
    ties at -inf drafts ids past the smaller draft's embedding, and those rows fail)."""
    draft = tiny_model(2, vocab_size=draft_vocab, num_layers=1)
    spec = SpeculativeConfig(num_draft_tokens=3, num_candidates=8, max_new_tokens=16)
    rows = [SamplingConfig(temperature=1.0, top_k=5, rule="coupled", seed=seed) for seed in range(12)]
    rows += [replace(rows[0], rule="standard", seed=seed) for seed in range(4)]  # a mixed batch
    prompts = [TINY_PROMPTS[i % 2] for i in range(len(rows))]
    alone = texts(tiny_target, NoDrafter(), prompts, rows, spec, len(rows))
    drafter = ModelDrafter(draft, None, TINY_VOCAB)
    decoder = BatchDecoder(tiny_target, drafter, frozenset())
    got: dict[Hashable, list[int]] = {i: [] for i in range(len(rows))}
    for i, row in enumerate(rows):
        decoder.add(i, prompts[i], row, spec)
    while decoder.rows:
        for key, outcome in decoder.step():
            assert not isinstance(outcome, Exception), f"row {key}: {outcome}"
            got[key].extend(outcome.emitted_token_ids)
            for candidate in outcome.candidates:
                assert all(token < min(draft_vocab, TINY_VOCAB) for token in candidate.token_ids), candidate
                assert all(q > 0 for q in candidate.draft_probs), candidate
            assert len(outcome.candidates) <= 5 or not rows[key].is_coupled  # standard rows draw W i.i.d. beams
    coupled = range(12)
    assert [got[i] for i in coupled] == [alone[i] for i in coupled]
    standard = texts(tiny_target, ModelDrafter(draft, None, TINY_VOCAB), prompts[12:], rows[12:], spec, 1)
    assert [got[i] for i in range(12, 16)] == standard


class FailingFor:
    """A drafter that raises for one row's key, as a drafter with a bug would, and drafts as `inner` for the rest."""

    def __init__(self, inner: Drafter, key: Hashable) -> None:
        self.inner, self.key = inner, key

    def propose(self, requests):
        if any(r.key == self.key for r in requests):
            raise IndexError("index 40 is out of bounds for dimension 0 with size 32")
        return self.inner.propose(requests)

    def forget(self, key: Hashable) -> None:
        self.inner.forget(key)


def test_a_drafter_failing_on_one_row_stops_that_row_with_a_sentence_and_the_others_go_on(tiny):
    """Row 5's drafts raise: it leaves at its first round with one sentence, the way forward and the error, and the
    seven other rows, coupled and standard, write the texts they write alone (planted: the drafter's error raised
    for the whole batch)."""
    target, draft, head, _ = tiny
    rows = samplings()
    mixed = [row if i % 2 else replace(row, rule="standard") for i, row in enumerate(rows)]
    spec = SpeculativeConfig(num_draft_tokens=4, num_candidates=3, max_new_tokens=NEW_TOKENS)
    one_by_one = texts(target, tiny_drafter("model", draft, head), TINY_PROMPTS, mixed, spec, 1)
    decoder = BatchDecoder(target, FailingFor(tiny_drafter("model", draft, head), 5), frozenset())  # type: ignore[arg-type]
    got: dict[Hashable, list[int]] = {i: [] for i in range(8)}
    errors: dict[Hashable, Exception] = {}
    for i, row in enumerate(mixed):
        decoder.add(i, TINY_PROMPTS[i % 2], row, spec)
    while decoder.rows:
        for key, outcome in decoder.step():
            if isinstance(outcome, Exception):
                errors[key] = outcome
            else:
                got[key].extend(outcome.emitted_token_ids)
    assert list(errors) == [5] and isinstance(errors[5], DrafterFailed) and got[5] == []
    assert str(errors[5]).startswith("The drafter failed on this prompt, so its run stops"), errors[5]
    assert "the drafter's error (IndexError: index 40 is out of bounds" in str(errors[5]), errors[5]
    assert [got[i] for i in range(8) if i != 5] == [one_by_one[i] for i in range(8) if i != 5]
