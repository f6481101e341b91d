"""The model cache shared across runs: least recently used out, the pinned default kept, one load per model."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from specdemo.models.shared import ModelCache
from tests.helpers import wait_until

CPU = torch.device("cpu")


class CountingLoader:
    """Stands in for load_model: records each load, which ends only once `until()` is true (so that requests made
    meanwhile overlap it, however slowly their threads start)."""

    def __init__(self, until: Callable[[], bool] = lambda: True) -> None:
        self.loads: list[str] = []
        self.lock = threading.Lock()
        self.until = until

    def __call__(self, name: str, progress, **options) -> str:
        wait_until(self.until, "the requests the load waits for")
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
    """Eight requests, all made before the first one's load ends."""
    requests: list[int] = []
    loader = CountingLoader(until=lambda: len(requests) == 8)
    cache = ModelCache(loader)

    def request(index: int) -> str:
        requests.append(index)
        return cache.get("a/model")

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(request, range(8)))
    assert results == ["model:a/model"] * 8
    assert loader.loads == ["a/model"]


def test_a_failed_load_leaves_nothing_behind():
    loader = CountingLoader()
    cache = ModelCache(loader)
    cache.get("a/model")
    with pytest.raises(ValueError, match="broken/model"):
        cache.get("broken/model")
    assert list(cache.models) == ["a/model"]


class Held:
    """Stands in for a LoadedModel: its name, where it runs and what its weights take."""

    def __init__(self, name: str, progress=None, device: torch.device = CPU, weights_bytes: int = 100, **options):
        self.name, self.device, self.weights_bytes = name, device, weights_bytes


def test_make_room_evicts_idle_models_least_recently_used_first_never_the_pinned_or_the_kept(monkeypatch):
    """Free memory is 1000 bytes less what the cache holds, each model 100. Room for 380 bytes of weights needs 475
    free (MEMORY_HEADROOM 0.8): the two idle models used least recently go, not the pinned one nor the kept one."""
    cache = ModelCache(Held, capacity=10, pinned="default")
    monkeypatch.setattr(
        "specdemo.models.shared.free_memory_bytes",
        lambda device: 1000 - sum(loaded.weights_bytes for loaded in cache.models.values()),
    )
    for name in ["default", "a/one", "a/two", "a/three", "a/four", "a/five", "a/six"]:
        cache.get(name)
    cache.get("a/one")  # used again: now the most recent
    assert cache.free_bytes(CPU) == 300
    free = cache.make_room(380, CPU, keep=["a/two"])  # 380 <= 0.8 * free needs free >= 475: two evictions
    assert free == 500 and list(cache.models) == ["default", "a/two", "a/five", "a/six", "a/one"]
    assert cache.make_room(380, CPU) == 500 and len(cache.models) == 5  # fits already: nothing evicted
    free = cache.make_room(10_000, CPU, keep=["a/six"])  # can never fit: every idle model goes, then it gives up
    assert free == 800 and list(cache.models) == ["default", "a/six"]


def test_on_zerogpu_the_weights_held_on_the_gpu_count_against_the_lent_gpu(monkeypatch):
    """Every ZeroGPU call moves all models the process holds onto the lent GPU: what is free for more weights is the
    lent GPU's memory less theirs (models on the CPU aside)."""
    monkeypatch.setenv("SPACES_ZERO_GPU", "true")
    monkeypatch.setattr("specdemo.models.loading.zerogpu_memory_bytes", lambda: 1000)  # the lent GPU's
    cuda = torch.device("cuda")
    cache = ModelCache(lambda name, progress, **options: Held(name, **options), capacity=10)
    cache.get("a/gpu", device=cuda, weights_bytes=300)
    cache.get("b/gpu", device=cuda, weights_bytes=200)
    cache.get("c/cpu", device=CPU, weights_bytes=400)
    assert cache.free_bytes(cuda) == 500
    assert cache.make_room(600, cuda) == 800 and list(cache.models) == ["b/gpu", "c/cpu"]
    assert cache.make_room(10_000, cuda) == 1000 and list(cache.models) == ["c/cpu"]  # the CPU's frees nothing
    monkeypatch.setenv("SPACES_ZERO_GPU", "false")
    monkeypatch.setattr("specdemo.models.shared.free_memory_bytes", lambda device: 1000)
    assert cache.free_bytes(cuda) == 1000  # a real GPU's free memory already leaves out what is on it
