"""Pure: a round's rule for R one-candidate rows in fixed shapes, from the target's logits to one packed tensor, so a
CUDA graph can capture it after the target's pass and the host reads the round back in one copy.

`decide_chains` runs on the device: the user's settings (core/fixed_rule.py), the rule of each row (the standard rule,
core/verify.py's verify_chains on counter-based draws, or the coupled rule, core/coupled.py's verify_coupled on the
row's noise, side by side), the inspector's top entries at every position, and the coupled rule's account of each
position (core/match_chance.py's path_choices). `chain_verdict` runs on the host over one row of the packed tensor and
gives the row's verdict (core/verdicts.py) as the eager rule gives it."""

# R = chain rows, n = columns of a pass (K+1), K = n-1 drafted columns, V = vocab_size, E = TOP_ENTRIES,
# M = 2E + 2 entries a position keeps (top by max(p, q), top by residual, the drafted token, the next token)

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np
import torch
from torch.nn.functional import one_hot, pad

from specdemo.core.coupled import verify_coupled
from specdemo.core.fixed_rule import (
    RowSettings,
    one_hot_first_max,
    penalised,
    processed_probs,
    round_uniforms,
    seen_along,
)
from specdemo.core.inspection import TOP_ENTRIES, PositionView
from specdemo.core.match_chance import match_probability
from specdemo.core.rounds import CandidateTrace, CoupledChoice
from specdemo.core.rules import CoupledRule
from specdemo.core.verdicts import Overflowed, RoundAsk, RowVerdict
from specdemo.core.verify import CandidateVerdict, first_nonfinite, residual_probs, select_positions, verify_chains

ENTRIES = 2 * TOP_ENTRIES + 2  # M
VIEW_COLUMNS = 4 * ENTRIES + 3  # per position: M ids, p, q and residual at each, and the three totals
CHOICE_COLUMNS = 8  # per position: y, log p(y) + G(y), G(y), log p(x) + G(x), G(x), 1 - TV, the match chance's bounds
HEAD_COLUMNS = 5  # accepted, next token, its p, the first column of non-finite target logits and of non-finite q


def packed_columns(num_columns: int) -> int:
    """Columns of a packed row for passes of n = num_columns: the head and 4K for the rule, n positions of views and n
    of the coupled rule's choices."""
    return HEAD_COLUMNS + 4 * (num_columns - 1) + num_columns * (VIEW_COLUMNS + CHOICE_COLUMNS)


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
    rule = _rule_columns(verdict, logits, draft_one_hot, verified)  # [R, HEAD_COLUMNS + 4K]
    parts = [rule]
    if views:
        drawn = next_ids[:, None].expand(-1, num_columns)  # [R, n]
        marked = torch.stack([torch.cat([draft_ids, draft_ids[:, :1]], 1), drawn], 2)  # [R, n, 2]
        from_target = None if coupled is None else coupled.rows  # the coupled rule draws the next token from p
        parts.append(_view_entries(target_probs, draft_one_hot, marked, from_target))
        if coupled is not None and verdict.choices is not None:
            made = (coupled.noise, draft_ids, verdict.choices, draft_probs is not None)
            parts.append(_choice_entries(target_probs, draft_one_hot, *made))
    packed = torch.cat(parts, 1)
    packed = pad(packed, (0, packed_columns(num_columns) - packed.shape[1]))  # [R, P] zeros where nothing is shown
    seen_after = None
    if seen is not None and seen_at is not None:
        emitted = select_positions(seen_at, accepted) | one_hot(next_ids, vocab_size).bool()
        seen_after = torch.where(real[:, None], emitted, seen)
    return packed, seen_after, accepted


