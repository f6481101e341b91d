"""The engine's batched KV cache: rows of any length, each a trunk of kept tokens with a tree of draft branches,
one forward pass for all rows, rejected slots masked as holes and squeezed out at the next pass."""

# B = rows, L = cache slots, n = slots fed in one pass, C = branch slots fed per row (padded), V = vocab_size,
# W = branches (draft candidates) of one row, K = branch length

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Literal

import torch
from transformers import DynamicCache, PretrainedConfig, PreTrainedModel

HOLE = -1  # the token of a slot nobody may attend to: padding, a rejected draft, a branch no longer asked for
NO_PARENT = -1  # the parent of trunk slots (visible to every later slot) and of holes
MASKED_LAYER_TYPES = ("full_attention", "sliding_attention")
COMPACT_AFTER_HOLES = 64  # the whole cache is compacted once the widest row leaves this many holes and half itself


@dataclass(frozen=True)
class RowRequest:
    """What one row asks of a pass: logits after its trunk and along its branches."""

    trunk_ids: list[int]  # the whole sequence so far: prompt and emitted tokens
    branch_ids: list[list[int]]  # W draft chains hanging from the trunk's last token; may be empty
    logits_for: Literal["all", "tips"]  # all: the trunk's end and every branch token (verification);
    # tips: each branch's last token, or the trunk's end when there is no branch (one drafting step)


@dataclass
class _Row:
    """The Python side of one row: the kept tokens and the slots their keys and values sit in."""

    trunk_ids: list[int]
    trunk_end: int  # the slot of the trunk's last token (-1 before the first pass)


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


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so that a timer around it measures the work and not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


