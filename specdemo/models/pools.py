"""The keys and values of fixed-shape passes, kept for the process: groups of PASS_ROWS chain rows of one slot bucket,
each with its captured programs, leased to a model's decoders while their rows decode and kept, when they empty, for
the next run or request, up to IDLE_BYTES a model (the oldest idle groups go first). An evicted model's groups go
with it (release_pools)."""

# R = PASS_ROWS chain rows, L = slots (a bucket), Hkv = key-value heads, d = head size, V = vocab_size

from __future__ import annotations

import threading
import weakref
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from specdemo.models.graphs import Program, memory_pool

PASS_ROWS = 8  # R: chains per pass; a batch of up to 8 one-candidate rows (the app's) decodes in one pass
IDLE_BYTES = 2 * 2**30  # idle groups kept per model: a 256-slot group of SmolLM2-135M's shape holds 35 MB in bfloat16


@dataclass(eq=False)
class Group:
    """PASS_ROWS chain rows of `slots` slots: keys and values [R, Hkv, L, d] per layer (made by the first pass that
    writes each layer), the tokens each row's sequence holds (for the repetition penalty), and its programs by mode."""

    slots: int
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    seen: torch.Tensor | None = None  # [R, V] bool, made by the first round with a penalty
    programs: dict[Hashable, Program] = field(default_factory=dict)
    staging: dict[Hashable, object] = field(default_factory=dict)  # per program, its host buffers
    free: list[int] = field(default_factory=lambda: list(range(PASS_ROWS)))

    def take(self) -> int | None:
        return self.free.pop(0) if self.free else None

    def give_back(self, local: int) -> None:
        self.free = sorted([*self.free, local])

    @property
    def used(self) -> int:
        return PASS_ROWS - len(self.free)

    @property
    def nbytes(self) -> int:
        return sum(table.nbytes for table in (*self.keys, *self.values))

    def copy(self, source: int, other: Group, target: int, start: int, stop: int) -> None:
        """Keys and values of slots start..stop - 1 from row `source` here to row `target` of `other`, every layer."""
        if not other.keys:  # no pass wrote there yet: its tables are shaped like these
            other.keys = [torch.zeros_like(table) for table in self.keys]
            other.values = [torch.zeros_like(table) for table in self.values]
        for mine, theirs in ((self.keys, other.keys), (self.values, other.values)):
            for table, into in zip(mine, theirs, strict=True):
                into[target, :, start:stop] = table[source, :, start:stop]


class ModelPools:
    """One model's groups: leased ones, in use by a decoder's rows, and idle ones, kept with their programs."""

    def __init__(self, device: torch.device) -> None:
        self.lock = threading.Lock()
        self.idle: list[Group] = []  # oldest first
        self.memory = memory_pool(device)  # the graph pool its programs share
        self.graphs_failed = False  # a capture failed: this model's programs run eagerly
        self.captures: list[tuple[Hashable, float]] = []  # (mode, seconds) of every capture, in order

    def lease(self, slots: int) -> Group:
        """An idle group of `slots` slots (its memory and programs reused), or a new one."""
        with self.lock:
            for group in self.idle:
                if group.slots == slots:
                    self.idle.remove(group)
                    return group
        return Group(slots)

    def give_back(self, group: Group) -> None:
        """The group, empty now, waits for the next run; the oldest idle groups go past IDLE_BYTES."""
        with self.lock:
            self.idle.append(group)
            while len(self.idle) > 1 and sum(g.nbytes for g in self.idle) > IDLE_BYTES:
                self.idle.pop(0)

    def forget_idle(self) -> None:
        with self.lock:
            self.idle.clear()

    @property
    def capture_seconds(self) -> float:
        return sum(seconds for _, seconds in self.captures)


_POOLS: weakref.WeakKeyDictionary[torch.nn.Module, ModelPools] = weakref.WeakKeyDictionary()  # programs refer to
# their model weakly, so a model no one holds goes with its groups
_POOLS_LOCK = threading.Lock()


def pools_for(model: torch.nn.Module) -> ModelPools:
    """The model's groups, kept for the process."""
    with _POOLS_LOCK:
        pools = _POOLS.get(model)
        if pools is None:
            pools = _POOLS[model] = ModelPools(next(model.parameters()).device)
        return pools


def release_pools(model: torch.nn.Module) -> None:
    """The model's idle groups and their programs go now (an evicted model); decoders still running keep theirs."""
    with _POOLS_LOCK:
        _POOLS.pop(model, None)