def _rule_columns(
    verdict: CandidateVerdict,  # W = 1
    logits: torch.Tensor,  # [R, n, V] raw
    draft_probs: torch.Tensor,  # [R, K, V] q
    verified: torch.Tensor,  # [R, n] bool: the columns the round verifies
) -> torch.Tensor:  # [R, HEAD_COLUMNS + 4K] float64
    """The head (accepted count, next token, its p, the first column of non-finite logits and of non-finite q, -1 where
    none) and the trace's four columns."""
    num_columns = logits.shape[1]
    target_nonfinite = first_nonfinite(logits, verified)  # [R] n where none
    draft_nonfinite = first_nonfinite(draft_probs, verified[:, 1:])  # [R] K where none (a one-hot q is finite)
    target_nonfinite = torch.where(target_nonfinite < num_columns, target_nonfinite, -1)  # -1: none
    draft_nonfinite = torch.where(draft_nonfinite < num_columns - 1, draft_nonfinite, -1)
    head = [verdict.num_accepted, verdict.next_token_ids, verdict.next_token_probs, target_nonfinite, draft_nonfinite]
    trace = [verdict.target_draft_probs, verdict.draft_draft_probs, verdict.acceptance_probs, verdict.uniforms]
    return torch.cat([torch.stack([column.double() for column in head], 1), *(table[:, 0] for table in trace)], 1)


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
    target_probs: torch.Tensor,  # [R, n, V]
    draft_probs: torch.Tensor,  # [R, K, V]
    marked: torch.Tensor,  # [R, n, 2] int64 the drafted token at each position, and the next token
    from_target: torch.Tensor | None,  # [R] bool rows whose next token is drawn from p itself (the coupled rule)
) -> torch.Tensor:  # [R, n * VIEW_COLUMNS] float64
    """The inspector's entries at every position: the top tokens by max(p, q) and by what the next token is drawn from
    after a rejection (the residual norm(max(0, p - q)), or p for the coupled rule), the marked ones, p, q and that
    residual at each, and the three totals (inspection.path_views on the host)."""
    num_rows, num_columns, _ = target_probs.shape
    draft = pad(draft_probs, (0, 0, 0, 1))  # [R, n, V] nothing drafted at the last column
    residual = residual_probs(target_probs, draft)
    residual = residual / residual.sum(dim=-1, keepdim=True)
    if from_target is not None:
        residual = torch.where(from_target[:, None, None], target_probs, residual)
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


def _choice_entries(
    target_probs: torch.Tensor,  # [R, n, V] p
    draft_probs: torch.Tensor,  # [R, K, V] q (0 past a row's draft)
    noise: torch.Tensor,  # [R, n, V] float64 G
    draft_ids: torch.Tensor,  # [R, K] int64 x
    choices: torch.Tensor,  # [R, n] int64 y = argmax(log p + G)
    sampled_drafts: bool,  # some row's q is a sampling drafter's (else every q is one-hot)
) -> torch.Tensor:  # [R, n * CHOICE_COLUMNS] float64
    """match_chance.path_choices at every drafted position, W = 1: y and x with their log p + G and G, 1 - TV(p, q),
    and the chance that x is y: p(x) for a one-hot q (a fixed token), else match_probability's bounds. The last
    column holds y alone (the bonus position: nothing drafted there)."""
    num_rows, num_columns, _ = target_probs.shape
    p = target_probs.double()  # [R, n, V]
    q = pad(draft_probs, (0, 0, 0, 1)).double()  # [R, n, V] nothing drafted at the last column
    drafted = pad(draft_ids, (0, 1))[..., None]  # [R, n, 1]

    def scored(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [R, n, 1] -> 2 x [R, n]
        value = noise.gather(2, tokens)[..., 0]
        return p.gather(2, tokens)[..., 0].log() + value, value

    target_norm, draft_norm = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)  # q: NaN where none drafted
    overlap = torch.minimum(target_norm, draft_norm).sum(-1)  # [R, n] 1 - TV
    fixed = target_norm.gather(2, drafted)[..., 0]  # [R, n] y in {x}
    low = high = fixed
    if sampled_drafts:
        lone = (q > 0).sum(-1) != 1  # [R, n] q is not one-hot: match_probability
        bounds = match_probability(target_probs, q)
        low, high = (torch.where(lone, bound, fixed) for bound in bounds)
    columns = [choices.double(), *scored(choices[..., None]), *scored(drafted), overlap, low, high]  # 8 x [R, n]
    return torch.stack(columns, 2).reshape(num_rows, num_columns * CHOICE_COLUMNS)


