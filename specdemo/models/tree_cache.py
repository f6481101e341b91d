"""The engine's batched KV cache and forward pass: rows of any length, each a trunk of kept tokens with a tree of draft
branches, one forward pass for all rows. Where each row's tokens sit is models/layout.py's (pure); this module holds
the keys and values and runs the model."""

# B = rows, L = slots held per row (capacity), n = columns fed in one pass, S = slots attended, V = vocab_size,
# Hkv = key-value heads, d = head size, W = a row's candidates (its branches), K = the longest

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import replace

import torch
from transformers import PretrainedConfig, PreTrainedModel

from specdemo.core.eager_round import decide_rows
from specdemo.core.verdicts import Overflowed, RoundAsk, RowVerdict
from specdemo.models.attention import query_rows_for, use_tree_attention
from specdemo.models.graphs import DEVICE_WORK, wait
from specdemo.models.layout import HOLE, PassPlan, RowRequest, TreeLayout
from specdemo.models.packed import gemm_rows, pack, tree_passes
from specdemo.models.threads import check, governed, one_thread, ungoverned

MASKED_LAYER_TYPES = ("full_attention", "sliding_attention")
GROWTH = 1.5  # capacity grows by this factor (and never below what a pass needs), so rows rarely trigger a copy

__all__ = ["HOLE", "CachedModel", "RowRequest", "TreeCachedModel", "attention_kinds"]


def attention_kinds(name: str, config: PretrainedConfig) -> tuple[str, ...]:
    """The attention kinds of the model's layers. A layer of any other kind (linear attention, Mamba) keeps a
    recurrent state that cannot be split into rows and branches or rolled back past a rejected draft: refused."""
    kinds = getattr(config, "layer_types", None) or (
        ["sliding_attention"] if getattr(config, "sliding_window", None) else ["full_attention"]
    )
    unknown = sorted(set(kinds) - set(MASKED_LAYER_TYPES))
    if unknown:
        raise ValueError(
            f"'{name}' has {', '.join(unknown)} layers, which keep a recurrent state that cannot be rolled back after "
            "a rejected draft token, so it cannot take part in speculative decoding here: pick an attention-only model."
        )
    return tuple(sorted(set(kinds)))


