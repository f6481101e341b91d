"""Pure: a round's rule for a group's R chain rows in fixed shapes, from the target's logits to one packed tensor, so a
CUDA graph can capture it after the target's pass and the host reads the round back in one copy.

`decide_chains` runs on the device for rows of one candidate: the user's settings (core/fixed_rule.py), the rule of
each row (the standard rule, core/verify.py's verify_chains on counter-based draws, or the coupled rule,
core/coupled.py's verify_coupled on the row's noise, side by side), the inspector's top entries at every position, and
the coupled rule's account of each position (core/match_chance.py's path_choices). `decide_trees` runs rows of up to
W candidates, each candidate a chain row of the group: each row's chains gathered by index, core/verify.py's
verify_tree over them (static loops over W and K) or, for coupled rows, verify_coupled on the row's noise, the
inspector's entries along the accepted path with the residual after the candidates tried where it stopped (p itself
for coupled rows), and the coupled rule's account of each position of the path over the candidates alive there.
`chain_verdict` runs on the host over one row of the packed tensor and gives the row's verdict (core/verdicts.py) as
the eager rule gives it."""

# R = chain rows, n = columns of a pass (K+1), K = n-1 drafted columns, V = vocab_size, E = TOP_ENTRIES,
# M = 2E + 2 entries a position keeps (top by max(p, q), top by residual, the drafted token, the next token),
# W = the most candidates of a row in the round (a program's width)

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np
import torch
from torch.nn.functional import one_hot, pad

from specdemo.core.coupled import alive_along, verify_coupled
from specdemo.core.fixed_rule import (
    RowSettings,
    one_hot_first_max,
    penalised,
    processed_probs,
    round_uniforms,
    seen_along,
)
from specdemo.core.inspection import TOP_ENTRIES, PositionView
from specdemo.core.match_chance import alive_candidates, match_probability
from specdemo.core.rounds import CandidateTrace, CoupledChoice
from specdemo.core.rules import CoupledRule
from specdemo.core.verdicts import Overflowed, RoundAsk, RowVerdict
from specdemo.core.verify import (
    CandidateVerdict,
    first_nonfinite,
    residual_probs,
    select_positions,
    verify_chains,
    verify_tree,
)

ENTRIES = 2 * TOP_ENTRIES + 2  # M
VIEW_COLUMNS = 4 * ENTRIES + 3  # per position: M ids, p, q and residual at each, and the three totals
CHOICE_COLUMNS = 8  # per position: y, log p(y) + G(y), G(y), log p(x) + G(x), G(x), 1 - TV, the match chance's bounds
HEAD_COLUMNS = 5  # accepted, next token, its p, the first column of non-finite target logits and of non-finite q


def packed_columns(num_columns: int, width: int = 1) -> int:
    """Columns of a packed row for passes of n = num_columns and rows of up to `width` candidates: the head and 4K per
    candidate for the rule, n positions of views and n of the coupled rule's choices; with W > 1 then the path and
    2K per candidate (tested, accepted), which one candidate's accepted count implies; last, K per candidate: the
    drafted ids (the host reads a draft still on the device there, core/verdicts.DeviceIds)."""
    tree = 1 + 2 * (num_columns - 1) * width if width > 1 else 0
    ids = (num_columns - 1) * width
    return HEAD_COLUMNS + 4 * (num_columns - 1) * width + num_columns * (VIEW_COLUMNS + CHOICE_COLUMNS) + tree + ids


