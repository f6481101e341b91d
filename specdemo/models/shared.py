"""Loaded models shared across runs and users: a least-recently-used cache with one load per model at a time."""

from __future__ import annotations

import gc
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection

import torch

from specdemo.models.graphs import empty_cuda_cache
from specdemo.models.loading import MEMORY_HEADROOM, LoadedModel, free_memory_bytes, load_model
from specdemo.models.offline import Progress
from specdemo.models.platform import fork_safe, on_zerogpu
from specdemo.models.pools import release_pools


class ModelCache:
    """Loaded models shared across runs and users: least recently used first out, one load per model at a time.

    `pinned` (the offline default) is never evicted; at most `capacity` others stay loaded, and fewer when a pair
    needs their memory (make_room). Evicting a model drops the cache's reference only: a run still decoding with it
    holds its own, so its memory comes back when that run ends (make_room then finds less free than it hoped, and the
    load is refused in one sentence, as it would have been).
    """

    def __init__(self, loader: Callable[..., LoadedModel] = load_model, capacity: int = 2, pinned: str = "") -> None:
        self.loader, self.capacity, self.pinned = loader, capacity, pinned
        self.models: OrderedDict[str, LoadedModel] = OrderedDict()
        self.lock = fork_safe(threading.Lock())  # guards models and loading_locks
        self.loading_locks: dict[str, threading.Lock] = {}

    def get(self, name: str, progress: Progress = lambda message: None, **load_options: object) -> LoadedModel:
        """The model `name` on the device and in the number format (dtype) asked for, loaded if it is not held so;
        one copy of a model is held, so asking for another format loads it again in place of the held one."""
        with self.lock:
            if name in self.models and _serves(self.models[name], load_options):
                self.models.move_to_end(name)
                return self.models[name]
            loading = self.loading_locks.setdefault(name, fork_safe(threading.Lock()))
        with loading:  # a second request for the same model waits here and then finds it loaded
            with self.lock:
                if name in self.models and _serves(self.models[name], load_options):
                    return self.models[name]
            loaded = self.loader(name, progress, **load_options)  # a failed load caches nothing
            with self.lock:
                self.models[name] = loaded
                self._evict()
            return loaded

    def holds(self, name: str, **load_options: object) -> bool:
        """Whether `name` is held on the device and in the dtype asked for (get would not load it)."""
        with self.lock:
            return name in self.models and _serves(self.models[name], load_options)

    def put(self, loaded: LoadedModel) -> None:
        """Hold an already-loaded model under its name, as if `get` had loaded it."""
        with self.lock:
            self.models[loaded.name] = loaded
            self.models.move_to_end(loaded.name)
            self._evict()

    def free_bytes(self, device: torch.device) -> int:
        """The memory free on `device` for more weights. On ZeroGPU, the lent GPU's less the weights held on it here:
        every call moves all of them onto the GPU it is lent (loading.device_memory)."""
        free = free_memory_bytes(device)
        if device.type == "cuda" and on_zerogpu():
            with self.lock:
                free -= sum(loaded.weights_bytes for loaded in self.models.values() if loaded.device.type == "cuda")
        return free

    def make_room(self, needed: int, device: torch.device, keep: Collection[str] = ()) -> int:
        """Evict idle models on `device`, least recently used first, until weights of `needed` bytes fit what is free
        there (within MEMORY_HEADROOM), or none is left to evict: never the pinned one, nor those in `keep` (the pair
        being loaded). Returns the bytes free after; the caller refuses the load if they are still too few."""
        while True:
            free = self.free_bytes(device)
            if needed <= MEMORY_HEADROOM * free:
                return free
            with self.lock:
                idle = [  # a model elsewhere frees nothing on `device`
                    name
                    for name, loaded in self.models.items()
                    if name != self.pinned and name not in keep and loaded.device.type == device.type
                ]
                if not idle:
                    return free
                _forget(self.models.pop(idle[0]))  # the front of the OrderedDict: used least recently
            _release_memory()

    def _evict(self) -> None:
        evictable = [name for name in self.models if name != self.pinned]
        evicted = evictable[: max(0, len(evictable) - self.capacity)]
        for name in evicted:
            _forget(self.models.pop(name))
        if evicted:  # runs still holding an evicted model keep it alive until they finish
            _release_memory()


def _forget(loaded: LoadedModel) -> None:
    """An evicted model's kept KV groups and captured rounds go with it (models/pools.py)."""
    model = getattr(loaded, "model", None)
    if isinstance(model, torch.nn.Module):
        release_pools(model)


def _release_memory() -> None:
    """Free what evicted models held, now that nothing here refers to them."""
    gc.collect()
    if torch.cuda.is_available():
        empty_cuda_cache()


def _serves(loaded: LoadedModel, load_options: dict[str, object]) -> bool:
    """Whether a held model is on the device and in the dtype asked for (None asks for whatever is held)."""
    device, dtype = load_options.get("device"), load_options.get("dtype")
    return (device is None or loaded.device == device) and (dtype is None or loaded.model.dtype == dtype)