class RowCache:
    """Keys and values per layer, [rows, Hkv, L, d] each, written in place at the slots a pass names: what the model's
    attention layers call a cache (they call `update` only). Slot L - 1 is scratch, where padding columns write. Held in
    float32 for a bfloat16 or float16 model, the format tree attention multiplies in (models/attention.py)."""

    is_compileable = False

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.rows = 0  # B: the rows in use, the first ones
        self.slots = 0  # L, the scratch slot included
        self.write_rows = self.write_slots = torch.empty(0, dtype=torch.long, device="cpu")  # [B*n] where it writes
        self.write_range: slice | None = None  # the slots every row writes, where they are one run for all rows
        self.width = 0  # S: slots attended this pass

    def reserve(self, rows: int, slots: int) -> None:
        """Room for `rows` rows of `slots` slots besides the scratch one; grown buffers keep what they held."""
        self.rows = rows
        held_rows, held_slots = (self.keys[0].shape[0], self.slots) if self.keys else (0, self.slots)
        new_rows = held_rows if rows <= held_rows else max(rows, int(held_rows * GROWTH))
        new_slots = held_slots if slots + 1 <= held_slots else max(slots + 1, int(held_slots * GROWTH))
        if self.keys and (new_rows, new_slots) != (held_rows, held_slots):
            self.keys = [_grown(table, new_rows, new_slots) for table in self.keys]
            self.values = [_grown(table, new_rows, new_slots) for table in self.values]
        self.slots = new_slots

    def begin(self, plan: PassPlan, device: torch.device) -> None:
        """The pass's writes: column c of row b goes to plan.write_slots[b][c] (the scratch slot for padding); where
        every row writes the same run of slots (a pass of one row, say), each layer's write is one copy."""
        self.width = plan.width
        first = plan.write_slots[0][0]
        run = list(range(first, first + len(plan.write_slots[0])))
        if first >= 0 and all(slots == run for slots in plan.write_slots):
            self.write_range = slice(first, first + len(run))
            return
        self.write_range = None
        slots = torch.tensor(plan.write_slots, dtype=torch.long, device=device)  # [B, n]
        slots = torch.where(slots < 0, self.slots - 1, slots)
        self.write_rows = torch.arange(slots.shape[0], device=device).repeat_interleave(slots.shape[1])  # [B*n]
        self.write_slots = slots.flatten()  # [B*n]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, cache_kwargs: object = None
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [B, Hkv, n, d] each -> [B, Hkv, S, d] each
        if layer_idx == len(self.keys):  # first pass: this layer's buffers, shaped by its keys
            batch, heads, _, size = key_states.shape
            shape = (max(self.rows, batch), heads, self.slots, size)
            table_dtype = torch.promote_types(key_states.dtype, torch.float32)  # models/attention.py's products
            self.keys.append(key_states.new_zeros(shape, dtype=table_dtype))  # zeros: masked slots never hold NaN
            self.values.append(value_states.new_zeros(shape, dtype=table_dtype))
        for table, states in ((self.keys[layer_idx], key_states), (self.values[layer_idx], value_states)):
            if self.write_range is not None:  # one run of slots for every row (one row, say): a plain copy
                table[: states.shape[0], :, self.write_range].copy_(states)
                continue
            flat = states.transpose(1, 2).reshape(-1, states.shape[1], states.shape[3])  # [B*n, Hkv, d]
            table[self.write_rows, :, self.write_slots] = flat.to(table.dtype)
        return self.keys[layer_idx][: self.rows, :, : self.width], self.values[layer_idx][: self.rows, :, : self.width]

    def move_slots(self, moves: list[tuple[int, int, int]]) -> None:
        """Copy keys and values within rows: (row, from slot, to slot), all read before any is written."""
        if not moves or not self.keys:
            return
        rows, sources, targets = (
            torch.tensor(column, device=self.keys[0].device) for column in zip(*moves, strict=True)
        )
        for table in (*self.keys, *self.values):
            table[rows, :, targets] = table[rows, :, sources]

    def move_rows(self, moves: list[tuple[int, int]], rows: int) -> None:
        """Copy whole rows (from row, to row), in order, then keep the first `rows` and zero the others: a row that
        left may have written inf or NaN (decoding.NonFiniteLogits), which a later row there would meet at its masked
        slots (0 * NaN)."""
        for source, target in moves:
            for table in (*self.keys, *self.values):
                table[target] = table[source]
        if rows < self.rows:
            for table in (*self.keys, *self.values):
                table[rows : self.rows].zero_()
        self.rows = rows

    def copy_rows(self, other: RowCache, pairs: list[tuple[int, int]], length: int) -> None:
        """Take the first `length` slots of other's rows: (other's row, this row) pairs."""
        if not self.keys:  # nothing decoded here yet: this cache's layers are shaped like other's
            shape = (self.rows, *other.keys[0].shape[1:2], self.slots, other.keys[0].shape[3])
            self.keys = [t.new_zeros(shape) for t in other.keys]
            self.values = [t.new_zeros(shape) for t in other.values]
        for mine, theirs in ((self.keys, other.keys), (self.values, other.values)):
            for table, source in zip(mine, theirs, strict=True):
                for from_row, to_row in pairs:
                    table[to_row, :, :length] = source[from_row, :, :length]


def keeps_bits(model: PreTrainedModel) -> bool:
    """Whether the model's tree passes give the same logits on one thread as on torch's count: a 4-token prompt with a
    3-token branch in one pass, then a one-token step, on a fresh cache (models/threads.py's `check`)."""
    ids = [(100 + 7 * i) % model.config.vocab_size for i in range(8)]  # any tokens
    requests = (RowRequest(ids[:4], [ids[4:7]], "all"), RowRequest(ids[:5], [], "tips"))
    most = torch.get_num_threads()
    logits = []
    for threads in (1, most):
        torch.set_num_threads(threads)
        try:
            with ungoverned():
                cache = TreeCachedModel(model)
                logits.append([cache.logits({0: request})[0] for request in requests])
        finally:
            torch.set_num_threads(most)
    return all(torch.equal(one, all_) for one, all_ in zip(*logits, strict=True))


def _grown(table: torch.Tensor, rows: int, slots: int) -> torch.Tensor:  # [B, Hkv, L, d] -> [rows, Hkv, slots, d]
    grown = table.new_zeros(rows, table.shape[1], slots, table.shape[3])
    grown[: table.shape[0], :, : table.shape[2]] = table
    return grown


