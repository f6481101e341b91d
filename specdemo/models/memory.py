"""The memory a pair needs on a device, term by term, before anything loads: its weights, the keys and values of the
largest runs its limits allow, the programs' buffers, the working memory of a pass and of the rule, and the load-time
cost measurement; and the limits (slots per row, groups of chain rows at once) that make it fit the device. Pure:
shapes, settings and byte counts in, a plan out (models/pools.py holds a model's groups to it)."""

# R = PASS_ROWS chain rows of a group, n = PASS_COLUMNS tokens per chain, L = a group's slots, V = vocab_size,
# H = query heads, Hkv = key-value heads, d = head size, W = a row's candidates, K = its drafted tokens, m = tokens read

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from specdemo.models.attention import QUERY_CHUNK
from specdemo.models.fixed_pass import PASS_COLUMNS
from specdemo.models.fixed_shape import MIN_SLOTS, slot_bucket
from specdemo.models.pools import PASS_ROWS
from specdemo.models.tree_cache import GROWTH

# Estimates. tests/models/test_memory.py counts what the target's passes allocate (groups, pass outputs, a prompt's
# read) against the plan; the round programs' rule and q inputs, the rule for rows of several candidates and the draft
# model's cache are counted here only:
RULE_COPIES = 8  # float32 [R, n, V] tensors a round's rule holds at once on the device (logits in float32, warped,
# probabilities, top-p's sorted values and int64 indices, residual, draws)
HOST_RULE_COPIES = 4  # float32 [W, K+1, V] tensors per row of the rule for rows of several candidates (p, q, residual)
ROUND_MODES_WITH_DRAFT_PROBS = 4  # round programs per group that take a sampled draft's q: greedy or sampled target,
# with or without a penalty (models/fixed_shape.py keys a group's programs by these)
SMALLEST_SLOTS = 2 * MIN_SLOTS  # limits never go below rows of 511 tokens: what the cost measurement itself holds


@dataclass(frozen=True)
class ModelShape:
    """What a model's memory depends on, as its config.json says it."""

    parameters: int  # a tied embedding once
    layers: int
    hidden_size: int
    intermediate_size: int
    attention_heads: int  # H
    kv_heads: int  # Hkv
    head_dim: int  # d
    vocab_size: int  # V
    context: int  # max_position_embeddings: no row holds more tokens

    @classmethod
    def from_config(cls, config: PretrainedConfig, parameters: int) -> ModelShape:
        heads = config.num_attention_heads
        return cls(
            parameters=parameters,
            layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            attention_heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            vocab_size=config.vocab_size,
            context=getattr(config, "max_position_embeddings", 2048),
        )

    def slot_bytes(self, dtype: torch.dtype) -> int:
        """Keys and values of one token of one row, every layer."""
        return self.layers * 2 * self.kv_heads * self.head_dim * dtype.itemsize

    def group_bytes(self, slots: int, dtype: torch.dtype) -> int:
        """A group's keys and values: [R, Hkv, L, d] twice per layer (models/fixed_pass.py's _PassCache makes them)."""
        return PASS_ROWS * slots * self.slot_bytes(dtype)


@dataclass(frozen=True)
class Device:
    """A device as the plan sees it: its whole memory and its passes' shape."""

    name: str
    total_bytes: int
    fixed_shape: bool  # its passes are fixed-shape, over groups (models/passes.py): a GPU; False: tree passes, a CPU


@dataclass(frozen=True)
class RunSettings:
    """The largest runs the app's settings allow, and what the load-time measurement holds."""

    rows: int  # runs decoding at once as rows of one batch (engine/scheduler.py's MAX_BATCH_ROWS)
    candidates: int  # W of each
    draft_tokens: int  # K of each candidate
    tokens: int  # a row's prompt and new tokens
    measured_slots: int  # L of the measurement's groups (engine/costs.py)
    measured_groups: int  # groups it holds at once: a decoder of one row and one of `rows` rows


