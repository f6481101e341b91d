"""The tree cache's bookkeeping, without a model: every row's slots stay canonical (its trunk, then its tree) through
random joins, branches, accepted drafts and departures; what each fed token may see is exactly its own prefix; the
moves and writes a pass names rebuild the slots' contents; and a row's slots, writes and visibility are the same
whatever other rows share the passes."""

from __future__ import annotations

import random

import pytest

from specdemo.models.layout import HOLE, TRUNK, WIDTH_STEP, RowRequest, TreeLayout


class SlotContents:
    """What a cache would hold: the token in every slot of every row, kept by applying each plan's row moves, slot
    moves and writes, as models/tree_cache.py applies them to keys and values."""

    def __init__(self) -> None:
        self.rows: list[dict[int, int]] = []

    def apply(self, row_moves: list[tuple[int, int]], remaining: int, plan) -> None:
        for source, target in row_moves:
            self.rows[target] = dict(self.rows[source])
        self.rows = self.rows[:remaining] + [{} for _ in range(len(plan.keys) - remaining)]  # rows that joined
        read = [dict(row) for row in self.rows]  # every move reads before any writes
        for row, source, target in plan.moves:
            self.rows[row][target] = read[row].get(source, HOLE)
        for b, (tokens, slots) in enumerate(zip(plan.tokens, plan.write_slots, strict=True)):
            for token, slot in zip(tokens, slots, strict=True):
                if slot >= 0:
                    self.rows[b][slot] = token


def random_requests(rng: random.Random, rows: dict[int, list[int]], step: int) -> dict[int, RowRequest]:
    keys = [key for key in rows if rng.random() < 0.8] or list(rows)
    return {
        key: RowRequest(
            rows[key],
            [[rng.randrange(2, 9) for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(0, 3))],
            rng.choice(["all", "tips"]),
        )
        for key in keys
    }


def grow(rng: random.Random, rows: dict[int, list[int]], asked: dict[int, RowRequest]) -> None:
    """As after a round: an "all" row accepts part of a branch and one token more; a "tips" row often keeps drafting
    along the same branches (its next request extends them), and sometimes grows through one."""
    for key, request in asked.items():
        branch = rng.choice(request.branch_ids) if request.branch_ids else []
        if request.logits_for == "all" or rng.random() < 0.3:
            rows[key] = rows[key] + branch[: rng.randint(0, len(branch))] + [rng.randrange(2, 9)]


def check_visibility(layout: TreeLayout, plan, asked: dict[int, RowRequest]) -> None:
    """Each fed token sees exactly the tokens of its own prefix, each once, in position order."""
    masks = plan.masks(window=None)[:, 0]  # [B, n, W]
    for b, key in enumerate(plan.keys):
        row, tokens = layout.rows[b], row_tokens(layout, b)
        for column, token in enumerate(plan.tokens[b]):
            if token == HOLE:
                continue
            seen = [slot for slot in range(plan.width) if masks[b, column, slot]]
            slot = plan.write_slots[b][column]
            assert slot in seen and max(seen) == slot, (key, column, seen, slot)
            positions = [row.positions()[s] for s in seen]
            assert positions == list(range(len(seen))), (key, column, positions)  # one token per position
            context = [tokens[s] for s in seen]  # the trunk, then the token's branch up to itself
            trunk = asked[key].trunk_ids
            assert context[: len(trunk)] == trunk[: len(context)], (key, column)
            if slot >= len(row.trunk_ids):
                branch = context[len(trunk) :]
                assert any(b[: len(branch)] == branch for b in asked[key].branch_ids), (key, column, branch)


def row_tokens(layout: TreeLayout, b: int) -> list[int]:
    row = layout.rows[b]
    return row.trunk_ids + [node.token for node in row.tree]


