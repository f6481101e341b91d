"""Pure: a round's rule for R one-candidate rows in fixed shapes, from the target's logits to one packed tensor, so a
CUDA graph can capture it after the target's pass and the host reads the round back in one copy.

`decide_chains` runs on the device: the user's settings (core/fixed_rule.py), the rule (core/verify.py's
verify_chains, the engine's rule itself) on counter-based draws, and the inspector's top entries at every position.
`read_chain` runs on the host over one row of the packed tensor and gives plain numbers and lists."""

# R = chain rows, n = columns of a pass (K+1), K = n-1 drafted columns, V = vocab_size, E = TOP_ENTRIES,
# M = 2E + 2 entries a position keeps (top by max(p, q), top by residual, the drafted token, the next token)

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdemo.core.fixed_rule import (
    RowSettings,
    one_hot_first_max,
    penalised,
    processed_probs,
    round_uniforms,
    seen_along,
)
from specdemo.core.inspection import TOP_ENTRIES, PositionView
from specdemo.core.verify import first_nonfinite, residual_probs, select_positions, verify_chains

ENTRIES = 2 * TOP_ENTRIES + 2  # M
VIEW_COLUMNS = 4 * ENTRIES + 3  # per position: M ids, p, q and residual at each, and the three totals
HEAD_COLUMNS = 5  # accepted, next token, its p, the first column of non-finite target logits and of non-finite q


def packed_columns(num_columns: int) -> int:
    """Columns of a packed row for passes of n = num_columns: the head and 4K for the rule, n positions of views."""
    return HEAD_COLUMNS + 4 * (num_columns - 1) + num_columns * VIEW_COLUMNS