@dataclass(frozen=True)
class Layout:
    """Where a packed row keeps each part, for K drafted columns and rows of up to W candidates."""

    num_draft: int  # K
    width: int  # W

    @classmethod
    def of(cls, num_packed: int, width: int) -> Layout:
        """The layout of a packed row of `num_packed` columns (packed_columns solved for K)."""
        per_position = VIEW_COLUMNS + CHOICE_COLUMNS
        tree = (1, 2 * width) if width > 1 else (0, 0)
        per_draft = 4 * width + per_position + tree[1] + width
        return cls((num_packed - HEAD_COLUMNS - per_position - tree[0]) // per_draft, width)

    def trace(self, part: int, candidate: int) -> int:
        """The first column of part (p(d), q(d), min(1, p/q), draws; then tested, accepted) of a candidate's trace."""
        if part < 4:
            return HEAD_COLUMNS + (part * self.width + candidate) * self.num_draft
        return self.path + 1 + ((part - 4) * self.width + candidate) * self.num_draft

    @property
    def views(self) -> int:
        return HEAD_COLUMNS + 4 * self.num_draft * self.width

    @property
    def choices(self) -> int:
        return self.views + (self.num_draft + 1) * VIEW_COLUMNS

    @property
    def path(self) -> int:
        return self.choices + (self.num_draft + 1) * CHOICE_COLUMNS

    @property
    def ids(self) -> int:
        """The first column of the drafted ids, K per candidate."""
        return self.path + (1 + 2 * self.num_draft * self.width if self.width > 1 else 0)


@dataclass(frozen=True)
class CoupledRows:
    """The rows of a round under the coupled rule, and the noise of every row at its round's K+1 positions."""

    rows: torch.Tensor  # [R] bool
    noise: torch.Tensor  # [R, n, V] float64 G_t, t = the row's length + column (core/coupled.gumbel_noise)


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
    coupled: CoupledRows | None = None,  # None: every row runs the standard rule
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:  # [R, P] float64 packed, [R, V] seen after, [R] accepted
    """One round's decisions for every row, packed (chain_verdict reads a row back), and what the device keeps: the
    tokens seen after the emitted ones (for the next round's penalty) and the accepted counts (for the hidden
    states)."""
    _, num_columns, vocab_size = logits.shape
    num_draft = num_columns - 1
    depth = torch.arange(num_draft, device=ids.device)  # [K]
    drafted = depth < lengths[:, None]  # [R, K]
    draft_ids = torch.where(drafted, ids[:, 1:], 0)  # [R, K]
    seen_at = None if seen is None else seen_along(seen, ids, torch.cat([real[:, None], drafted], 1))  # [R, n, V]
    target_probs = _target_probs(logits, seen_at, settings, sampled)  # [R, n, V]
    draft_one_hot = one_hot(draft_ids, vocab_size).to(target_probs.dtype)  # [R, K, V]
    if draft_probs is not None:
        draft_one_hot = torch.where(sampled_drafts[:, None, None], draft_probs.to(target_probs.dtype), draft_one_hot)
    draft_one_hot = draft_one_hot * drafted[..., None]  # q = 0 where nothing was drafted: the views' bonus position
    uniforms = round_uniforms(seeds, counters, num_draft)  # [R, n] float64
    chains = (draft_ids[:, None], lengths[:, None], draft_one_hot[:, None], target_probs[:, None])
    verdict = verify_chains(*chains, uniforms)
    if coupled is not None:
        decided = verify_coupled(*chains, coupled.noise)
        assert decided.noise is not None
        verdict = _with_coupled(verdict, replace(decided, uniforms=decided.noise, noise=None), coupled.rows)
    accepted, next_ids = verdict.num_accepted, verdict.next_token_ids  # [R], [R]
    verified = real[:, None] & (torch.arange(num_columns, device=ids.device) <= lengths[:, None])  # [R, n]
    target_nonfinite = first_nonfinite(logits, verified)  # [R] n where none
    draft_nonfinite = first_nonfinite(draft_one_hot, verified[:, 1:])  # [R] K where none (a one-hot q is finite)
    parts = [_rule_columns(verdict, _found(target_nonfinite, num_columns), _found(draft_nonfinite, num_draft))]
    if views:
        drawn = next_ids[:, None].expand(-1, num_columns)  # [R, n]
        marked = torch.stack([torch.cat([draft_ids, draft_ids[:, :1]], 1), drawn], 2)  # [R, n, 2]
        draft = pad(draft_one_hot, (0, 0, 0, 1))  # [R, n, V] nothing drafted at the last column
        residual = residual_probs(target_probs, draft)
        residual = residual / residual.sum(dim=-1, keepdim=True)
        if coupled is not None:  # the coupled rule draws the next token from p itself
            residual = torch.where(coupled.rows[:, None, None], target_probs, residual)
        parts.append(_view_entries(target_probs, draft, residual, marked))
        if coupled is not None and verdict.choices is not None:
            drafted_ids = pad(draft_ids, (0, 1))  # [R, n] x, the one candidate (0 at the bonus column)
            fixed = _fixed_chance(target_probs, drafted_ids[..., None], torch.ones_like(drafted_ids[..., None]).bool())
            made = (coupled.noise, drafted_ids, verdict.choices, fixed, draft_probs is not None)
            parts.append(_choice_entries(target_probs, draft, *made))
    packed = torch.cat(parts, 1)
    packed = pad(packed, (0, Layout(num_draft, 1).ids - packed.shape[1]))  # zeros where nothing is shown
    packed = torch.cat([packed, draft_ids.double()], 1)  # [R, P]
    seen_after = None
    if seen is not None and seen_at is not None:
        emitted = select_positions(seen_at, accepted) | one_hot(next_ids, vocab_size).bool()
        seen_after = torch.where(real[:, None], emitted, seen)
    return packed, seen_after, accepted


@dataclass(frozen=True)
class TreeRows:
    """A round's rows of several candidates, each candidate a chain row of the group: a row is named by its first
    chain row, which lists its candidates' chain rows; every chain row names its row's first (whose seen row holds the
    row's sequence)."""

    chains: torch.Tensor  # [R, W] int64 the chain row of candidate w of the row first at r (any row past its width)
    widths: torch.Tensor  # [R] int64 the row's candidates (1 when nothing was drafted); 0 where no row is first
    heads: torch.Tensor  # [R] int64 the first chain row of the chain row's row


def decide_trees(
    logits: torch.Tensor,  # [R, n, V] the pass's logits: column j after the sequence and j tokens of the chain's draft
    ids: torch.Tensor,  # [R, n] int64: the sequence's last token, then the chain's drafted ones
    lengths: torch.Tensor,  # [R] int64 drafted tokens per chain row
    real: torch.Tensor,  # [R] bool: the chain rows that are a row's first, decided this round
    settings: RowSettings,  # each chain row's: its row's
    seeds: torch.Tensor,  # [R] int64 each row's draw stream (read at its first chain row)
    counters: torch.Tensor,  # [R] int64 draws each row used before this round
    seen: torch.Tensor | None,  # [R, V] bool the tokens each row's sequence holds, at its first chain row
    draft_probs: torch.Tensor | None,  # [R, K, V] q of chains whose row sampled its draft
    sampled_drafts: torch.Tensor,  # [R] bool: the chain's q is in draft_probs, else one-hot at its draft
    sampled: bool,  # some row samples
    views: bool,  # some row shows the inspector's entries
    trees: TreeRows,
    coupled: CoupledRows | None = None,  # None: every row runs the standard rule; else read at each row's first
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """decide_chains for rows of up to W candidates: each row's chains gathered into [R, W, n, V] p and
    [R, W, K, V] q, core/verify.py's verify_tree on the row's draws (test j of candidate w takes draw j * W_row + w of
    its round, as the eager rule's) and, for coupled rows, core/coupled.py's verify_coupled on the row's noise, packed
    at the row's first chain row (Layout). Returns the packed rows, the seen rows after the emitted tokens, the chain
    row where each row's next logits were read (its path's) and the accepted counts."""
    _, num_columns, vocab_size = logits.shape
    num_rows, width = trees.chains.shape
    num_draft = num_columns - 1
    drafted = torch.arange(num_draft, device=ids.device) < lengths[:, None]  # [R, K] per chain
    draft_ids = torch.where(drafted, ids[:, 1:], 0)  # [R, K]
    counted = torch.cat([torch.zeros_like(drafted[:, :1]), drafted], 1)  # [R, n] column 0 is in the seen row already
    seen_at = None if seen is None else seen_along(seen.index_select(0, trees.heads), ids, counted)  # [R, n, V]
    target_probs = _target_probs(logits, seen_at, settings, sampled)  # [R, n, V] each chain's p
    draft_one_hot = one_hot(draft_ids, vocab_size).to(target_probs.dtype)  # [R, K, V]
    if draft_probs is not None:
        draft_one_hot = torch.where(sampled_drafts[:, None, None], draft_probs.to(target_probs.dtype), draft_one_hot)
    draft_one_hot = draft_one_hot * drafted[..., None]
    candidate = torch.arange(width, device=ids.device) < trees.widths[:, None]  # [R, W]
    flat = trees.chains.flatten()  # [R*W]
    tree_ids = draft_ids.index_select(0, flat).view(num_rows, width, num_draft)
    tree_lengths = torch.where(candidate, lengths.index_select(0, flat).view(num_rows, width), 0)  # [R, W]
    tree_q = draft_one_hot.index_select(0, flat).view(num_rows, width, num_draft, vocab_size)
    tree_p = target_probs.index_select(0, flat).view(num_rows, width, num_columns, vocab_size)
    uniforms = _tree_uniforms(seeds, counters, trees.widths, num_draft, width)  # [R, K*W + 1]
    verdict = verify_tree(tree_ids, tree_lengths, tree_q, tree_p, uniforms)
    if coupled is not None:
        decided = verify_coupled(tree_ids, tree_lengths, tree_q, tree_p, coupled.noise)
        assert decided.noise is not None
        verdict = _with_coupled(verdict, replace(decided, uniforms=decided.noise, noise=None), coupled.rows)
    accepted, next_ids, path = verdict.num_accepted, verdict.next_token_ids, verdict.path  # [R] each
    live = candidate & real[:, None]  # [R, W]
    verified = torch.arange(num_columns, device=ids.device) <= lengths[:, None]  # [R, n] per chain
    firsts = [(first_nonfinite(logits, verified), num_columns), (first_nonfinite(draft_one_hot, drafted), num_draft)]
    found = [torch.where(live, first.index_select(0, flat).view(num_rows, width), count) for first, count in firsts]
    nonfinite = [_found(first.amin(dim=1), count) for first, (_, count) in zip(found, firsts, strict=True)]
    unshown = torch.zeros(
        num_rows, num_columns * (VIEW_COLUMNS + CHOICE_COLUMNS), dtype=torch.float64, device=ids.device
    )
    parts = [_rule_columns(verdict, *nonfinite), unshown]
    if views:
        rows = torch.arange(num_rows, device=ids.device)
        path_p, path_ids = tree_p[rows, path], tree_ids[rows, path]  # [R, n, V], [R, K]
        marked = torch.stack([torch.cat([path_ids, path_ids[:, :1]], 1), next_ids[:, None].expand(-1, num_columns)], 2)
        tried = torch.cat([verdict.tested, torch.zeros_like(verdict.tested[..., :1])], 2)  # [R, W, n]
        if coupled is not None:  # the coupled rule draws the next token from p itself
            tried = tried & ~coupled.rows[:, None, None]
        residual = _tree_residual(path_p, pad(tree_q, (0, 0, 0, 1)), tried)
        shown = [_view_entries(path_p, pad(tree_q[rows, path], (0, 0, 0, 1)), residual, marked)]
        if coupled is not None and verdict.choices is not None:
            tree = (tree_ids, tree_lengths, tree_q, path_p)
            shown.append(_tree_choices(*tree, verdict, coupled.noise, draft_probs is not None))
        shown_columns = torch.cat(shown, 1)
        parts[1] = pad(shown_columns, (0, unshown.shape[1] - shown_columns.shape[1]))  # zeros where none are shown
    parts += [path[:, None].double(), *(table.double().flatten(1) for table in (verdict.tested, verdict.accepted))]
    packed = torch.cat([*parts, tree_ids.double().flatten(1)], 1)  # [R, P]
    path_chain = trees.chains.gather(1, path[:, None])[:, 0]  # [R]
    seen_after = None
    if seen is not None and seen_at is not None:
        emitted = select_positions(seen_at.index_select(0, path_chain), accepted) | one_hot(next_ids, vocab_size).bool()
        seen_after = torch.where(real[:, None], emitted, seen)
    return packed, seen_after, path_chain, accepted


def _tree_choices(
    draft_ids: torch.Tensor,  # [R, W, K] int64 each candidate's tokens
    draft_lengths: torch.Tensor,  # [R, W] int64
    draft_probs: torch.Tensor,  # [R, W, K, V] each candidate's q
    target_probs: torch.Tensor,  # [R, n, V] p along the path
    verdict: CandidateVerdict,  # the rows' verdicts, the coupled rows' picked
    noise: torch.Tensor,  # [R, n, V] float64 G
    sampled_drafts: bool,  # some row's q is a sampling drafter's (a coupled row of one candidate)
) -> torch.Tensor:  # [R, n * CHOICE_COLUMNS] float64
    """_choice_entries along each row's path: x is the first candidate alive at each position (the path's, where it
    ended a longer one on it) and F the distinct tokens of the candidates alive there (match_chance.path_choices)."""
    num_rows, _, num_draft = draft_ids.shape
    path, accepted = verdict.path, verdict.num_accepted  # [R] each
    assert verdict.choices is not None
    alive = alive_along(draft_ids, draft_lengths, path, accepted)  # [R, W, K]
    rows = torch.arange(num_rows, device=draft_ids.device)
    first = torch.where(alive[rows, path], path[:, None], alive.long().argmax(dim=1))  # [R, K]
    depth = torch.arange(num_draft, device=draft_ids.device)
    x_ids, x_q = draft_ids[rows[:, None], first, depth], draft_probs[rows[:, None], first, depth]  # [R, K], [R, K, V]
    same = (draft_ids[:, :, None] == draft_ids[:, None]) & alive[:, None]  # [R, W, W', K] w' alive with w's token
    earlier = torch.ones_like(same[0, :, :, 0]).tril(-1)[None, ..., None]  # [1, W, W', 1] w' before w
    counted = alive & ~(same & earlier).any(dim=2)  # [R, W, K] each alive token once
    tokens, once = (pad(table.transpose(1, 2), (0, 0, 0, 1)) for table in (draft_ids, counted))  # [R, n, W] each
    fixed = _fixed_chance(target_probs, tokens, once)
    made = (noise, pad(x_ids, (0, 1)), verdict.choices, fixed, sampled_drafts)
    return _choice_entries(target_probs, pad(x_q, (0, 0, 0, 1)), *made)


def _tree_uniforms(
    seeds: torch.Tensor,  # [R] int64
    counters: torch.Tensor,  # [R] int64
    widths: torch.Tensor,  # [R] int64 each row's own W
    num_draft: int,  # K
    width: int,  # W of the program
) -> torch.Tensor:  # [R, K*W + 1] float64: test (j, w) at j*W + w, the next token's draw last
    """Each row's round draws laid out for verify_tree at the program's W: test j of candidate w takes draw
    j * W_row + w of the row's block (core/fixed_rule.round_uniforms), 0 past the row's candidates."""
    drawn = round_uniforms(seeds, counters, num_draft * width)  # [R, K*W + 1]
    depth = torch.arange(num_draft, device=seeds.device)[None, :, None]  # [1, K, 1]
    candidate = torch.arange(width, device=seeds.device)[None, None, :]  # [1, 1, W]
    index = (depth * widths[:, None, None] + candidate).flatten(1)  # [R, K*W]
    inside = (candidate < widths[:, None, None]).expand(-1, num_draft, -1).flatten(1)  # [R, K*W]
    tests = torch.where(inside, drawn.gather(1, index.clamp(max=num_draft * width - 1)), 0.0)
    return torch.cat([tests, drawn[:, -1:]], 1)


def _tree_residual(
    target_probs: torch.Tensor,  # [R, n, V] p along the path
    draft_probs: torch.Tensor,  # [R, W, n, V] each candidate's q (0 where it drafted nothing)
    tried: torch.Tensor,  # [R, W, n] bool: candidate w was tested at depth j
) -> torch.Tensor:  # [R, n, V] float64
    """At each position, p less each candidate tried there in turn, renormalised (inspection.path_views'
    tried_at_stop), in float64 as the views compute it; p where none was tried."""
    residual = target_probs.double()
    for w in range(draft_probs.shape[1]):
        step = residual_probs(residual, draft_probs[:, w].double())
        residual = torch.where(tried[:, w, :, None], step / step.sum(dim=-1, keepdim=True), residual)
    return residual


def _found(first: torch.Tensor, count: int) -> torch.Tensor:  # [R] int64 -> [R] int64
    """first_nonfinite's column, -1 where none (first == count)."""
    return torch.where(first < count, first, -1)


def _rule_columns(
    verdict: CandidateVerdict,  # [R, W, K] tables
    target_nonfinite: torch.Tensor,  # [R] int64 the first column of non-finite target logits, -1 where none
    draft_nonfinite: torch.Tensor,  # [R] int64 the first column of non-finite q, -1 where none
) -> torch.Tensor:  # [R, HEAD_COLUMNS + 4WK] float64
    """The head (accepted count, next token, its p, the first column of non-finite logits and of non-finite q) and the
    trace's four parts, each [W, K] (Layout.trace)."""
    head = [verdict.num_accepted, verdict.next_token_ids, verdict.next_token_probs, target_nonfinite, draft_nonfinite]
    trace = [verdict.target_draft_probs, verdict.draft_draft_probs, verdict.acceptance_probs, verdict.uniforms]
    return torch.cat([torch.stack([column.double() for column in head], 1), *(t.double().flatten(1) for t in trace)], 1)


def _with_coupled(standard: CandidateVerdict, coupled: CandidateVerdict, rows: torch.Tensor) -> CandidateVerdict:
    """The standard rule's verdict with the coupled rule's in the coupled rows (rows [R] bool), and its choices; the
    trace's draw column holds each row's test draws (the uniforms, or the coupled rule's noise G(d))."""

    def pick(name: str) -> torch.Tensor:
        own = getattr(coupled, name)
        return torch.where(rows.view(-1, *[1] * (own.dim() - 1)), own, getattr(standard, name))

    own = [field.name for field in fields(CandidateVerdict) if field.name not in ("choices", "noise")]
    picked = {name: pick(name) for name in own}
    return CandidateVerdict(**picked, choices=coupled.choices)


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
    target_probs: torch.Tensor,  # [R, n, V] p along the row's path
    draft_probs: torch.Tensor,  # [R, n, V] q of the path's tokens (0 where nothing was drafted)
    residual: torch.Tensor,  # [R, n, V] normalised: what the next token is drawn from after a rejection there
    marked: torch.Tensor,  # [R, n, 2] int64 the drafted token at each position, and the next token
) -> torch.Tensor:  # [R, n * VIEW_COLUMNS] float64
    """The inspector's entries at every position: the top tokens by max(p, q) and by the residual, the marked ones, p,
    q and the residual at each, and the three totals (inspection.path_views on the host)."""
    num_rows, num_columns, _ = target_probs.shape
    ids = torch.cat(
        [
            torch.maximum(target_probs, draft_probs).topk(TOP_ENTRIES, dim=-1).indices,
            residual.topk(TOP_ENTRIES, dim=-1).indices,
            marked,
        ],
        2,
    )  # [R, n, M]
    tables = (target_probs, draft_probs, residual)
    values = [table.gather(2, ids).double() for table in tables]  # 3 x [R, n, M]
    totals = torch.stack([table.double().sum(dim=-1) for table in tables], 2)  # [R, n, 3]
    return torch.cat([ids.double(), *values, totals], 2).reshape(num_rows, num_columns * VIEW_COLUMNS)


def _fixed_chance(
    target_probs: torch.Tensor,  # [R, n, V] p along the path
    tokens: torch.Tensor,  # [R, n, A] int64 the tokens of the candidates alive at each position
    counted: torch.Tensor,  # [R, n, A] bool: alive, and its token not an earlier alive candidate's
) -> torch.Tensor:  # [R, n] float64
    """p(F), p normalised, F the fixed tokens alive at each position: the chance that y is one of them
    (match_chance.node_chances for one-hot q)."""
    p = target_probs.double()
    return (p.gather(2, tokens) * counted).sum(-1) / p.sum(-1)


def _choice_entries(
    target_probs: torch.Tensor,  # [R, n, V] p along the path
    draft_probs: torch.Tensor,  # [R, n, V] q of x, the first candidate alive at each position (0 where none)
    noise: torch.Tensor,  # [R, n, V] float64 G
    draft_ids: torch.Tensor,  # [R, n] int64 x (0 where none)
    choices: torch.Tensor,  # [R, n] int64 y = argmax(log p + G)
    fixed: torch.Tensor,  # [R, n] float64 p(F) of the fixed tokens alive (_fixed_chance)
    sampled_drafts: bool,  # some row's q is a sampling drafter's (else every q is one-hot)
) -> torch.Tensor:  # [R, n * CHOICE_COLUMNS] float64
    """match_chance.path_choices at every position of the path: y and x with their log p + G and G, 1 - TV(p, q of
    x), and the chance that y is one of the candidates alive there: p(F) for fixed tokens, match_probability's bounds
    for a lone sampled candidate (a row of one). Where nothing is alive (the bonus) only y is read back."""
    num_rows, num_columns, _ = target_probs.shape
    p = target_probs.double()  # [R, n, V]
    q = draft_probs.double()  # [R, n, V]

    def scored(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [R, n, 1] -> 2 x [R, n]
        value = noise.gather(2, tokens)[..., 0]
        return p.gather(2, tokens)[..., 0].log() + value, value

    target_norm, draft_norm = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)  # q: NaN where none drafted
    overlap = torch.minimum(target_norm, draft_norm).sum(-1)  # [R, n] 1 - TV
    low = high = fixed
    if sampled_drafts:
        lone = (q > 0).sum(-1) != 1  # [R, n] q is not one-hot: match_probability
        bounds = match_probability(target_probs, q)
        low, high = (torch.where(lone, bound, fixed) for bound in bounds)
    columns = [choices.double(), *scored(choices[..., None]), *scored(draft_ids[..., None]), overlap, low, high]
    return torch.stack(columns, 2).reshape(num_rows, num_columns * CHOICE_COLUMNS)


def chain_verdict(
    packed: np.ndarray,  # [P] float64: one row
    ask: RoundAsk,
    width: int = 1,  # W of the program that packed it (decide_trees' where > 1)
) -> RowVerdict | Overflowed:
    """The row's verdict from its packed round, as core/eager_round.decide_rows gives it for the same logits: every
    candidate's trace, the path, the next token, and where the row reads them the inspector's views and the coupled
    rule's choices; Overflowed where the round read inf or NaN."""
    target_column, draft_column = (int(column) if column >= 0 else None for column in packed[3:5])
    if (target_column, draft_column) != (None, None):
        return Overflowed(target_column, draft_column)
    layout = Layout.of(packed.shape[0], width)
    accepted, next_id = int(packed[0]), int(packed[1])
    path = int(packed[layout.path]) if width > 1 else 0
    tokens = ask.candidates[path] if ask.candidates else []
    views, choices = (), ()
    if ask.views:
        views = read_views(packed, layout, tokens, accepted, next_id if ask.next_follows(path, accepted) else None)
        if isinstance(ask.rule, CoupledRule):
            choices = read_choices(packed, layout, ask.candidates, path, accepted)
    return RowVerdict(
        candidates=tuple(_trace(packed, layout, ask, accepted)),
        path=path,
        num_accepted=accepted,
        next_token_id=next_id,
        next_token_prob=float(packed[2]),
        views=views,
        choices=choices,
    )


def drafted_ids(
    packed: np.ndarray,  # [P] float64: one row
    width: int,  # W of the program that packed it
    lengths: list[int],  # each candidate's
) -> list[list[int]]:
    """The row's candidates' ids as the round read them (a draft still on the device: core/verdicts.DeviceIds)."""
    layout = Layout.of(packed.shape[0], width)
    first = layout.ids
    return [packed[first + w * layout.num_draft :][:k].astype(np.int64).tolist() for w, k in enumerate(lengths)]


def _trace(packed: np.ndarray, layout: Layout, ask: RoundAsk, num_accepted: int) -> list[CandidateTrace]:
    """The row's candidates with the numbers of their tests, as verify_chains, verify_coupled and verify_tree give
    them; one candidate is tested through the first rejection and accepted before it."""
    traces = []
    for w, tokens in enumerate(ask.candidates):
        length = len(tokens)
        column = [packed[layout.trace(part, w) :][:length].tolist() for part in range(6 if layout.width > 1 else 4)]
        if layout.width > 1:
            tested, accepted = ([value > 0 for value in part] for part in column[4:])
        else:
            tested, accepted = [j <= num_accepted for j in range(length)], [j < num_accepted for j in range(length)]
        traces.append(
            CandidateTrace(
                token_ids=tokens,
                target_probs=column[0],
                draft_probs=column[1],
                acceptance_probs=column[2],
                **ask.rule.traced_draws(column[3]),
                tested=tested,
                accepted=accepted,
                source=ask.sources[w] if ask.sources else "",
            )
        )
    return traces


def read_choices(
    packed: np.ndarray,  # [P] float64: one row
    layout: Layout,
    candidates: list[list[int]],  # the row's candidates
    path: int,
    num_accepted: int,
) -> tuple[CoupledChoice, ...]:
    """match_chance.path_choices from the packed entries: a choice per position of the path, with x the first
    candidate alive there and how many are; y alone where none is (the bonus)."""
    shown = []
    for position, alive in enumerate(alive_candidates(candidates, path, num_accepted)):
        start = layout.choices + position * CHOICE_COLUMNS
        y, y_score, y_noise, x_score, x_noise, overlap, low, high = packed[start : start + CHOICE_COLUMNS].tolist()
        target = (int(y), y_score, y_noise)
        if not alive:
            shown.append(CoupledChoice(*target, None, None, None, None, None, None))
            continue
        x = candidates[alive[0]][position]
        shown.append(CoupledChoice(*target, x, x_score, x_noise, overlap, low, high, num_alive=len(alive)))
    return tuple(shown)


def read_views(
    packed: np.ndarray,  # [P] float64: one row
    layout: Layout,
    drafted: list[int],  # the path's drafted tokens
    num_accepted: int,
    next_token: int | None,  # None after an accepted EOS
) -> tuple[PositionView, ...]:
    """inspection.path_views from the packed entries: a view per tested position, the residual where the row stopped at
    a rejection."""
    views = []
    for position in range(min(num_accepted + 1, len(drafted) + 1)):
        block = packed[layout.views + position * VIEW_COLUMNS : layout.views + (position + 1) * VIEW_COLUMNS]
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
    largest = [max(t, d) for t, d in zip(target, draft, strict=True)]
    top = _largest_first(ids, largest, range(TOP_ENTRIES))
    if rejected:
        top += _largest_first(ids, residual, range(TOP_ENTRIES, 2 * TOP_ENTRIES))
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


def _largest_first(ids: list[int], values: list[float], entries: range) -> list[int]:
    """The entries' tokens with a positive value, the largest first and equal values by the smaller id: an order that
    does not depend on how a kernel's top-k breaks ties."""
    kept = sorted((i for i in entries if values[i] > 0), key=lambda i: (-values[i], ids[i]))
    return [ids[i] for i in kept]
