"""KV-cached forwards with implicit rollback, model names, device choice and the converted-weights cache."""

from __future__ import annotations

import time

import pytest
import torch

from specdemo.models import (
    OFFLINE_DEFAULT,
    KVCachedModel,
    load_model,
    offline_smollm2_dir,
    pick_device,
    resolve_source,
)


def fresh_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=ids).logits


def test_rollback_drops_rejected_positions(tiny_target):
    cached = KVCachedModel(tiny_target)
    prefix = torch.tensor([[0, 4, 8, 15, 16]])
    proposed = torch.cat([prefix, torch.tensor([[23, 31, 7]])], dim=1)  # three draft tokens
    cached.logits(proposed, num_logits=4)
    assert cached.cache.get_seq_length() == 8
    # The target kept one draft and replaced the second: the cache must forget 31 and 7.
    corrected = torch.cat([prefix, torch.tensor([[23, 3]])], dim=1)
    logits = cached.logits(corrected, num_logits=1)
    assert cached.last_input_length == 1  # only the new token was fed
    assert cached.cache.get_seq_length() == corrected.shape[1]
    torch.testing.assert_close(logits[:, -1], fresh_logits(tiny_target, corrected)[:, -1], rtol=0, atol=1e-10)


def test_all_positions_of_a_verification_match_a_fresh_pass(tiny_target):
    cached = KVCachedModel(tiny_target)
    ids = torch.tensor([[0, 4, 8, 15, 16, 23, 31]])
    cached.logits(ids[:, :4], num_logits=1)
    logits = cached.logits(ids, num_logits=3)  # [1, 3, V] for the three new positions 4..6
    torch.testing.assert_close(logits, fresh_logits(tiny_target, ids)[:, -3:], rtol=0, atol=1e-10)


def test_unknown_names_are_refused_with_the_way_forward():
    with pytest.raises(ValueError, match=r"Unknown model 'gpt-17'.*smollm2-135m-instruct"):
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
    directory = offline_smollm2_dir(print)  # converted already by the fixture
    assert (directory / "model.safetensors").is_file()
    started = time.perf_counter()
    again = load_model(OFFLINE_DEFAULT, device=torch.device("cpu"))
    seconds = time.perf_counter() - started
    assert again.model.config.vocab_size == 49152
    assert seconds < 15, f"second start took {seconds:.1f} s; the safetensors cache is not being used"
