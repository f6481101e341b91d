"""A race: the target alone and every drafter kind decode one prompt as rows of one batch. Under greedy decoding and
under the coupled rule every lane writes the target alone's text; a lane whose drafter fails stops with a sentence and
the others finish; bad lanes are refused in one sentence before any model loads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import specdemo.engine.race as race_engine
from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.core.planning import PassCosts
from specdemo.core.race import RaceCosts, agreement
from specdemo.core.stats import emitted_ids
from specdemo.drafters.suffix import SuffixDrafter
from specdemo.engine import costs
from specdemo.engine.decoding import autoregressive_generate
from specdemo.engine.race import MAX_LANES, check_lanes, race, race_costs
from specdemo.models.loading import LoadedModel, prompt_token_ids
from specdemo.pairs import find_pair
from tests.helpers import tiny_model

SELF = find_pair("smollm2-135m-self")  # the offline target and a draft model: every lane kind can race
EVERY_KIND = "ngram,suffix,recurrent,hybrid,draft"
PROMPT = "Correct the spelling: The quartely planing meeting is moved from Tuesday to Thursday."
SPECULATIVE = SpeculativeConfig(max_new_tokens=16, num_draft_tokens=4)


def finished_race(model: LoadedModel, lanes: str, sampling: SamplingConfig):
    prompt_ids = prompt_token_ids(model, PROMPT, chat=True)
    *_, runs = race(model, model, check_lanes(lanes, SELF), prompt_ids, sampling, SPECULATIVE)
    return prompt_ids, runs


@pytest.mark.parametrize(
    "sampling",
    [SamplingConfig(), SamplingConfig(temperature=0.9, rule="coupled", seed=7)],
    ids=["greedy", "coupled"],
)
def test_every_lane_writes_the_target_alones_text(offline_model, sampling):
    """Planted: lane i seeded with seed + i (as the Batch tab seeds its prompts): the coupled lanes' texts differ."""
    prompt_ids, runs = finished_race(offline_model, EVERY_KIND, sampling)
    alone = emitted_ids(
        list(
            autoregressive_generate(
                offline_model.model,
                torch.tensor([prompt_ids]),
                sampling,
                SPECULATIVE.max_new_tokens,
                offline_model.eos_token_ids,
            )
        )
    )
    assert [run.name for run in runs] == ["target", *EVERY_KIND.split(",")] and len(runs) == MAX_LANES
    assert all(run.error is None and run.done for run in runs)
    assert [emitted_ids(run.rounds) for run in runs] == [alone] * len(runs)
    assert len(runs[0].rounds) == len(alone)  # the target lane: one token a pass
    assert min(len(run.rounds) for run in runs[1:]) < len(alone)  # some drafter saved passes
    figures = [
        run.figures(RaceCosts(PassCosts.from_seconds({1: 0.01, 2: 0.02}), len(prompt_ids), 0.05)) for run in runs
    ]
    assert agreement(figures, True).startswith(f"All {MAX_LANES} finished lanes wrote the same")
    assert all(f.drafting_seconds > 0 for f in figures[1:]) and figures[0].drafting_seconds == 0


def test_a_failing_lane_stops_with_a_sentence_and_the_others_finish(offline_model, monkeypatch):
    """Planted: the race raising a lane's failure stops every lane."""
    calls = {"n": 0}
    propose = SuffixDrafter.propose

    def failing(self, requests):
        calls["n"] += 1
        if calls["n"] > 2:
            raise RuntimeError("planted")
        return propose(self, requests)

    monkeypatch.setattr(SuffixDrafter, "propose", failing)
    _, runs = finished_race(offline_model, "ngram,suffix", SamplingConfig())
    target, ngram, suffix = runs
    assert suffix.error is not None and suffix.error.startswith("The drafter failed on this prompt")
    assert "RuntimeError: planted" in suffix.error
    assert len(suffix.rounds) == 2 and suffix.done
    assert target.error is None and ngram.error is None
    assert emitted_ids(ngram.rounds) == emitted_ids(target.rounds)
    assert emitted_ids(target.rounds)[: len(emitted_ids(suffix.rounds))] == emitted_ids(suffix.rounds)


@pytest.mark.parametrize(
    ("pair", "lanes", "message"),
    [
        ("smollm2-135m-self", "", "The race has no drafter lanes: name at least one of ngram, suffix"),
        ("smollm2-135m-self", ["target"], "The race has no drafter lanes"),
        ("smollm2-135m-self", "ngram,suffix,recurrent,hybrid,draft,x", "The race has 7 lanes with the target's; at"),
        ("smollm2-135m-ngram", "ngram,draft", "The lane 'draft' races the pair's draft model, and smollm2-135m-ngram"),
        ("qwen2.5-0.5b-1.5b", "recurrent", "The lane 'recurrent' needs a recurrent head trained for Qwen"),
        ("smollm2-135m-self", "ngram,turbo", "'turbo' is not a lane this pair can race: choose among target, ngram"),
        ("smollm2-135m-self", "ngram, ngram", "A lane is named twice"),
    ],
)
def test_bad_lanes_are_one_sentence_before_any_model_loads(pair, lanes, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        check_lanes(lanes, find_pair(pair))


def test_lanes_come_from_a_list_or_a_comma_separated_string_with_the_target_first():
    assert check_lanes(" suffix , ngram ", SELF) == ["target", "suffix", "ngram"]
    assert check_lanes(["hybrid", "target"], SELF) == ["target", "hybrid"]


def test_a_lane_whose_drafter_cannot_be_built_stops_before_it_starts(offline_model, monkeypatch):
    """A head trained for other weights (as on a Space whose target differs) refuses to load: its lane stops with the
    head's sentence before the first pass, and the others race. Planted: the build failure raised from the race."""
    build = race_engine.build_drafter

    def refusing(name, *args, **kwargs):
        if name == "recurrent":
            raise ValueError("This head was trained for other weights: train one for this target.")
        return build(name, *args, **kwargs)

    monkeypatch.setattr(race_engine, "build_drafter", refusing)
    _, runs = finished_race(offline_model, "ngram,recurrent", SamplingConfig())
    target, ngram, recurrent = runs
    assert recurrent.error == "This head was trained for other weights: train one for this target."
    assert recurrent.done and not recurrent.rounds
    assert target.error is None and emitted_ids(ngram.rounds) == emitted_ids(target.rounds) != []


def test_a_race_is_priced_with_costs_measured_now_on_rows_with_its_settings(monkeypatch):
    """A sampled round also computes the probabilities and draws that a greedy round skips, so a sampled race priced
    at greedy rows' costs came out 10-18% low; costs measured at load came out low on a machine that slowed since.
    Planted: measuring on greedy rows (the settings recorded are then greedy), or reusing the load's costs (nothing is
    measured here)."""
    added = []
    original_add = costs.BatchDecoder.add

    def add(decoder, key, prompt_ids, sampling, *args, **kwargs):
        added.append(sampling)
        return original_add(decoder, key, prompt_ids, sampling, *args, **kwargs)

    monkeypatch.setattr(costs.BatchDecoder, "add", add)
    sampled = SamplingConfig(temperature=0.8, rule="coupled", seed=5)
    target = SimpleNamespace(model=tiny_model(0), eos_token_ids=frozenset())
    priced = race_costs(target, [1, 2, 3], SpeculativeConfig(num_draft_tokens=5), sampled)
    assert added and all(sampling == sampled for sampling in added)
    assert priced.passes.sizes == (1, 2, 3, 4, 6)  # every measured size up to a full draft of 5 and the last token
    assert priced.prompt_tokens == 3 and priced.first_seconds > 0
