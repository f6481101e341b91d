"""Pure bookkeeping of the tree KV cache: which slots each row's tokens occupy, what a pass feeds and where it writes
their keys and values, which slots each fed token may see, and where each requested logit comes from. It holds no
model tensor, so every rule here is tested without a model (tests/models/test_layout.py).

Each row's slots are canonical: its trunk (the sequence so far) at slots 0..T-1, then the draft tokens it keeps as a
tree, in the order they were fed. That is the layout the row would have alone, whatever the other rows hold, so a row's
keys are the same keys at the same slots in any batch (models/attention.py makes the arithmetic agree as well)."""

# B = rows, n = columns fed in one pass, C = branch columns of the widest row, S = key slots attended

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Literal

import torch

HOLE = -1  # the token of a padding column, which no one attends to
TRUNK = -1  # the parent of a tree node that hangs from the trunk's last token
WIDTH_STEP = 64  # keys are attended in widths of this many slots: a softmax over fewer than 16 takes a scalar path,
# so a short row alone would sum its keys otherwise than beside a long one (models/attention.py)


@dataclass(frozen=True)
class RowRequest:
    """What one row asks of a pass: logits after its trunk and along its branches."""

    trunk_ids: list[int]  # the whole sequence so far: prompt and emitted tokens
    branch_ids: list[list[int]]  # W draft chains hanging from the trunk's last token; may be empty
    logits_for: Literal["all", "tips"]  # all: the trunk's end and every branch token (verification);
    # tips: each branch's last token, or the trunk's end when there is no branch (one drafting step)
    capacity: int = 0  # the most tokens the row's sequence and branches will hold (prompt + max_new_tokens); 0: not
    # known. Fixed-shape passes size the row's slots by it once (models/fixed_shape.py); tree passes grow as they go


@dataclass(frozen=True)
class Node:
    """A tree slot: a draft token kept after the trunk."""

    token: int
    parent: int  # the slot of its parent node, or TRUNK
    depth: int  # 0 for a child of the trunk's last token: its position is then the trunk's length


@dataclass
class RowSlots:
    """One row: its trunk at slots 0..T-1 and its tree at slots T.. in order."""

    trunk_ids: list[int] = field(default_factory=list)
    tree: list[Node] = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.trunk_ids) + len(self.tree)

    def positions(self) -> list[int]:
        """The sequence position of every slot: its index in the trunk, or the trunk's length plus its depth."""
        trunk = len(self.trunk_ids)
        return list(range(trunk)) + [trunk + node.depth for node in self.tree]

    def ancestors(self, slot: int) -> list[int]:
        """A tree slot and the tree slots above it, up to the trunk."""
        found = []
        while slot != TRUNK:
            found.append(slot)
            slot = self.tree[slot - len(self.trunk_ids)].parent
        return found


@dataclass(frozen=True)
class PassPlan:
    """One forward pass over every row: its input columns, where their keys and values go, what each may see, and which
    columns hold the logits each asked row wants. Columns: each row's fed trunk ends at `trunk_end_column`, its branch
    tokens follow it, and padding fills the rest."""

    keys: list[Hashable]  # the rows, in the cache's row order
    tokens: list[list[int]]  # [B][n] HOLE for padding
    positions: list[list[int]]  # [B][n]
    write_slots: list[list[int]]  # [B][n] each column's slot; -1 (the scratch slot) for padding
    visible_below: list[list[int]]  # [B][n] a column sees every slot below this (its trunk, itself if trunk)...
    tree_visible: list[tuple[int, int, int]]  # ...and these (row, column, slot): its tree ancestors and itself
    key_positions: list[list[int]]  # [B][S] the position of each slot's token (0 past the row's length)
    width: int  # S, a multiple of WIDTH_STEP
    trunk_end_column: int  # the column after whose token the trunk-end logits come
    num_logits: int  # logits kept for the last columns (C + 1, or more so the head's GEMM has min_rows rows)
    logit_columns: dict[Hashable, list[list[int]]]  # per asked row and branch, the columns whose logits it gets
    moves: list[tuple[int, int, int]]  # (row, from slot, to slot): keys and values to copy before the pass
    fed: dict[Hashable, int]  # tokens each asked row feeds

    def masks(self, window: int | None = None, device: torch.device | str = "cpu") -> torch.Tensor:  # [B, 1, n, S] bool
        """Which slot each column may attend to: its trunk and tree ancestors, and with a sliding `window` only those
        less than the window behind it; made on `device`."""
        slots = torch.arange(self.width, device=device)  # [S]
        visible = slots[None, None, :] < torch.tensor(self.visible_below, device=device)[:, :, None]  # [B, n, S]
        if self.tree_visible:
            row, column, slot = torch.tensor(self.tree_visible, device=device).T
            visible[row, column, slot] = True
        if window is not None:
            positions = torch.tensor(self.positions, device=device)  # [B, n]
            behind = positions[:, :, None] - torch.tensor(self.key_positions, device=device)[:, None, :]
            visible &= behind < window
        return visible[:, None]