class CachedModel:
    """What the engine's caches share (this tree cache, and models/fixed_shape.py's on a GPU): the model attending
    with tree_attention, its layers' attention kinds and sliding window, and what the latest passes fed and took."""

    def __init__(self, model: PreTrainedModel, hidden_layers: tuple[int, ...] = ()) -> None:
        self.model = model
        self.hidden_layers = hidden_layers  # for a drafter that reads them (drafters.base.hidden_layers)
        self.device = model.device
        self.layer_kinds = attention_kinds(model.config.name_or_path or model.config.model_type, model.config)
        self.sliding_window = getattr(model.config, "sliding_window", None)
        use_tree_attention(model)
        self.forward_seconds = 0.0
        self.last_forward_seconds = 0.0
        self.last_input_lengths: dict[Hashable, int] = {}  # tokens fed per row in the latest call
        self.last_hidden_states: dict[Hashable, torch.Tensor] = {}  # per row asked, the hidden_layers' states
        # (concatenated, F) where its logits were read, arranged as `logits` arranges them ([W, K+1, F] or
        # [W, F]), if kept
        self.last_rule_seconds = 0.0  # of the latest decide, the seconds the eager rule took after the pass

    @property
    def keep_hidden_states(self) -> bool:
        return bool(self.hidden_layers)

    def logits(self, asked: dict[Hashable, RowRequest]) -> list[torch.Tensor]:
        raise NotImplementedError

    def drop(self, key: Hashable) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Every row leaves and nothing is kept (a decoder starting afresh after running out of memory)."""

    @torch.inference_mode()
    def decide(self, asked: dict[Hashable, RoundAsk]) -> dict[Hashable, RowVerdict | Overflowed | Exception]:
        """Every row's round: one pass for the target's logits along each candidate, then the eager rule
        (core/eager_round.py). Each verdict carries the tokens the pass read for its row and, where they are kept,
        the hidden states where the next round's logits were read."""
        asked = {key: ask.on_host() for key, ask in asked.items()}
        logits = self.logits(
            {key: RowRequest(a.trunk_ids, list(a.candidates), "all", a.capacity) for key, a in asked.items()}
        )
        return self.rule_verdicts(asked, logits)

    def rule_verdicts(
        self, asked: dict[Hashable, RoundAsk], logits: list[torch.Tensor]
    ) -> dict[Hashable, RowVerdict | Overflowed | Exception]:
        """The eager rule's verdicts on the latest pass's logits (per row [W, K+1, V], in the order asked), each with
        the tokens the pass read for its row and its hidden state at the path's accepted position."""
        started = time.perf_counter()
        with one_thread():  # its bits whatever the thread count (models/threads.py)
            decided = dict(zip(asked, decide_rows(list(asked.values()), logits), strict=True))
        for key, outcome in decided.items():
            if isinstance(outcome, RowVerdict):
                path, accepted = outcome.path, outcome.num_accepted
                hidden = self.last_hidden_states[key][path, accepted] if self.hidden_layers else None
                decided[key] = replace(outcome, num_input_tokens=self.last_input_lengths[key], hidden_state=hidden)
        self.last_rule_seconds = time.perf_counter() - started
        return decided

    def read_hidden(self, hidden_states: tuple[torch.Tensor, ...], num_logits: int) -> torch.Tensor:
        """[B, num_logits, F]: the hidden_layers' states where the logits were read, concatenated."""
        return torch.cat([hidden_states[layer][:, -num_logits:] for layer in self.hidden_layers], dim=-1)


