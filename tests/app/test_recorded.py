"""The recorded runs: every shipped file replays in the step view, says where and when it was recorded, and is the run
its manifest entry describes; recording the greedy one again on this machine gives the same tokens."""

from __future__ import annotations

import re
from dataclasses import asdict
from datetime import date

import pytest

from specdemo.app.form import parse_request
from specdemo.app.panels import recorded, step_view
from specdemo.app.panels.recorded import RECORDED_FOLDER, RECORDINGS, choices, file_name, load, record
from specdemo.app.views.replay import check_replay
from specdemo.models.shared import ModelCache

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
    assert trace["sampling"] == asdict(request.sampling) and trace["speculative"] == asdict(request.speculative)
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