def chain_verdict(packed: np.ndarray, ask: RoundAsk) -> RowVerdict | Overflowed:  # packed [P] float64: one row
    """The row's verdict from its packed round, as core/eager_round.decide_rows gives it for the same logits: its
    candidate's trace, the next token, and where the row reads them the inspector's views and the coupled rule's
    choices; Overflowed where the round read inf or NaN."""
    target_column, draft_column = (int(column) if column >= 0 else None for column in packed[3:5])
    if (target_column, draft_column) != (None, None):
        return Overflowed(target_column, draft_column)
    accepted, next_id = int(packed[0]), int(packed[1])
    tokens = ask.candidates[0] if ask.candidates else []
    views, choices = (), ()
    if ask.views:
        views = read_views(packed, tokens, accepted, next_id if ask.next_follows(0, accepted) else None)
        if isinstance(ask.rule, CoupledRule):
            choices = read_choices(packed, tokens, accepted)
    return RowVerdict(
        candidates=tuple(_trace(packed, ask, accepted)),
        path=0,
        num_accepted=accepted,
        next_token_id=next_id,
        next_token_prob=float(packed[2]),
        views=views,
        choices=choices,
    )


def _trace(packed: np.ndarray, ask: RoundAsk, num_accepted: int) -> list[CandidateTrace]:
    """The row's candidate (none, or one) with the numbers of its tests, as verify_chains and verify_coupled give
    them: tested through the first rejection, accepted before it."""
    num_draft = _num_draft(packed.shape[0])
    traces = []
    for tokens in ask.candidates:
        length = len(tokens)
        column = [packed[HEAD_COLUMNS + i * num_draft :][:length].tolist() for i in range(4)]
        traces.append(
            CandidateTrace(
                token_ids=tokens,
                target_probs=column[0],
                draft_probs=column[1],
                acceptance_probs=column[2],
                **ask.rule.traced_draws(column[3]),
                tested=[j <= num_accepted for j in range(length)],
                accepted=[j < num_accepted for j in range(length)],
                source=ask.sources[0] if ask.sources else "",
            )
        )
    return traces


def _num_draft(num_packed: int) -> int:
    """K from a packed row's width: HEAD_COLUMNS + 4K + (K+1) * (VIEW_COLUMNS + CHOICE_COLUMNS)."""
    per_position = VIEW_COLUMNS + CHOICE_COLUMNS
    return (num_packed - HEAD_COLUMNS - per_position) // (4 + per_position)


def read_choices(
    packed: np.ndarray,  # [P] float64: one row
    drafted: list[int],  # the row's drafted tokens
    num_accepted: int,
) -> tuple[CoupledChoice, ...]:
    """match_chance.path_choices from the packed entries: a choice per tested position, y alone at the bonus."""
    num_draft = _num_draft(packed.shape[0])
    start = HEAD_COLUMNS + 4 * num_draft + (num_draft + 1) * VIEW_COLUMNS
    shown = []
    for position in range(min(num_accepted + 1, len(drafted) + 1)):
        y, y_score, y_noise, x_score, x_noise, overlap, low, high = packed[start + position * CHOICE_COLUMNS :][
            :CHOICE_COLUMNS
        ].tolist()
        target = (int(y), y_score, y_noise)
        if position == len(drafted):
            shown.append(CoupledChoice(*target, None, None, None, None, None, None))
        else:
            shown.append(CoupledChoice(*target, drafted[position], x_score, x_noise, overlap, low, high, num_alive=1))
    return tuple(shown)


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
