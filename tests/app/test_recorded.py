"""The recorded runs: every shipped file replays in the step view, says where and when it was recorded, and is the run
its manifest entry describes; recording the greedy one again on this machine gives the same tokens."""

from __future__ import annotations

import json
import re
from datetime import date

import gradio as gr
import pytest
import torch

from specdemo.app.form import parse_request
from specdemo.app.panels import recorded, step_view
from specdemo.app.panels.recorded import RECORDED_FOLDER, RECORDINGS, choices, file_name, load, record
from specdemo.app.views.replay import check_replay, replay_record
from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.engine.decoding import speculative_generate
from specdemo.models.shared import ModelCache
from tests.helpers import tiny_drafter

KEYS = [recording.key for recording in RECORDINGS]


def emitted_in_replay(replay: dict) -> list[int]:
    """The tokens a replay shows as emitted: every span but the rejected drafts."""
    return [span["token_id"] for r in replay["rounds"] for span in r["spans"] if span["kind"] != "rejected"]


def test_one_file_per_recording_and_no_strays():
    assert len(set(KEYS)) == len(KEYS)
    assert sorted(path.name for path in RECORDED_FOLDER.iterdir()) == sorted(file_name(key) for key in KEYS)


@pytest.mark.parametrize("key", KEYS)
def test_every_shipped_file_replays_in_the_step_view(key):
    trace = load(key)
    replay = check_replay(trace["replay"])
    assert trace["recorded"]["key"] == key
    assert emitted_in_replay(replay) == trace["generated_token_ids"]  # the replay shows the run's own tokens
    record_shown, _, slider, *_ = step_view._loaded(replay)
    assert record_shown is replay and slider["maximum"] == len(replay["rounds"]) == len(trace["rounds"])


@pytest.mark.parametrize("recording", RECORDINGS, ids=KEYS)
def test_each_file_is_the_run_its_manifest_entry_describes(recording):
    """A manifest edited without recording again leaves a file of another run: this says which."""
    trace = load(recording.key)
    request = parse_request(recording.prompt, recording.values())
    assert trace["prompt"] == recording.prompt and trace["pair"]["key"] == recording.pair
    # a setting newer than the file (the acceptance rule) is absent from it: the run had that setting's default
    assert SamplingConfig(**trace["sampling"]) == request.sampling
    assert SpeculativeConfig(**trace["speculative"]) == request.speculative
    assert trace["replay"]["greedy"] == request.sampling.is_greedy
    assert trace["recorded"]["number_format"].startswith(recorded.NUMBER_FORMAT)  # what the greedy check needs


def test_every_label_names_the_title_the_device_and_the_date():
    listed = choices()
    assert [key for _, key in listed] == KEYS
    for (label, key), recording in zip(listed, RECORDINGS, strict=True):
        where = load(key)["recorded"]
        assert label.startswith(recording.title) and f"recorded on {where['device']} " in label
        assert re.search(r"(CPU|GPU|NVIDIA|AMD|Apple)", where["device"]), where["device"]
        assert label.endswith(where["date"]) and date.fromisoformat(where["date"]) <= date.today()


def test_the_page_reads_recordings_without_a_model(monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("choices() and load() must not load a model")

    monkeypatch.setattr(ModelCache, "get", no_model)
    monkeypatch.setattr("specdemo.models.loading.load_model", no_model)
    assert [load(key)["recorded"]["key"] for _, key in choices()] == KEYS


def test_an_unknown_or_unrecorded_run_is_refused_in_one_sentence(tmp_path):
    with pytest.raises(ValueError, match=r"^There is no recorded run 'nope': choose one of copying, "):
        load("nope")
    with pytest.raises(
        ValueError, match=r"has not been recorded here: run `python -m specdemo.app.panels.recorded --only"
    ):
        load(KEYS[0], folder=tmp_path)
    assert choices(tmp_path) == []  # the page lists what is there


def test_recording_the_greedy_run_again_gives_the_shipped_tokens(offline_model, tmp_path):
    """Greedy in float32 on one device gives the same tokens every time, whatever the drafter proposed (its plans read
    this machine's measured pass costs, so the rounds may be cut differently)."""
    recording = next(r for r in RECORDINGS if parse_request(r.prompt, r.values()).sampling.is_greedy)
    shipped = load(recording.key)
    if not shipped["recorded"]["device"].startswith("CPU"):
        pytest.skip(f"recorded on {shipped['recorded']['device']}: float32 there may differ from this CPU's")
    cache = ModelCache(pinned=offline_model.name)
    cache.put(offline_model)  # float32 on the CPU, as the recording asks
    again = record(recording, tmp_path / file_name(recording.key), cache, progress=lambda message: None)
    assert again["generated_token_ids"] == shipped["generated_token_ids"]
    assert again["prompt_token_ids"] == shipped["prompt_token_ids"]
    assert emitted_in_replay(load(recording.key, folder=tmp_path)["replay"]) == shipped["generated_token_ids"]


def test_a_recorded_coupled_run_replays_with_its_choices(tiny_target, tiny_draft, tmp_path):
    """A trace with coupled rounds, stored as a recording is: loading it keeps each position's choice and noise, and
    the inspector tells them."""
    sampling = SamplingConfig(temperature=1.0, rule="coupled", seed=3)
    spec = SpeculativeConfig(num_draft_tokens=4, max_new_tokens=12)
    drafter = tiny_drafter("model", tiny_draft, None)
    rounds = list(speculative_generate(tiny_target, drafter, torch.tensor([[0, 5, 9]]), sampling, spec, frozenset()))
    replay = replay_record(rounds, lambda ids: "".join(f" t{token}" for token in ids), [0, 5, 9])
    where = {
        "key": KEYS[0],
        "title": "Coupled",
        "device": "CPU (2 cores)",
        "number_format": "float32",
        "date": "2026-01-01",
    }
    (tmp_path / file_name(KEYS[0])).write_text(json.dumps({"replay": replay, "recorded": where}))
    loaded = load(KEYS[0], folder=tmp_path)["replay"]
    views = [view for r in loaded["rounds"] for view in r["views"]]
    assert [view["coupled"]["target_id"] for view in views] == [c.target_id for r in rounds for c in r.coupled]
    title, _ = step_view.inspect_token(loaded, gr.EventData(None, {"round": 0, "position": 0}))
    assert "the target's choice" in title and "its noise G = " in title