def decide_chains(
    logits: torch.Tensor,  # [R, n, V] the pass's logits: column j after the sequence and j drafted tokens
    ids: torch.Tensor,  # [R, n] int64: the sequence's last token, then the drafted ones (anything past a row's length)
    lengths: torch.Tensor,  # [R] int64 drafted tokens per row
    real: torch.Tensor,  # [R] bool: rows decided this round (the others' state is left as it was)
    settings: RowSettings,
    seeds: torch.Tensor,  # [R] int64 each row's draw stream
    counters: torch.Tensor,  # [R] int64 draws each row used before this round
    seen: torch.Tensor | None,  # [R, V] bool the tokens each row's sequence holds; None: no row has a penalty
    draft_probs: torch.Tensor | None,  # [R, K, V] q of rows that sampled their draft; None: every draft deterministic
    sampled_drafts: torch.Tensor,  # [R] bool: the row's q is in draft_probs, else one-hot at its draft
    sampled: bool,  # some row samples: the user's settings run in full; else greedy argmaxes alone
    views: bool = True,  # some row shows the inspector's entries; else zeros in their columns
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:  # [R, P] float64 packed, [R, V] seen after, [R] accepted
    """One round's decisions for every row, packed (read_chain reads a row back), and what the device keeps: the tokens
    seen after the emitted ones (for the next round's penalty) and the accepted counts (for the hidden states)."""
    _, num_columns, vocab_size = logits.shape
    num_draft = num_columns - 1
    depth = torch.arange(num_draft, device=ids.device)  # [K]
    drafted = depth < lengths[:, None]  # [R, K]
    draft_ids = torch.where(drafted, ids[:, 1:], 0)  # [R, K]
    seen_at = None if seen is None else seen_along(seen, ids, torch.cat([real[:, None], drafted], 1))  # [R, n, V]
    target_probs = _target_probs(logits, seen_at, settings, sampled)  # [R, n, V]
    draft_one_hot = torch.nn.functional.one_hot(draft_ids, vocab_size).to(target_probs.dtype)  # [R, K, V]
    if draft_probs is not None:
        draft_one_hot = torch.where(sampled_drafts[:, None, None], draft_probs.to(target_probs.dtype), draft_one_hot)
    draft_one_hot = draft_one_hot * drafted[..., None]  # q = 0 where nothing was drafted: the views' bonus position
    uniforms = round_uniforms(seeds, counters, num_draft)  # [R, n] float64
    verdict = verify_chains(
        draft_ids[:, None], lengths[:, None], draft_one_hot[:, None], target_probs[:, None], uniforms
    )
    accepted, next_ids = verdict.num_accepted, verdict.next_token_ids  # [R], [R]
    verified = real[:, None] & (torch.arange(num_columns, device=ids.device) <= lengths[:, None])  # [R, n]
    target_nonfinite = first_nonfinite(logits, verified)  # [R] n where none
    draft_nonfinite = first_nonfinite(draft_one_hot, verified[:, 1:])  # [R] K where none (a one-hot q is finite)
    target_nonfinite = torch.where(target_nonfinite < num_columns, target_nonfinite, -1)  # -1: none
    draft_nonfinite = torch.where(draft_nonfinite < num_draft, draft_nonfinite, -1)
    head = [accepted, next_ids, verdict.next_token_probs, target_nonfinite, draft_nonfinite]
    rule = torch.cat(
        [
            torch.stack([column.double() for column in head], 1),
            verdict.target_draft_probs[:, 0],
            verdict.draft_draft_probs[:, 0],
            verdict.acceptance_probs[:, 0],
            verdict.uniforms[:, 0],
        ],
        1,
    )  # [R, HEAD_COLUMNS + 4K]
    if views:
        drawn = next_ids[:, None].expand(-1, num_columns)  # [R, n]
        marked = torch.stack([torch.cat([draft_ids, draft_ids[:, :1]], 1), drawn], 2)  # [R, n, 2]
        packed = torch.cat([rule, _view_entries(target_probs, draft_one_hot, marked)], 1)  # [R, P]
    else:
        packed = torch.nn.functional.pad(rule, (0, num_columns * VIEW_COLUMNS))  # [R, P]
    seen_after = None
    if seen is not None and seen_at is not None:
        emitted = select_positions(seen_at, accepted) | torch.nn.functional.one_hot(next_ids, vocab_size).bool()
        seen_after = torch.where(real[:, None], emitted, seen)
    return packed, seen_after, accepted


def _target_probs(
    logits: torch.Tensor,  # [R, n, V]
    seen_at: torch.Tensor | None,  # [R, n, V] bool
    settings: RowSettings,
    sampled: bool,
) -> torch.Tensor:  # [R, n, V] float32
    """p with each row's settings; when no row samples, the one-hot argmaxes without the sampling's sorts."""
    if sampled:
        return processed_probs(logits, seen_at, settings)
    return one_hot_first_max(penalised(logits, seen_at, settings.penalty))


def _view_entries(
    target_probs: torch.Tensor,  # [R, n, V]
    draft_probs: torch.Tensor,  # [R, K, V]
    marked: torch.Tensor,  # [R, n, 2] int64 the drafted token at each position, and the next token
) -> torch.Tensor:  # [R, n * VIEW_COLUMNS] float64
    """The inspector's entries at every position: the top tokens by max(p, q) and by the residual norm(max(0, p - q)),
    the marked ones, p, q and the residual at each, and the three totals (inspection.path_views on the host)."""
    num_rows, num_columns, _ = target_probs.shape
    draft = torch.nn.functional.pad(draft_probs, (0, 0, 0, 1))  # [R, n, V] nothing drafted at the last column
    residual = residual_probs(target_probs, draft)
    residual = residual / residual.sum(dim=-1, keepdim=True)
    ids = torch.cat(
        [
            torch.maximum(target_probs, draft).topk(TOP_ENTRIES, dim=-1).indices,
            residual.topk(TOP_ENTRIES, dim=-1).indices,
            marked,
        ],
        2,
    )  # [R, n, M]
    values = [table.gather(2, ids).double() for table in (target_probs, draft, residual)]  # 3 x [R, n, M]
    totals = torch.stack([table.double().sum(dim=-1) for table in (target_probs, draft, residual)], 2)  # [R, n, 3]
    return torch.cat([ids.double(), *values, totals], 2).reshape(num_rows, num_columns * VIEW_COLUMNS)


@dataclass(frozen=True)
class ChainOutcome:
    """One row's round as the host reads it from the packed tensor."""

    num_accepted: int
    next_token_id: int
    next_token_prob: float
    target_nonfinite: int | None  # the first column the round read a non-finite raw logit of the target at
    draft_nonfinite: int | None  # the first drafted column whose q held inf or NaN
    target_probs: list[float]  # [length] the trace's columns, as verify_chains gives them
    draft_probs: list[float]
    acceptance_probs: list[float]
    uniforms: list[float]


def read_chain(packed: np.ndarray, length: int) -> ChainOutcome:  # packed [P] float64: one row
    """The rule's decisions for a row that drafted `length` tokens."""
    num_draft = _num_draft(packed.shape[0])

    def column(index: int) -> list[float]:
        start = HEAD_COLUMNS + index * num_draft
        return packed[start : start + length].tolist()

    def found(position: float) -> int | None:
        return int(position) if position >= 0 else None

    return ChainOutcome(
        int(packed[0]),
        int(packed[1]),
        float(packed[2]),
        found(packed[3]),
        found(packed[4]),
        column(0),
        column(1),
        column(2),
        column(3),
    )


def _num_draft(num_packed: int) -> int:
    """K from a packed row's width: HEAD_COLUMNS + 4K + (K+1) * VIEW_COLUMNS."""
    return (num_packed - HEAD_COLUMNS - VIEW_COLUMNS) // (4 + VIEW_COLUMNS)


def read_views(
    packed: np.ndarray,  # [P] float64: one row
    drafted: list[int],  # the row's drafted tokens
    num_accepted: int,
    next_token: int | None,  # None after an accepted EOS
) -> tuple[PositionView, ...]:
    """inspection.path_views from the packed entries: a view per tested position, the residual where the row stopped at
    a rejection."""
    num_draft = _num_draft(packed.shape[0])
    start = HEAD_COLUMNS + 4 * num_draft
    views = []
    for position in range(min(num_accepted + 1, len(drafted) + 1)):
        block = packed[start + position * VIEW_COLUMNS : start + (position + 1) * VIEW_COLUMNS]
        bonus = position == len(drafted)
        rejected = position == num_accepted and not bonus
        drawn = [next_token] if position == num_accepted and next_token is not None else []
        views.append(_position_view(block, [] if bonus else [drafted[position]], drawn, bonus, rejected))
    return tuple(views)


def _position_view(
    block: np.ndarray, drafted: list[int], drawn: list[int], bonus: bool, rejected: bool
) -> PositionView:
    """One position's view from its packed entries, kept as inspection._view keeps them."""
    ids = block[:ENTRIES].astype(np.int64).tolist()
    target, draft, residual = (block[(i + 1) * ENTRIES : (i + 2) * ENTRIES].tolist() for i in range(3))
    totals = block[4 * ENTRIES :].tolist()
    if bonus:
        draft = [0.0] * ENTRIES
    found = {token: i for i, token in reversed(list(enumerate(ids)))}  # each id's first entry
    top = [t for i, t in enumerate(ids[:TOP_ENTRIES]) if max(target[i], draft[i]) > 0]
    if rejected:
        top += [t for i, t in enumerate(ids[TOP_ENTRIES : 2 * TOP_ENTRIES], TOP_ENTRIES) if residual[i] > 0]
    kept = list(dict.fromkeys([*top, *drafted, *drawn]))
    kept = [token for token in kept if token in found]
    pick = [found[token] for token in kept]

    def rest(values: list[float], total: float) -> float:
        return max(0.0, total - sum(values[i] for i in pick))

    return PositionView(
        token_ids=kept,
        target=[target[i] for i in pick],
        draft=[draft[i] for i in pick],
        residual=[residual[i] for i in pick] if rejected else [],
        target_rest=rest(target, totals[0]),
        draft_rest=0.0 if bonus else rest(draft, totals[1]),
        residual_rest=rest(residual, totals[2]) if rejected else 0.0,
    )
