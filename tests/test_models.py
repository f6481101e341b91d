"""KV-cached forwards with implicit rollback, model names, device choice and the converted-weights cache."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from specdemo.models import (
    OFFLINE_DEFAULT,
    KVCachedModel,
    ModelCache,
    load_model,
    pick_device,
    resolve_source,
)
from specdemo.offline import OFFLINE_MODELS, offline_source


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


class CountingLoader:
    """Stands in for load_model: records each load, slowly, so concurrent requests overlap."""

    def __init__(self) -> None:
        self.loads: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, name: str, progress, **options) -> str:
        time.sleep(0.2)
        with self.lock:
            self.loads.append(name)
        if name == "broken/model":
            raise ValueError("Could not load 'broken/model'")
        return f"model:{name}"


def test_cache_evicts_least_recently_used_but_never_the_pinned_default():
    loader = CountingLoader()
    cache = ModelCache(loader, capacity=2, pinned="default")
    for name in ["default", "a/one", "a/two", "a/one", "a/three"]:  # a/one used again, so a/two is oldest
        cache.get(name)
    assert list(cache.models) == ["default", "a/one", "a/three"]
    assert loader.loads == ["default", "a/one", "a/two", "a/three"]


def test_concurrent_requests_load_a_model_once():
    loader = CountingLoader()
    cache = ModelCache(loader)
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda _: cache.get("a/model"), range(8)))
    assert results == ["model:a/model"] * 8
    assert loader.loads == ["a/model"]


def test_a_failed_load_leaves_nothing_behind():
    loader = CountingLoader()
    cache = ModelCache(loader)
    cache.get("a/model")
    with pytest.raises(ValueError, match="broken/model"):
        cache.get("broken/model")
    assert list(cache.models) == ["a/model"]