@pytest.mark.parametrize("seed", range(6))
def test_random_trees_stay_canonical_and_each_token_sees_its_prefix(seed):
    rng, layout, contents = random.Random(seed), TreeLayout(), SlotContents()
    rows = {key: [rng.randrange(2, 9) for _ in range(rng.randint(1, 9))] for key in range(3)}
    for step in range(60):
        if step in (10, 30):
            rows[100 + step] = [rng.randrange(2, 9) for _ in range(rng.randint(1, 12))]
        if step in (20, 45) and len(rows) > 1:
            leaving = rng.choice(list(rows))
            rows.pop(leaving)
            layout.drop(leaving)
        asked = random_requests(rng, rows, step)
        row_moves = layout.remove_leaving()
        remaining = len(layout.keys)
        plan = layout.plan(asked, min_rows=rng.choice([1, 2, 4]))
        contents.apply(row_moves, remaining, plan)
        assert plan.width % WIDTH_STEP == 0 and plan.width >= layout.widest
        for b, key in enumerate(layout.keys):
            row = layout.rows[b]
            held = [contents.rows[b].get(slot, HOLE) for slot in range(row.length)]
            assert held == row_tokens(layout, b), (step, key)  # the moves and writes rebuilt the canonical slots
            for index, node in enumerate(row.tree):  # a tree node hangs from the trunk or an earlier tree slot
                assert node.parent == TRUNK or len(row.trunk_ids) <= node.parent < len(row.trunk_ids) + index
        for key, request in asked.items():
            row = layout.rows[layout.keys.index(key)]
            assert row.trunk_ids == request.trunk_ids, (step, key)
        check_visibility(layout, plan, asked)
        grow(rng, rows, asked)


def test_a_rows_slots_writes_and_visibility_do_not_depend_on_the_other_rows():
    """The same requests of row 0, alone and beside two rows that join, branch and leave at random: the same slots,
    the same tokens written to the same slots, the same visible slots per token, and the same logit columns
    relative to the trunk end. Batch-invariant passes (models/attention.py) rely on it."""
    rng, alone, shared = random.Random(7), TreeLayout(), TreeLayout()
    sequence, others = [3, 4, 5], {1: [6, 7], 2: [8, 2, 3, 4, 5, 6, 7]}
    for step in range(40):
        branches = [[rng.randrange(2, 9) for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(0, 2))]
        mine = RowRequest(sequence, branches, rng.choice(["all", "tips"]))
        alone.remove_leaving()
        shared.remove_leaving()
        plans = [
            alone.plan({0: mine}),
            shared.plan({**random_requests(rng, others, step), 0: mine}),
        ]
        views = []
        for layout, plan in zip((alone, shared), plans, strict=True):
            b = layout.keys.index(0)
            masks = plan.masks()[b, 0]
            fed = [c for c, token in enumerate(plan.tokens[b]) if token != HOLE]
            views.append(
                (
                    layout.rows[b],
                    [(plan.tokens[b][c], plan.write_slots[b][c], masks[c].nonzero().flatten().tolist()) for c in fed],
                    [[c - plan.trunk_end_column for c in branch] for branch in plan.logit_columns[0]],
                )
            )
        assert views[0] == views[1], step
        if step == 25:
            shared.drop(1)
            others.pop(1)
        grow(rng, others, {k: RowRequest(v, [], "all") for k, v in others.items()})
        mine_rows = {0: sequence}
        grow(rng, mine_rows, {0: mine})
        sequence = mine_rows[0]


def test_a_pass_has_at_least_min_rows_and_keeps_enough_logits():
    layout = TreeLayout()
    plan = layout.plan({0: RowRequest([5, 6, 7], [], "all")}, min_rows=1)
    assert len(plan.tokens[0]) == 3 and plan.num_logits == 1
    plan = layout.plan({0: RowRequest([5, 6, 7, 8], [], "all")}, min_rows=4)  # one token fed, three padding columns
    assert len(plan.tokens[0]) == 4 and plan.num_logits == 4 and plan.tokens[0][:3] == [HOLE] * 3


def test_padding_columns_see_one_slot_and_write_to_the_scratch_slot():
    layout = TreeLayout()
    layout.plan({0: RowRequest([5, 6], [], "all"), 1: RowRequest([7, 8, 9, 4], [], "all")})
    plan = layout.plan({0: RowRequest([5, 6, 3], [[2, 2, 2]], "all")})  # row 1 sits the pass out
    masks = plan.masks()[:, 0]
    assert all(slot == -1 for slot in plan.write_slots[1])
    assert masks[1].sum(dim=-1).tolist() == [1] * len(plan.tokens[1])  # never a query with no key (no NaN)
