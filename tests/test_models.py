"""Model names, device choice and the converted-weights cache."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from specdemo.models import OFFLINE_DEFAULT, load_model, pick_device, resolve_source
from specdemo.offline import OFFLINE_MODELS, offline_source


def test_unknown_names_are_refused_with_the_way_forward():
    with pytest.raises(ValueError, match=r"'gpt-17' is not a valid model id: use one of 'smollm2-135m-instruct'"):
        resolve_source("gpt-17", print)


def test_unreachable_hub_id_says_so_without_waiting_on_the_network(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # set after import: must still be honoured
    started = time.perf_counter()
    with pytest.raises(ValueError, match=r"Could not load 'nobody/no-such-model'.*offline, use"):
        load_model("nobody/no-such-model")
    assert time.perf_counter() - started < 5


def test_specdemo_device_forces_the_device(monkeypatch):
    monkeypatch.setenv("SPECDEMO_DEVICE", "meta")
    assert pick_device() == torch.device("meta")
    monkeypatch.delenv("SPECDEMO_DEVICE")
    assert pick_device().type in {"cpu", "cuda", "mps"}


def test_offline_default_loads_from_the_converted_cache_in_seconds(offline_model):
    directory = Path(offline_source(OFFLINE_MODELS[OFFLINE_DEFAULT], print))  # converted already by the fixture
    assert (directory / "model.safetensors").is_file()
    started = time.perf_counter()
    again = load_model(OFFLINE_DEFAULT, device=torch.device("cpu"))
    seconds = time.perf_counter() - started
    assert again.model.config.vocab_size == 49152
    assert seconds < 15, f"second start took {seconds:.1f} s; the safetensors cache is not being used"