class TreeCachedModel(CachedModel):
    """A model and one KV cache for a batch of rows that join, leave, grow and branch independently; every row's
    logits are those of the row alone, bit for bit in any batch (models/attention.py), and the sliding window is
    applied in the mask by position, so a sliding-window model stays exact however far it decodes."""

    def __init__(self, model: PreTrainedModel, hidden_layers: tuple[int, ...] = ()) -> None:
        super().__init__(model, hidden_layers)
        pack(model)  # its linears, for tree passes, once (models/packed.py)
        check(model, keeps_bits)  # its passes' bits on fewer threads, once (models/threads.py)
        self.query_rows = query_rows_for(model, torch.promote_types(model.dtype, torch.float32))  # the cache's format
        self.layout = TreeLayout()
        self.cache = RowCache()

    @property
    def length(self) -> int:
        """The slots the latest pass attended to, per row: the widest row, rounded up to WIDTH_STEP."""
        return self.cache.width

    @property
    def widest(self) -> int:
        """The most slots one row holds (its tokens, kept branches included)."""
        return self.layout.widest

    def drop(self, key: Hashable) -> None:
        """The row leaves before the next pass (its place goes to the last row: one row copied, not the cache)."""
        self.layout.drop(key)

    @torch.inference_mode()
    def logits(self, asked: dict[Hashable, RowRequest]) -> list[torch.Tensor]:
        """One forward pass for all rows; a new key joins, a row not asked sits the pass out. In the order asked:
        for logits_for="all", [W, K+1, V] with position 0 after the trunk and j+1 after branch w's first j+1 tokens
        (W = 1, K = 0 without branches; zeros past a shorter branch's end); for "tips", [W, V] after each branch's
        last token ([1, V] after the trunk without branches)."""
        self.cache.move_rows(self.layout.remove_leaving(), len(self.layout.keys))
        if not self.layout.keys:
            self.cache = RowCache()  # nobody left: the next rows start small
        prefilled = self._prefill_joining(asked)
        plan = self.layout.plan(asked, gemm_rows(self.model))
        self.cache.reserve(len(plan.keys), plan.width)
        self.cache.move_slots(plan.moves)
        logits, hidden = self._forward(plan)  # [B, num_logits, V], [B, num_logits, H] or None
        self.last_input_lengths = {key: prefilled.get(key, 0) + fed for key, fed in plan.fed.items()}
        first = len(plan.tokens[0]) - plan.num_logits  # the column of logits[:, 0]
        if hidden is not None:
            self.last_hidden_states = {
                key: self._row_logits(hidden[plan.keys.index(key)], plan.logit_columns[key], first, request.logits_for)
                for key, request in asked.items()
            }
        return [
            self._row_logits(logits[plan.keys.index(key)], plan.logit_columns[key], first, request.logits_for)
            for key, request in asked.items()
        ]

    def _prefill_joining(self, asked: dict[Hashable, RowRequest]) -> dict[Hashable, int]:
        """New rows read their sequence (all but its last token) in a pass of their own, on a cache of their own that
        then joins this one, when that saves work: rows already decoding are not padded to a prompt's length, and
        rows with the same prompt read it once. Returns the tokens each joining row read."""
        joining = {
            key: tuple(request.trunk_ids[:-1])
            for key, request in asked.items()
            if key not in self.layout.keys and len(request.trunk_ids) > 1
        }
        prompts = list(dict.fromkeys(joining.values()))  # each distinct prompt once
        if not joining or not (self.layout.keys or len(prompts) < len(joining)):
            return {}  # a new batch of different prompts reads them in its first pass
        own = TreeCachedModel(self.model)
        own.logits({index: RowRequest(list(prompt), [], "tips") for index, prompt in enumerate(prompts)})
        rows = [self.layout.add(key, list(prompt)) for key, prompt in joining.items()]
        self.cache.reserve(len(self.layout.keys), max(own.cache.width, self.layout.widest))
        pairs = [(prompts.index(prompt), row) for prompt, row in zip(joining.values(), rows, strict=True)]
        self.cache.copy_rows(own.cache, pairs, max(map(len, prompts)))
        self.forward_seconds += own.forward_seconds
        return {key: len(prompt) for key, prompt in joining.items()}

    @staticmethod
    def _row_logits(logits: torch.Tensor, columns: list[list[int]], first: int, logits_for: str) -> torch.Tensor:
        """One row's logits ([num_logits, V]) by branch, as `logits` documents (or its hidden states, [.., H])."""
        if logits_for == "tips":
            return logits[[branch[0] - first for branch in columns]]  # [W, V]
        depth = max(map(len, columns))
        arranged = logits.new_zeros(len(columns), depth, logits.shape[-1])  # [W, K+1, V]
        for w, branch in enumerate(columns):
            arranged[w, : len(branch)] = logits[[column - first for column in branch]]
        return arranged

    def _forward(self, plan: PassPlan) -> tuple[torch.Tensor, torch.Tensor | None]:  # [B, num_logits, V], [.., H]
        with DEVICE_WORK:  # as all device work in a thread (models/graphs.py)
            tokens = torch.tensor(plan.tokens, dtype=torch.long, device=self.device)  # [B, n]
            positions = torch.tensor(plan.positions, dtype=torch.long, device=self.device)  # [B, n]
            masks = {
                kind: plan.masks(self.sliding_window if kind == "sliding_attention" else None, self.device)
                for kind in self.layer_kinds
            }
            self.cache.begin(plan, self.device)
            started = time.perf_counter()
            with tree_passes(self.model), governed(self.model):
                output = self.model(
                    input_ids=tokens.clamp(min=0),  # padding reads token 0 and is never attended to
                    position_ids=positions,
                    attention_mask=masks if len(masks) > 1 else next(iter(masks.values())),
                    past_key_values=self.cache,
                    use_cache=True,
                    logits_to_keep=plan.num_logits,
                    tree_pass=True,
                    query_rows=self.query_rows,
                    output_hidden_states=self.keep_hidden_states,
                )
            wait(self.device)
            self.last_forward_seconds = time.perf_counter() - started
            self.forward_seconds += self.last_forward_seconds
            if not self.keep_hidden_states:
                return output.logits, None
            return output.logits, self.read_hidden(output.hidden_states, plan.num_logits)
