"""The keys and values of fixed-shape passes, kept for the process: groups of PASS_ROWS chain rows of one slot bucket,
each with its captured programs, leased to a model's decoders while their rows decode and kept, when they empty, for
the next run or request, up to IDLE_BYTES a model (the oldest idle groups go first). A model loaded for a pair holds
all its groups, leased and idle, to its memory plan's bytes (models/memory.py's pool_bytes): each group's keys and
values at the plan's figure per slot, and the buffers its seen rows and programs hold on the device as made. Idle
groups go first, and past that a new group is refused as the device would refuse it, out of memory. An evicted model's
groups go with it (release_pools)."""

# R = PASS_ROWS chain rows, L = slots (a bucket), Hkv = key-value heads, d = head size, V = vocab_size

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from specdemo.models.graphs import Program, memory_pool
from specdemo.models.platform import fork_safe

PASS_ROWS = 8  # R: chains per pass; a batch of up to 8 one-candidate rows (the app's) decodes in one pass
IDLE_BYTES = 2 * 2**30  # idle groups kept per model, in device bytes (Group.nbytes): a 256-slot group of SmolLM2-135M's
# shape holds 47 MB of keys and values in bfloat16, and 13 MB more where a pass program keeps its [R, n, V] logits


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
    def table_bytes(self) -> int:
        """Keys and values, as the passes that wrote them made them."""
        return sum(table.nbytes for table in (*self.keys, *self.values))

    @property
    def buffer_bytes(self) -> int:
        """What the group holds on the device beside its keys and values: its seen rows and every program's inputs
        and outputs. Its staging buffers are the host's (pinned on CUDA), not counted here."""
        seen = [] if self.seen is None else [self.seen]
        programs = tuple(self.programs.values())  # one copy: a decoder may add a program to a leased group meanwhile
        held = [tensor for program in programs for tensor in (*program.inputs, *program.outputs)]
        return sum(tensor.nbytes for tensor in (*seen, *held))

    @property
    def nbytes(self) -> int:
        """All the group holds on the device: keys, values, seen rows and its programs' inputs and outputs."""
        return self.table_bytes + self.buffer_bytes

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
        self.lock = fork_safe(threading.Lock())
        self.idle: list[Group] = []  # oldest first
        self.memory = memory_pool(device)  # the graph pool its programs share
        self.graphs_failed = False  # a capture failed: this model's programs run eagerly
        self.captures: list[tuple[Hashable, float]] = []  # (mode, seconds) of every capture, in order
        self.budget: int | None = None  # bytes all its groups may hold (limit); None: as many as the device gives
        self.slot_bytes = 0  # keys and values of one slot of a group: R rows, every layer
        self.groups: weakref.WeakSet[Group] = weakref.WeakSet()  # every group alive, leased or idle

    def limit(self, budget: int, slot_bytes: int) -> None:
        """Hold all groups to `budget` bytes, a group of L slots taking L * slot_bytes for its keys and values (the
        memory plan's figures) and its buffers as made (Group.buffer_bytes)."""
        with self.lock:
            self.budget, self.slot_bytes = budget, slot_bytes

    def lease(self, slots: int) -> Group:
        """An idle group of `slots` slots (its memory and programs reused), the newest first (it holds the programs the
        latest runs captured), or a new one within the budget."""
        with self.lock:
            for group in reversed(self.idle):
                if group.slots == slots:
                    self.idle.remove(group)
                    return group
            self._make_room(slots)
            group = Group(slots)
            self.groups.add(group)
            return group

    def _make_room(self, slots: int) -> None:
        """Idle groups go, oldest first, until a group of `slots` slots fits the budget; past that, out of memory. A new
        group's buffers are made at its programs' first use, and counted from then on."""
        if self.budget is None:
            return
        needed = slots * self.slot_bytes
        while self.idle and self._held() + needed > self.budget:
            self.groups.discard(self.idle.pop(0))  # no decoder holds it: its memory goes at the next collection
        if self._held() + needed > self.budget:
            gc.collect()  # groups of decoders closed after running out of memory wait in reference cycles
        if self._held() + needed > self.budget:
            raise torch.OutOfMemoryError(
                f"A group of {slots} slots would take the pools past the {self.budget:,} bytes the memory plan "
                f"gives them ({self._held():,} held)."
            )

    def _held(self) -> int:
        """Bytes the groups alive hold against the budget: keys and values at the plan's figure, buffers as made."""
        return sum(group.slots * self.slot_bytes + group.buffer_bytes for group in self.groups)

    def give_back(self, group: Group) -> None:
        """The group, empty now, waits for the next run, the oldest idle groups going past IDLE_BYTES in all; a group
        of more than IDLE_BYTES is not kept (its memory goes when its last holder lets it go)."""
        with self.lock:
            if group.nbytes > IDLE_BYTES:
                self.groups.discard(group)
                return
            self.idle.append(group)
            while sum(g.nbytes for g in self.idle) > IDLE_BYTES:
                self.groups.discard(self.idle.pop(0))

    def forget_idle(self) -> None:
        with self.lock:
            for group in self.idle:
                self.groups.discard(group)
            self.idle.clear()

    @property
    def capture_seconds(self) -> float:
        return sum(seconds for _, seconds in self.captures)


_POOLS: weakref.WeakKeyDictionary[torch.nn.Module, ModelPools] = weakref.WeakKeyDictionary()  # programs refer to
# their model weakly, so a model no one holds goes with its groups
_LIMITS: weakref.WeakKeyDictionary[torch.nn.Module, tuple[int, int]] = weakref.WeakKeyDictionary()  # model ->
# (budget, slot bytes), kept apart from its pools, which are made at its first pass (on ZeroGPU, in a call's worker)
_POOLS_LOCK = fork_safe(threading.Lock())


def pools_for(model: torch.nn.Module) -> ModelPools:
    """The model's groups, kept for the process."""
    with _POOLS_LOCK:
        pools = _POOLS.get(model)
        if pools is None:
            pools = _POOLS[model] = ModelPools(next(model.parameters()).device)
            if model in _LIMITS:
                pools.limit(*_LIMITS[model])
        return pools


def limit_pools(model: torch.nn.Module, budget: int, slot_bytes: int) -> None:
    """The model's groups, now and when its pools are made, held to `budget` bytes (ModelPools.limit)."""
    with _POOLS_LOCK:
        _LIMITS[model] = (budget, slot_bytes)
        pools = _POOLS.get(model)
    if pools is not None:
        pools.limit(budget, slot_bytes)


def release_pools(model: torch.nn.Module) -> None:
    """The model's idle groups and their programs go now (an evicted model); decoders still running keep theirs."""
    with _POOLS_LOCK:
        _POOLS.pop(model, None)
