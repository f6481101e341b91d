"""The model cache shared across runs: least recently used out, the pinned default kept, one load per model."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from specdemo.models.shared import ModelCache


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