@dataclass(frozen=True)
class RunLimits:
    """What runs of a pair may hold on a device: rows of at most slots - 1 tokens (a row's bucket is the power of two
    above its tokens), and `groups` groups of R chain rows (a row takes one per candidate)."""

    slots: int  # L
    groups: int

    @property
    def tokens(self) -> int:
        return self.slots - 1

    @property
    def chains(self) -> int:
        return self.groups * PASS_ROWS


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes by term (what the pair needs at its limits) against the bytes usable on the device."""

    terms: dict[str, int]
    usable: int
    limits: RunLimits
    full: bool  # the limits are the settings' own: nothing cut for this device

    @property
    def needed(self) -> int:
        return sum(self.terms.values())

    @property
    def fits(self) -> bool:
        return self.needed <= self.usable

    @property
    def biggest(self) -> str:
        return max(self.terms, key=self.terms.__getitem__)

    @property
    def pool_bytes(self) -> int:
        """What the target's groups may hold, leased and idle: a run's and the measurement's keys and values, and the
        buffers their seen rows and programs hold (models/pools.py counts each group's as made)."""
        return sum(self.terms.get(term, 0) for term in ("keys and values", "cost measurement", "program buffers"))


def plan_terms(
    target: ModelShape,
    draft: ModelShape | None,
    weights: int,
    dtype: torch.dtype,
    settings: RunSettings,
    limits: RunLimits,
) -> dict[str, int]:
    """The bytes of each term for runs at `limits`; estimates are marked where their figures are set above."""
    n, vocab = PASS_COLUMNS, target.vocab_size
    groups = limits.groups
    terms = {
        "weights": weights,
        "keys and values": groups * target.group_bytes(limits.slots, dtype),
        "cost measurement": settings.measured_groups * target.group_bytes(settings.measured_slots, dtype),
        # Each group's pass writes [R, n, V] logits into an output it owns (float32 counted, an upper bound), and its
        # round programs take a sampled draft's [R, K, V] float32 q and keep a [R, V] bool seen row.
        "program buffers": (groups + settings.measured_groups)
        * PASS_ROWS
        * vocab
        * (n * 4 + ROUND_MODES_WITH_DRAFT_PROBS * (n - 1) * 4 + 1),
        "graph pool": _round_working_bytes(target, dtype, limits.slots),
        "working memory": max(
            _read_working_bytes(target, dtype, 1, limits.tokens, limits.slots),
            min(settings.rows * settings.candidates, limits.chains)
            * (settings.draft_tokens + 1)
            * vocab
            * 4
            * HOST_RULE_COPIES,
        ),
    }
    if draft is not None:  # a draft model decodes in a tree cache that grows by half (models/tree_cache.py)
        rows, tokens = math.ceil(GROWTH * settings.rows), math.ceil(GROWTH * (limits.tokens + 1))
        terms["draft keys and values"] = rows * tokens * draft.slot_bytes(dtype)
        terms["working memory"] = max(
            terms["working memory"], _read_working_bytes(draft, dtype, settings.rows, limits.tokens, tokens)
        )
    return terms


def _round_working_bytes(shape: ModelShape, dtype: torch.dtype, slots: int) -> int:
    """A group's pass and round, the intermediates a captured program keeps in its graph pool (an estimate): one
    layer's attention scores [R, H, n, L] in the model's format and their float32 softmax, and the rule's float32
    copies of [R, n, V]."""
    scores = PASS_ROWS * shape.attention_heads * PASS_COLUMNS * slots * (2 * dtype.itemsize + 4)
    return scores + RULE_COPIES * PASS_ROWS * PASS_COLUMNS * shape.vocab_size * 4


def _read_working_bytes(shape: ModelShape, dtype: torch.dtype, rows: int, tokens: int, slots: int) -> int:
    """A pass that reads `tokens` prompt tokens of each of `rows` rows (an estimate): one chunk of attention scores
    [rows, Hkv, QUERY_CHUNK, L] and its float32 softmax (models/attention.py), and one layer's MLP and hidden states."""
    scores = rows * shape.kv_heads * QUERY_CHUNK * slots * (2 * dtype.itemsize + 4)
    layer = rows * tokens * (3 * shape.intermediate_size + 4 * shape.hidden_size) * dtype.itemsize
    return scores + layer


def limit_ladder(target: ModelShape, settings: RunSettings) -> list[RunLimits]:
    """The limits to try, most room first (slots in all, then the longest rows): the settings' own, then halved slot
    buckets and halved groups, down to one group of SMALLEST_SLOTS."""
    widest = max(SMALLEST_SLOTS, slot_bucket(min(settings.tokens, target.context)))
    all_groups = math.ceil(settings.rows * settings.candidates / PASS_ROWS)
    slots = [widest >> i for i in range(widest.bit_length()) if widest >> i >= SMALLEST_SLOTS]
    groups = sorted({max(1, all_groups >> i) for i in range(all_groups.bit_length())}, reverse=True)
    ladder = [RunLimits(s, g) for s in slots for g in groups]
    return sorted(ladder, key=lambda limits: (-limits.slots * limits.groups, -limits.slots))


def plan_memory(
    target: ModelShape,
    draft: ModelShape | None,
    weights: int,
    dtype: torch.dtype,
    usable: int,
    settings: RunSettings,
) -> MemoryPlan:
    """The plan at the first limits that fit `usable` bytes (the settings' own where they fit), else at the smallest
    limits, which do not fit."""
    ladder = limit_ladder(target, settings)
    for limits in ladder:
        plan = MemoryPlan(
            plan_terms(target, draft, weights, dtype, settings, limits), usable, limits, limits == ladder[0]
        )
        if plan.fits:
            return plan
    return plan


def weights_plan(weights: int, usable: int) -> MemoryPlan:
    """A plan of weights alone: on the CPU, where tree passes grow their caches in the machine's memory as rows need
    them (MEMORY_HEADROOM leaves the rest for them)."""
    return MemoryPlan({"weights": weights}, usable, RunLimits(0, 0), True)