class TreeCachedModel:
    """A model and one KV cache for a batch of rows that join, leave, grow and branch independently.

    Every slot of the cache holds one token's keys and values, or a hole. A row's trunk slots are its sequence;
    its tree slots are draft tokens, each seeing the trunk and its own ancestors only. Before each pass the tree
    slots that the new request still uses are kept (they join the trunk when the sequence grew through them), the
    rest become holes, and holes since the last settled slot are squeezed out. Positions count kept tokens, so
    every row's logits are those of the row alone. The cache keeps full layers and the sliding window is applied
    in the mask by position, so a sliding-window model stays exact through the holes.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.device = model.device
        self.layer_kinds = attention_kinds(model.config.name_or_path or model.config.model_type, model.config)
        self.sliding_window = getattr(model.config, "sliding_window", None)
        self.cache = DynamicCache()  # full layers: nothing is dropped behind the holes
        self.row_keys: list[Hashable] = []
        self.rows: list[_Row] = []
        self.leaving: set[Hashable] = set()  # rows that left, removed before the next pass
        empty = torch.empty(0, 0, dtype=torch.long, device=self.device)
        self.tokens = empty  # [B, L] HOLE where no one may attend
        self.positions = empty  # [B, L]
        self.parents = empty  # [B, L] the parent slot of a tree slot; NO_PARENT for trunk slots and holes
        self.settled = 0  # slots before this one hold trunk tokens or holes only, in every row
        self.forward_seconds = 0.0
        self.last_forward_seconds = 0.0
        self.last_input_lengths: dict[Hashable, int] = {}  # tokens fed per row in the latest pass

    @property
    def length(self) -> int:  # L
        return self.tokens.shape[1]

    @property
    def widest(self) -> int:
        """The most slots one row holds (its tokens, kept branches included); the rest of the length is holes."""
        return int((self.tokens != HOLE).sum(dim=1).max()) if self.length else 0

    def _add_rows(self, keys: list[Hashable]) -> None:
        """New rows join as rows of holes as long as the cache."""
        new = [key for key in keys if key not in self.row_keys]
        if not new:
            return
        self.row_keys += new
        self.rows += [_Row([], -1) for _ in new]

        def grow(table: torch.Tensor, fill: float) -> torch.Tensor:  # [B_old, ...] -> [B_old + new, ...]
            return torch.cat([table, table.new_full((len(new), *table.shape[1:]), fill)])

        self.tokens, self.positions, self.parents = (
            grow(self.tokens, HOLE),
            grow(self.positions, 0),
            grow(self.parents, NO_PARENT),
        )
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys, layer.values = grow(layer.keys, 0.0), grow(layer.values, 0.0)

    def drop(self, key: Hashable) -> None:
        """The row leaves: its slots go from every table and layer before the next pass, together with those of
        every row that left since (one copy of the cache, however many rows leave in a round)."""
        if key in self.row_keys:
            self.leaving.add(key)

    def _remove_leaving(self) -> None:
        if not self.leaving:
            return
        stay = [b for b, key in enumerate(self.row_keys) if key not in self.leaving]
        self.row_keys, self.rows = [self.row_keys[b] for b in stay], [self.rows[b] for b in stay]
        self.leaving.clear()
        if not self.rows:  # nobody left: start over
            self.__init__(self.model)
            return
        index = torch.tensor(stay, device=self.device)
        self.tokens, self.positions, self.parents = self.tokens[index], self.positions[index], self.parents[index]
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys, layer.values = layer.keys[index], layer.values[index]

    def _match(self, b: int, request: RowRequest) -> list[tuple[int, int]]:
        """Keep the tree slots the request still uses (the trunk grew through them, or a branch runs along them)
        and make the rest holes. Returns, per branch, (tokens already cached, the slot they end at)."""
        row, trunk = self.rows[b], request.trunk_ids
        assert trunk[: len(row.trunk_ids)] == row.trunk_ids, "a row's sequence may only grow"
        region = slice(self.settled, None)  # tree slots lie past `settled` only
        is_tree = (self.tokens[b, region] != HOLE) & (self.parents[b, region] != NO_PARENT)
        tree_slots = (is_tree.nonzero().flatten() + self.settled).tolist()
        children: dict[int, dict[int, int]] = {}
        for slot, parent, token in zip(
            tree_slots, self.parents[b, tree_slots].tolist(), self.tokens[b, tree_slots].tolist(), strict=True
        ):
            children.setdefault(parent, {}).setdefault(token, slot)
        needs_trunk_logits = request.logits_for == "all" or not request.branch_ids
        if needs_trunk_logits and len(row.trunk_ids) == len(trunk):  # asked again: the last token is fed again
            self.tokens[b, row.trunk_end] = HOLE
            row.trunk_ids.pop()
            earlier = (self.tokens[b, : row.trunk_end] != HOLE) & (self.parents[b, : row.trunk_end] == NO_PARENT)
            row.trunk_end = int(earlier.nonzero().flatten()[-1]) if bool(earlier.any()) else -1
        for token in trunk[len(row.trunk_ids) : len(trunk) - needs_trunk_logits]:  # the trunk grows through the tree
            slot = children.get(row.trunk_end, {}).get(token)
            if slot is None:
                break
            self.parents[b, slot] = NO_PARENT
            row.trunk_ids.append(token)
            row.trunk_end = slot
        kept, starts = set(), [(0, row.trunk_end)] * len(request.branch_ids)
        if request.logits_for == "tips" and len(row.trunk_ids) == len(trunk):
            for w, branch in enumerate(request.branch_ids):  # a branch runs along cached slots up to its tip
                node, matched = row.trunk_end, 0
                while matched < len(branch) - 1 and (slot := children.get(node, {}).get(branch[matched])) is not None:
                    kept.add(slot)
                    node, matched = slot, matched + 1
                starts[w] = (matched, node)
        for slot in tree_slots:
            if slot not in kept and self.parents[b, slot] != NO_PARENT:
                self.tokens[b, slot], self.parents[b, slot] = HOLE, NO_PARENT
        return starts

    def _squeeze(self, starts: list[list[tuple[int, int]]]) -> None:
        """Move each row's kept slots since `settled` to the front, drop the holes after the longest row, and
        settle the slots before the first tree slot of any row. Rows that joined (their prompts' slots are holes in
        every other row) and rows that left leave holes before `settled` too: once they outgrow the widest row by
        half, every slot is squeezed, so a batch that people keep joining attends over what its rows hold."""
        widest = self.widest
        if self.length - widest > max(COMPACT_AFTER_HOLES, widest // 2):
            self.settled = 0
        region = self.tokens[:, self.settled :]  # [B, R]
        kept = [(region[b] != HOLE).nonzero().flatten().tolist() for b in range(len(self.rows))]
        width = max((len(k) for k in kept), default=0)
        if all(k == list(range(len(k))) for k in kept) and width < region.shape[1]:
            self._truncate(self.settled + width)  # holes at the ends only (a chain's rejected tail): nothing moves
        elif any(k != list(range(region.shape[1])) for k in kept):
            index = torch.tensor(  # [B, R'] the old slot of each new one; padding repeats slot 0 of the region
                [[self.settled + s for s in k] + [self.settled] * (width - len(k)) for k in kept], dtype=torch.long
            ).reshape(len(kept), width)
            moved = [{self.settled + old: self.settled + new for new, old in enumerate(k)} for k in kept]
            for layer in self.cache.layers:
                layer.keys, layer.values = self._gather(layer.keys, index, 2), self._gather(layer.values, index, 2)
            padding = torch.tensor([[False] * len(k) + [True] * (width - len(k)) for k in kept], dtype=torch.bool)
            self.tokens = self._gather(self.tokens, index, 1)
            self.tokens[:, self.settled :].masked_fill_(padding.reshape(len(kept), width).to(self.device), HOLE)
            self.positions = self._gather(self.positions, index, 1)
            self.parents = self._gather(self.parents, index, 1)
            parents = self.parents[:, self.settled :].tolist()  # parents before `settled` are NO_PARENT: no move
            for b, mapping in enumerate(moved):
                parents[b] = [mapping.get(p, p) for p in parents[b]]
                self.rows[b].trunk_end = mapping.get(self.rows[b].trunk_end, self.rows[b].trunk_end)
                starts[b] = [(matched, mapping.get(slot, slot)) for matched, slot in starts[b]]
            self.parents[:, self.settled :] = torch.tensor(parents, dtype=torch.long).reshape(len(kept), width)
            self.parents.masked_fill_(self.tokens == HOLE, NO_PARENT)
        is_tree = (self.tokens[:, self.settled :] != HOLE) & (self.parents[:, self.settled :] != NO_PARENT)
        if is_tree.numel():
            first_tree = torch.where(is_tree.any(dim=1), is_tree.long().argmax(dim=1), is_tree.shape[1])  # [B]
            self.settled += int(first_tree.min())

    def _truncate(self, length: int) -> None:
        """Every table and layer cut to the first `length` slots (views: the next pass copies the cache anyway)."""
        self.tokens, self.positions, self.parents = (t[:, :length] for t in (self.tokens, self.positions, self.parents))
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[:, :, :length], layer.values[:, :, :length]

    def _gather(self, table: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
        """table with the slots from `settled` on replaced by index's ([B, R']), along dim (rows are dim 0)."""
        shape = [1] * table.ndim
        shape[0], shape[dim] = index.shape
        expanded = [*table.shape[:dim], index.shape[1], *table.shape[dim + 1 :]]
        gathered = table.gather(dim, index.reshape(shape).expand(expanded))
        return torch.cat([table.narrow(dim, 0, self.settled), gathered], dim=dim)

    @torch.inference_mode()
    def logits(self, asked: dict[Hashable, RowRequest]) -> list[torch.Tensor]:
        """One forward pass for all rows; a new key joins, a row not asked sits the pass out. In the order asked:
        for logits_for="all", [W, K+1, V] with position 0 after the trunk and j+1 after branch w's first j+1 tokens
        (W = 1, K = 0 without branches; zeros past a shorter branch's end); for "tips", [W, V] after each branch's
        last token ([1, V] after the trunk without branches)."""
        self._remove_leaving()
        prefilled = self._prefill_joining(asked)
        self._add_rows(list(asked))
        idle = RowRequest([], [], "tips")
        requests = [asked.get(key, idle) for key in self.row_keys]
        starts = [self._match(b, r) if r is not idle else [] for b, r in enumerate(requests)]
        self._squeeze(starts)
        fed_trunks = [
            r.trunk_ids[len(row.trunk_ids) :] if r is not idle else []
            for r, row in zip(requests, self.rows, strict=True)
        ]
        fed_branches = [
            [branch[matched:] for branch, (matched, _) in zip(r.branch_ids, start, strict=True)]
            for r, start in zip(requests, starts, strict=True)
        ]
        num_branch_slots = max(sum(map(len, branches)) for branches in fed_branches)  # C
        width = max(1, *map(len, fed_trunks)) + num_branch_slots  # n: the trunk-end column exists, fed or not
        trunk_end_col = width - num_branch_slots - 1
        tokens = [[HOLE] * width for _ in requests]  # [B, n], built as lists: one tensor each in the end
        positions = [[0] * width for _ in requests]  # [B, n]
        parents = [[NO_PARENT] * width for _ in requests]  # [B, n]
        columns: list[list[list[int]]] = []  # per row and branch, the column of each fed branch token
        for b, (request, fed_trunk, branches) in enumerate(zip(requests, fed_trunks, fed_branches, strict=True)):
            row = self.rows[b]
            if request is idle:
                columns.append([])
                continue
            first = trunk_end_col + 1 - len(fed_trunk)
            tokens[b][first : trunk_end_col + 1] = fed_trunk
            positions[b][first : trunk_end_col + 1] = range(len(row.trunk_ids), len(request.trunk_ids))
            trunk_end = self.length + trunk_end_col if fed_trunk else row.trunk_end
            column, row_columns = trunk_end_col + 1, []
            for branch, full, (matched, node) in zip(branches, request.branch_ids, starts[b], strict=True):
                parent = node if matched else trunk_end
                row_columns.append(list(range(column, column + len(branch))))
                for depth, token in enumerate(branch, start=matched):
                    tokens[b][column], parents[b][column] = token, parent
                    positions[b][column] = len(request.trunk_ids) + depth
                    parent, column = self.length + column, column + 1
                assert len(full) == matched + len(branch)
            columns.append(row_columns)
            row.trunk_ids, row.trunk_end = list(request.trunk_ids), trunk_end
        tables = (
            torch.tensor(table, dtype=torch.long).reshape(len(requests), width)
            for table in (tokens, positions, parents)
        )
        logits = self._forward(*tables, num_logits=num_branch_slots + 1)  # [B, C+1, V]
        self.last_input_lengths = {
            key: prefilled.get(key, 0) + len(t) + sum(map(len, br))
            for key, t, br in zip(self.row_keys, fed_trunks, fed_branches, strict=True)
        }
        offset = trunk_end_col  # column c of the pass is logits[:, c - offset]
        by_key = {
            key: self._row_logits(logits[b], request, [[c - offset for c in cols] for cols in columns[b]])
            for b, (key, request) in enumerate(zip(self.row_keys, requests, strict=True))
            if request is not idle
        }
        return [by_key[key] for key in asked]

    def _prefill_joining(self, asked: dict[Hashable, RowRequest]) -> dict[Hashable, int]:
        """New rows read their sequence (all but its last token) in a pass of their own, on a cache of their own that
        then joins this one, when that saves work: rows already decoding are not padded to a prompt's length, and
        rows with the same prompt read it once. Returns the tokens each joining row read."""
        joining = {
            key: tuple(request.trunk_ids[:-1])
            for key, request in asked.items()
            if key not in self.row_keys and len(request.trunk_ids) > 1
        }
        prompts = list(dict.fromkeys(joining.values()))  # each distinct prompt once
        if not joining or not (any(row.trunk_ids for row in self.rows) or len(prompts) < len(joining)):
            return {}  # a new batch of different prompts reads them in its first pass
        own = TreeCachedModel(self.model)
        own.logits({index: RowRequest(list(prompt), [], "tips") for index, prompt in enumerate(prompts)})
        self._add_rows(list(joining))
        rows = torch.tensor([self.row_keys.index(key) for key in joining], device=self.device)
        sources = [prompts.index(prompt) for prompt in joining.values()]

        def spread(theirs: torch.Tensor, fill: float) -> torch.Tensor:  # [P, ...] per prompt -> [B, ...]
            table = theirs.new_full((len(self.row_keys), *theirs.shape[1:]), fill)  # holes in every other row
            table[rows] = theirs[sources]
            return table

        offset = self.length
        self.tokens = torch.cat([self.tokens, spread(own.tokens, HOLE)], dim=1)
        self.positions = torch.cat([self.positions, spread(own.positions, 0)], dim=1)
        self.parents = torch.cat([self.parents, spread(own.parents, NO_PARENT)], dim=1)  # trunk slots: no parents
        for index, layer in enumerate(own.cache.layers):  # appended along the slots, or the first slots
            self.cache.update(spread(layer.keys, 0.0), spread(layer.values, 0.0), index)
        for key, source in zip(joining, sources, strict=True):
            trunk = own.rows[source]
            self.rows[self.row_keys.index(key)] = _Row(list(trunk.trunk_ids), offset + trunk.trunk_end)
        self.forward_seconds += own.forward_seconds
        return {key: len(prompt) for key, prompt in joining.items()}

    @staticmethod
    def _row_logits(logits: torch.Tensor, request: RowRequest, columns: list[list[int]]) -> torch.Tensor:
        """Arrange one row's logits ([C+1, V], index 0 after the trunk) by branch, as `logits` documents."""
        if request.logits_for == "tips":
            return logits[[cols[-1] for cols in columns] or [0]]  # [W, V]
        depth = max((len(cols) for cols in columns), default=0)
        arranged = logits.new_zeros(max(len(columns), 1), depth + 1, logits.shape[-1])  # [W, K+1, V]
        arranged[:, 0] = logits[0]
        for w, cols in enumerate(columns):
            arranged[w, 1 : len(cols) + 1] = logits[cols]
        return arranged

    def _forward(
        self,
        tokens: torch.Tensor,  # [B, n] HOLE for padding
        positions: torch.Tensor,  # [B, n]
        parents: torch.Tensor,  # [B, n] slot of each token's parent; NO_PARENT for trunk tokens and padding
        num_logits: int,
    ) -> torch.Tensor:  # [B, num_logits, V] for the last num_logits columns
        tokens, positions, parents = tokens.to(self.device), positions.to(self.device), parents.to(self.device)
        self.tokens = torch.cat([self.tokens, tokens], dim=1)
        self.positions = torch.cat([self.positions, positions], dim=1)
        self.parents = torch.cat([self.parents, parents], dim=1)
        masks = self.attention_masks(tokens.shape[1])
        mask = masks if len(masks) > 1 else next(iter(masks.values()))
        started = time.perf_counter()
        output = self.model(
            input_ids=tokens.clamp(min=0),  # padding reads token 0 and is never attended to
            position_ids=positions,
            attention_mask=mask,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=num_logits,
        )
        synchronize(self.device)
        self.last_forward_seconds = time.perf_counter() - started
        self.forward_seconds += self.last_forward_seconds
        return output.logits

    def attention_masks(self, num_new: int) -> dict[str, torch.Tensor]:
        """[B, 1, n, L] per layer kind for the newest n slots: a slot sees earlier trunk slots and its own
        ancestors (itself included), and in sliding layers only those less than the window behind it."""
        length = self.length
        slots = torch.arange(length, device=self.device)  # [L]
        queries = slots[length - num_new :]  # [n]
        is_trunk = (self.tokens != HOLE) & (self.parents == NO_PARENT)  # [B, L]
        visible = is_trunk[:, None, :] & (slots[None, None, :] <= queries[None, :, None])  # [B, n, L]
        # Ancestors by pointer chasing; NO_PARENT points at an extra column, which is dropped.
        parents = torch.cat([self.parents, self.parents.new_full((len(self.rows), 1), NO_PARENT)], dim=1)
        parents = torch.where(parents == NO_PARENT, length, parents)  # [B, L+1]
        ancestors = torch.zeros(len(self.rows), num_new, length + 1, dtype=torch.bool, device=self.device)
        current = queries.expand(len(self.rows), num_new).contiguous()  # [B, n]
        for _ in range(length + 1):  # a parent sits before its child, so every chain ends within L steps
            if not bool((current < length).any()):
                break
            ancestors.scatter_(2, current[..., None], True)
            current = parents.gather(1, current)
        else:
            raise AssertionError("a slot's parents lead back to it: the cache's tree is corrupt")
        visible |= ancestors[..., :length]
        masks = {}
        for kind in self.layer_kinds:
            allowed = visible
            if kind == "sliding_attention":
                behind = self.positions[:, -num_new:, None] - self.positions[:, None, :]  # [B, n, L]
                allowed = visible & (behind < self.sliding_window)
            masks[kind] = self._mask_format(allowed[:, None])
        return masks

    def _mask_format(self, allowed: torch.Tensor) -> torch.Tensor:  # [B, 1, n, L] bool
        if self.model.config._attn_implementation == "sdpa":
            return allowed
        return torch.zeros(allowed.shape, dtype=self.model.dtype, device=self.device).masked_fill_(
            ~allowed, torch.finfo(self.model.dtype).min
        )