class TreeLayout:
    """Every row's slots, kept canonical through joins, branches, accepted drafts and departures."""

    def __init__(self) -> None:
        self.keys: list[Hashable] = []
        self.rows: list[RowSlots] = []
        self.leaving: set[Hashable] = set()

    def drop(self, key: Hashable) -> None:
        """The row leaves before the next pass."""
        if key in self.keys:
            self.leaving.add(key)

    def remove_leaving(self) -> list[tuple[int, int]]:
        """Remove the rows that left: the last rows take their places. Returns (from row, to row) per row moved, in
        order; the rows past the new count are gone."""
        moved = []
        for index in sorted((self.keys.index(key) for key in self.leaving), reverse=True):
            last = len(self.keys) - 1
            if index != last:
                moved.append((last, index))
                self.keys[index], self.rows[index] = self.keys[last], self.rows[last]
            self.keys.pop()
            self.rows.pop()
        self.leaving.clear()
        return moved

    def add(self, key: Hashable, trunk_ids: list[int]) -> int:
        """A row joins, holding `trunk_ids` (those it read in a pass of its own, or none); returns its row index."""
        assert key not in self.keys, f"row {key!r} is already here"
        self.keys.append(key)
        self.rows.append(RowSlots(list(trunk_ids)))
        return len(self.keys) - 1

    @property
    def widest(self) -> int:
        return max((row.length for row in self.rows), default=0)

    def plan(self, asked: dict[Hashable, RowRequest], min_rows: int = 1) -> PassPlan:
        """Match every asked row to its slots (keep what its request still uses, compacted), then lay out one pass of
        at least `min_rows` rows times columns (models/attention.py: fewer take another GEMM path). The rows are
        updated to what they hold after the pass."""
        for key in asked:
            if key not in self.keys:
                self.add(key, [])
        moves: list[tuple[int, int, int]] = []
        matched = {key: self._match(self.keys.index(key), asked[key], moves) for key in asked}
        fed = {key: _fed(request, self.rows[self.keys.index(key)], matched[key]) for key, request in asked.items()}
        num_branch = max((sum(map(len, branches)) for _, branches in fed.values()), default=0)  # C
        columns = max(1, *(len(trunk) for trunk, _ in fed.values())) + num_branch
        columns = max(columns, math.ceil(min_rows / len(self.keys)))  # n
        end = columns - num_branch - 1  # the trunk-end column
        builder = _PassBuilder(len(self.keys), columns)
        logit_columns = {}
        for key, request in asked.items():
            b = self.keys.index(key)
            logit_columns[key] = builder.lay_out(b, self.rows[b], request, fed[key], matched[key], end)
        width = WIDTH_STEP * max(1, math.ceil(self.widest / WIDTH_STEP))
        return PassPlan(
            keys=list(self.keys),
            tokens=builder.tokens,
            positions=builder.positions,
            write_slots=builder.write_slots,
            visible_below=builder.visible_below,
            tree_visible=builder.tree_visible,
            key_positions=[(row.positions() + [0] * width)[:width] for row in self.rows],
            width=width,
            trunk_end_column=end,
            num_logits=min(columns, max(num_branch + 1, math.ceil(min_rows / len(self.keys)))),
            logit_columns=logit_columns,
            moves=moves,
            fed={key: len(trunk) + sum(map(len, branches)) for key, (trunk, branches) in fed.items()},
        )

    def _match(self, b: int, request: RowRequest, moves: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
        """Keep the tree slots the request still uses (the trunk grew through them, or a branch runs along them),
        drop the rest, and compact: the kept slots move down to follow the trunk, recorded in `moves`. Returns, per
        branch, (its tokens already held, the slot the next one hangs from)."""
        row, trunk = self.rows[b], request.trunk_ids
        assert trunk[: len(row.trunk_ids)] == row.trunk_ids, "a row's sequence may only grow"
        needs_trunk_logits = request.logits_for == "all" or not request.branch_ids
        old_trunk = len(row.trunk_ids)
        children: dict[int, dict[int, int]] = {}
        for index, node in enumerate(row.tree):
            children.setdefault(node.parent, {}).setdefault(node.token, old_trunk + index)
        if needs_trunk_logits and len(row.trunk_ids) == len(trunk):  # asked again: the last token is fed again
            row.trunk_ids.pop()
            children = {}  # the tree hung from that token, whose slot is given up
        grown, node = [], TRUNK  # tree slots the trunk grows through, in order
        for token in trunk[len(row.trunk_ids) : len(trunk) - needs_trunk_logits]:
            slot = children.get(node, {}).get(token)
            if slot is None:
                break
            grown.append(slot)
            node = slot
        kept: list[int] = []  # tree slots kept as tree
        starts = [(0, TRUNK)] * len(request.branch_ids)
        trunk_end = grown[-1] if grown else TRUNK
        if request.logits_for == "tips" and len(row.trunk_ids) + len(grown) == len(trunk):
            for w, branch in enumerate(request.branch_ids):  # a branch runs along held slots up to its tip
                node, held = trunk_end, 0
                while held < len(branch) - 1 and (slot := children.get(node, {}).get(branch[held])) is not None:
                    kept.append(slot)
                    node, held = slot, held + 1
                starts[w] = (held, node)
        return self._compact(b, grown, sorted(set(kept)), starts, moves)

    def _compact(
        self, b: int, grown: list[int], kept: list[int], starts: list[tuple[int, int]], moves: list
    ) -> list[tuple[int, int]]:
        """The row becomes its trunk, the slots it grew through, then the kept tree slots, each moved down in order
        (a parent always sits before its child, so the order keeps every parent first)."""
        row = self.rows[b]
        old_tree, old_trunk = row.tree, len(row.trunk_ids)
        for slot in grown:
            row.trunk_ids.append(old_tree[slot - old_trunk].token)
            if slot != len(row.trunk_ids) - 1:
                moves.append((b, slot, len(row.trunk_ids) - 1))
        new_slot = {TRUNK: TRUNK, (grown[-1] if grown else TRUNK): TRUNK}  # the new trunk end is what hangs on TRUNK
        row.tree = []
        for slot in kept:
            node = old_tree[slot - old_trunk]
            new_slot[slot] = len(row.trunk_ids) + len(row.tree)
            row.tree.append(Node(node.token, new_slot[node.parent], node.depth - len(grown)))
            if slot != new_slot[slot]:
                moves.append((b, slot, new_slot[slot]))
        return [(held, new_slot[slot]) for held, slot in starts]


def _fed(request: RowRequest, row: RowSlots, starts: list[tuple[int, int]]) -> tuple[list[int], list[list[int]]]:
    """What a matched row feeds: the trunk tokens it does not hold, and each branch past what it holds."""
    assert not (row.tree and len(request.trunk_ids) > len(row.trunk_ids)), "a row feeds its trunk without a tree"
    branches = [branch[held:] for branch, (held, _) in zip(request.branch_ids, starts, strict=True)]
    return request.trunk_ids[len(row.trunk_ids) :], branches


class _PassBuilder:
    """The pass's tables, filled row by row (every column starts as padding)."""

    def __init__(self, num_rows: int, num_columns: int) -> None:
        self.tokens = [[HOLE] * num_columns for _ in range(num_rows)]
        self.positions = [[0] * num_columns for _ in range(num_rows)]
        self.write_slots = [[-1] * num_columns for _ in range(num_rows)]
        self.visible_below = [[1] * num_columns for _ in range(num_rows)]  # padding sees slot 0: never no key
        self.tree_visible: list[tuple[int, int, int]] = []

    def lay_out(
        self,
        b: int,
        row: RowSlots,
        request: RowRequest,
        fed: tuple[list[int], list[list[int]]],
        starts: list[tuple[int, int]],
        end: int,
    ) -> list[list[int]]:
        """Place row b's fed tokens, grow the row by them, and return the columns of the logits it asked for."""
        trunk, branches = fed
        for offset, token in enumerate(trunk):
            column, slot = end + 1 - len(trunk) + offset, row.length
            row.trunk_ids.append(token)
            self._place(b, column, token, slot, slot, slot + 1)
        column, trunk_length, paths = end + 1, len(row.trunk_ids), []
        for branch, (_, parent) in zip(branches, starts, strict=True):
            path = []
            depth = row.tree[parent - trunk_length].depth + 1 if parent != TRUNK else 0
            for token in branch:
                slot = row.length
                row.tree.append(Node(token, parent, depth))
                self._place(b, column, token, slot, trunk_length + depth, trunk_length)
                self.tree_visible += [(b, column, ancestor) for ancestor in row.ancestors(slot)]
                path.append(column)
                parent, depth, column = slot, depth + 1, column + 1
            paths.append(path)
        if request.logits_for == "tips":
            return [[path[-1]] for path in paths] or [[end]]
        return [[end, *path] for path in paths] or [[end]]

    def _place(self, b: int, column: int, token: int, slot: int, position: int, visible_below: int) -> None:
        self.tokens[b][column], self.positions[b][column] = token, position
        self.write_slots[b][column], self.visible_below[b][column] = slot, visible_below
