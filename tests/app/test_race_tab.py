"""The Race tab's /race: every lane writes the target's own text under greedy decoding and the coupled rule; bad lanes
are one sentence before any model work; a drafter that fails stops its lane with a sentence while the others finish;
its ZeroGPU call is tested with the other calls (test_zerogpu.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError

import specdemo.engine.race as race_engine
from specdemo.app.form import LeftOut
from specdemo.app.serving.startup import DRAFTER_MISMATCH
from specdemo.app.tabs import race
from specdemo.drafters.ngram import NgramDrafter
from specdemo.pairs import find_pair
from tests.app_helpers import SPELLING, settings

FOUR = ["ngram", "suffix", "recurrent", "hybrid"]


@pytest.fixture(scope="module")
def client(app) -> Client:
    return Client(app, verbose=False)


def race_settings(lanes: list[str] | str, **changes) -> dict:
    """/race's inputs by name: the Spelling prompt, `lanes`, a 16-token run in float32 (greedy parity)."""
    return {**settings(SPELLING, **{"max_new_tokens": 16, **changes}), "lanes": lanes}


def texts(result: dict) -> dict[str, str]:
    return {lane["name"]: lane["text"] for lane in result["lanes"]}


@pytest.mark.parametrize(
    "lanes, changes",
    [
        (FOUR, {}),  # greedy, the offline default pair
        pytest.param(  # thorough: the engine's and the browser's races are coupled too
            "ngram, suffix, hybrid, draft",
            {"pair": "smollm2-135m-self", "temperature": 0.8, "rule": "coupled"},
            marks=pytest.mark.thorough,
        ),
    ],
    ids=["greedy", "coupled-sampled"],
)
def test_every_lane_writes_the_same_text(client, lanes, changes):
    """Each lane is the target's own text for the seed, so the target alone and four drafters agree token for token;
    a list or a comma-separated text names the lanes. Planted: the agreement asked as if the texts differed by design
    (same_text_expected=False) fails it."""
    view, summary, _, result = client.predict(**race_settings(lanes, **changes), api_name="/race")
    assert result["lanes"][0]["name"] == "target" and len(result["lanes"]) == 5
    assert len(set(texts(result).values())) == 1, texts(result)
    assert len({tuple(lane["token_ids"]) for lane in result["lanes"]}) == 1
    assert all(lane["error"] is None and lane["passes"] > 0 for lane in result["lanes"])
    target = result["lanes"][0]
    assert target["passes"] == len(target["token_ids"]) and target["speedup"] == 1.0  # one token a pass
    assert result["agreement"].startswith("All 5 finished lanes wrote the same")
    assert result["agreement"] in summary and "measured cost of a pass of its width" in summary
    assert view.count('class="lane race-lane race-finished"') == 5


def test_the_lanes_offered_follow_the_pair_and_keep_those_it_can_race():
    server = SimpleNamespace(left_out={})
    update = race.lanes_for_pair(server, "smollm2-135m-360m", FOUR)  # a draft model, no recurrent head for its target
    assert update["choices"] == ["ngram", "suffix", "draft"] and update["value"] == ["ngram", "suffix"]
    assert race.lanes_for_pair(server, "smollm2-135m-self", FOUR)["value"] == FOUR
    assert "value" not in race.lanes_for_pair(server, "custom", FOUR)  # a custom pair's lanes are checked when it runs


def test_a_lane_whose_own_pair_the_startup_checks_left_out_is_neither_offered_nor_raced():
    """On a Space whose target's weights differ from those the head was trained on, the head's pairs are left out at
    startup: the head's lanes are not offered, and a race that names one is refused in that pair's sentence; a pair
    left out for another reason (not loaded on ZeroGPU) leaves its kind to race. Planted: offering every lane_choices
    lane fails it."""
    sentence = "The recurrent head was trained for other weights: pick another drafter."
    not_loaded = LeftOut("not loaded at startup", "This ZeroGPU Space runs the pairs it loaded at startup.")
    left_out = {"smollm2-135m-recurrent": LeftOut(DRAFTER_MISMATCH, sentence), "smollm2-135m-hybrid": not_loaded}
    server = SimpleNamespace(left_out=left_out)
    pair = find_pair("smollm2-135m-ngram")
    assert race.offered_lanes(server, pair) == ["ngram", "suffix", "hybrid"]
    assert race.lanes_for_pair(server, pair.key, FOUR)["value"] == ["ngram", "suffix", "hybrid"]
    with pytest.raises(ValueError, match=f"^The lane 'recurrent' cannot race here: {sentence}$"):
        race.check_offered(server, pair, ["target", "ngram", "recurrent"])
    assert race.check_offered(server, pair, ["target", "hybrid"]) == ["target", "hybrid"]


@pytest.mark.parametrize(
    "lanes, changes, sentence",
    [
        ([], {}, r"^The race has no drafter lanes: name at least one of ngram, suffix"),
        ("ngram,beam", {}, r"^'beam' is not a lane this pair can race: choose among target, ngram"),
        (["ngram", "draft"], {}, r"^The lane 'draft' races the pair's draft model, and smollm2-135m-ngram has none"),
        (["ngram", "ngram"], {}, r"^A lane is named twice"),
        (FOUR, {"temperature": -1}, r"^temperature must be"),
    ],
    ids=["empty", "unknown", "no-draft-model", "twice", "bad-setting"],
)
def test_bad_lanes_are_one_sentence(client, lanes, changes, sentence):
    with pytest.raises(AppError, match=sentence):
        client.predict(**race_settings(lanes, **changes), api_name="/race")


def test_more_lanes_than_allowed_is_one_sentence_before_any_model_work(client, monkeypatch):
    """Six lanes are every lane a pair has today, so the limit is lowered here to reach its sentence; the race's
    server work (Server.prepare) is never reached."""
    monkeypatch.setattr(race_engine, "MAX_LANES", 3)
    monkeypatch.setattr(race.Server, "prepare", lambda *args: pytest.fail("a refused race loaded models"))
    with pytest.raises(AppError, match=r"^The race has 5 lanes with the target's; at most 3 race at once: drop 2\.$"):
        client.predict(**race_settings(FOUR), api_name="/race")


def test_a_failing_drafter_stops_its_lane_with_a_sentence_and_the_others_finish(client, monkeypatch):
    """The n-gram drafter (which no other kind wraps) raises at its first draft. Planted: a summary without the
    stopped lanes' sentences fails it."""

    def planted(self, requests):
        raise RuntimeError("planted: the n-gram index broke")

    monkeypatch.setattr(NgramDrafter, "propose", planted)
    _, summary, _, result = client.predict(**race_settings(FOUR), api_name="/race")
    by_name = {lane["name"]: lane for lane in result["lanes"]}
    assert "planted: the n-gram index broke" in by_name["ngram"]["error"]
    assert not by_name["ngram"]["token_ids"]  # it failed at its first draft
    finished = [lane for lane in result["lanes"] if lane["name"] != "ngram"]
    assert all(lane["error"] is None and len(lane["token_ids"]) == 16 for lane in finished)
    assert len({lane["text"] for lane in finished}) == 1
    assert result["agreement"].startswith("All 4 finished lanes wrote the same")
    assert "planted: the n-gram index broke" in summary
