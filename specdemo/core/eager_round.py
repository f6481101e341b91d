"""Pure: rounds decided from the target's logits by the eager rule, any number of candidates and any rule: each row's
p with its own settings, its rule's randomness, the rows of each rule padded and decided together, and each row's
verdict read back as plain numbers (core/verdicts.py). Tree passes always decide this way; fixed-shape passes do
for rounds their captured program does not run (models/fixed_shape.py)."""

# B = rows, W = num_candidates, K = num_draft_tokens (a row's longest candidate), V = vocab_size, V' = a greedy row's
# own vocabulary

from __future__ import annotations

import functools

import torch
from transformers import LogitsProcessorList

from specdemo.config import SamplingConfig
from specdemo.core.inspection import PositionView, path_views
from specdemo.core.rounds import CandidateTrace
from specdemo.core.rule_inputs import RuleInputs, pad_rows
from specdemo.core.rules import RuleAsk
from specdemo.core.sampling import build_warpers, greedy_token_ids, logits_to_probs
from specdemo.core.verdicts import Overflowed, RoundAsk, RowVerdict
from specdemo.core.verify import CandidateVerdict, first_nonfinite


@functools.lru_cache(maxsize=256)
def _warpers(sampling: SamplingConfig) -> LogitsProcessorList:
    """A setting's processors, built once: they hold no state between calls."""
    return build_warpers(sampling)


def decide_rows(
    asks: list[RoundAsk],
    target_logits: list[torch.Tensor],  # per row [W, K+1, V]
) -> list[RowVerdict | Overflowed | Exception]:
    """Each row's verdict, or Overflowed where the round read inf or NaN (the rule would draw from nothing), or the
    exception its own settings raised; the other rows are decided as they would be alone."""
    outcomes: dict[int, RowVerdict | Overflowed | Exception] = {}
    inputs: dict[int, RuleInputs] = {}
    compact = all(ask.sampling.is_greedy for ask in asks)  # rows share the rule's vocabulary: V' or all V
    for i, (ask, logits, found) in enumerate(zip(asks, target_logits, nonfinite(asks, target_logits), strict=True)):
        if found != (None, None):
            outcomes[i] = Overflowed(*found)
            continue
        try:
            inputs[i] = rule_inputs(ask, logits, compact)
        except Exception as error:  # this row's settings: it fails alone
            outcomes[i] = error
    for i, (verdict, place) in _verdicts(asks, inputs).items():
        try:
            outcomes[i] = _row_verdict(asks[i], inputs[i], verdict, place)
        except Exception as error:
            outcomes[i] = error
    return [outcomes[i] for i in range(len(asks))]


def nonfinite(
    asks: list[RoundAsk],
    target_logits: list[torch.Tensor],  # per row [W, K+1, V]
) -> list[tuple[int | None, int | None]]:
    """Per row, the first position the round verifies whose raw target logits hold inf or NaN, and the first drafted
    position whose q does (None where none): one copy read back for all rows."""
    found = []
    for ask, logits in zip(asks, target_logits, strict=True):
        device = logits.device
        lengths = torch.tensor([len(c) for c in ask.candidates] or [0], device=device)  # [W]
        scores = [(logits, torch.arange(logits.shape[1], device=device) <= lengths[:, None])]  # [W, K+1, V], [W, K+1]
        if ask.draft_probs is not None and ask.candidates:  # [W, K, V]: q at each drafted token
            probs = ask.draft_probs[: len(ask.candidates)].to(device)
            scores.append((probs, torch.arange(probs.shape[1], device=device) < lengths[:, None]))
        firsts = [first_nonfinite(table, verified).amin() for table, verified in scores]
        firsts = [torch.where(f < table.shape[1], f, -1) for f, (table, _) in zip(firsts, scores, strict=True)]
        found.append(torch.stack([*firsts, *[firsts[0].new_tensor(-1)] * (2 - len(firsts))]))
    return [(t if t >= 0 else None, q if q >= 0 else None) for t, q in torch.stack(found).tolist()]


def _greedy_vocabulary(
    candidates: torch.Tensor,  # [W, K] int64
    target_ids: torch.Tensor,  # [W, K+1] int64 the target's argmax along each candidate
) -> torch.Tensor:  # [V'] int64, sorted
    """The tokens the rule can touch in a greedy row: its drafts and the target's argmaxes. Greedy p is one-hot, so
    p, every residual norm(max(0, p - q)) and every draw live on p's argmax, and the rule on these V' tokens decides
    exactly what it decides on all V, for a fraction of the work (V' <= W(2K+1) against V = 49,152)."""
    return torch.unique(torch.cat([candidates.flatten(), target_ids.flatten()]))


def rule_inputs(
    ask: RoundAsk,
    target_logits: torch.Tensor,  # [W, K+1, V]
    compact: bool,  # the row is greedy and so is every row it is decided with: use its own small vocabulary
) -> RuleInputs:
    """One row's inputs to its rule: p with the row's own settings, its rule's randomness (the standard rule's
    K*W + 1 draws, the coupled rule's noise at the round's K+1 positions), and, when compact, the V' token ids that
    stand for V (the ids, q and p then index and span those)."""
    num_candidates, depth_plus_one, vocab_size = target_logits.shape
    device = target_logits.device
    candidates = torch.tensor(
        [c + [0] * (depth_plus_one - 1 - len(c)) for c in ask.candidates] or [[]], dtype=torch.long, device=device
    ).reshape(num_candidates, depth_plus_one - 1)
    lengths = torch.tensor([len(c) for c in ask.candidates] or [0], device=device)
    contexts = torch.cat([torch.tensor(ask.trunk_ids, device=device).expand(num_candidates, -1), candidates], 1)
    vocab = torch.empty(0, dtype=torch.long, device=device)  # [V'] empty: the whole vocabulary
    if ask.sampling.is_greedy:  # one-hot p without the softmax
        target_ids = greedy_token_ids(target_logits, contexts, ask.sampling)  # [W, K+1]
        if compact:
            vocab = _greedy_vocabulary(candidates, target_ids)
            candidates, target_ids = torch.searchsorted(vocab, candidates), torch.searchsorted(vocab, target_ids)
            vocab_size = len(vocab)
        target_probs = torch.nn.functional.one_hot(target_ids, vocab_size).float()
    else:
        target_probs = logits_to_probs(target_logits, contexts, ask.sampling, _warpers(ask.sampling))  # [W, K+1, V]
    if ask.draft_probs is None:
        draft_probs = torch.nn.functional.one_hot(candidates, vocab_size).float()  # [W, K, V] deterministic
    else:
        draft_probs = ask.draft_probs.to(device)
        draft_probs = draft_probs[..., vocab] if compact else draft_probs
    depth = depth_plus_one - 1
    asked = RuleAsk(ask.seed, ask.draws, len(ask.trunk_ids), ask.round_index, ask.candidates, depth, vocab_size, device)
    uniforms, noise = ask.rule.draws(asked)
    return RuleInputs(candidates, lengths, draft_probs, target_probs, uniforms, vocab, ask.rule, noise)


def _verdicts(asks: list[RoundAsk], inputs: dict[int, RuleInputs]) -> dict[int, tuple[CandidateVerdict, int]]:
    """Each decided row's verdict and its place in it: the rows of each rule padded and decided together."""
    by_rule: dict[object, list[int]] = {}
    for i in inputs:
        by_rule.setdefault(asks[i].rule, []).append(i)
    located: dict[int, tuple[CandidateVerdict, int]] = {}
    for members in by_rule.values():
        verdict = pad_rows([inputs[i] for i in members]).verdict()  # padded to one W, K and V
        located.update((i, (verdict, place)) for place, i in enumerate(members))
    return located


def _trace(verdict: CandidateVerdict, b: int, ask: RoundAsk) -> tuple[CandidateTrace, ...]:
    """Row b's candidates with the numbers of every test, as plain lists."""

    def column(table: torch.Tensor, w: int, length: int) -> list:
        return table[b, w, :length].tolist()

    return tuple(
        CandidateTrace(
            token_ids=tokens,
            target_probs=column(verdict.target_draft_probs, w, len(tokens)),
            draft_probs=column(verdict.draft_draft_probs, w, len(tokens)),
            acceptance_probs=column(verdict.acceptance_probs, w, len(tokens)),
            tested=column(verdict.tested, w, len(tokens)),
            accepted=column(verdict.accepted, w, len(tokens)),
            source=ask.sources[w] if ask.sources else "",
            **ask.rule.traced_draws(column(ask.rule.test_draws(verdict), w, len(tokens))),
        )
        for w, tokens in enumerate(ask.candidates)
    )


def _row_verdict(ask: RoundAsk, inputs: RuleInputs, verdict: CandidateVerdict, b: int) -> RowVerdict:
    """Row b of the verdict as plain numbers, with the inspector's entries where the row reads them."""
    candidates = _trace(verdict, b, ask)
    path, accepted = int(verdict.path[b]), int(verdict.num_accepted[b])
    next_id = int(verdict.next_token_ids[b])
    views, choices = (), ()
    if ask.views:
        shown = next_id if ask.next_follows(path, accepted) else None
        views = _views(ask, inputs, candidates, path, accepted, shown)
        drafted = [list(c.token_ids) for c in candidates]
        made = None if verdict.choices is None else verdict.choices[b].tolist()
        target, draft_probs = inputs.target_probs[path], inputs.draft_probs  # [K+1, V], [W, K, V]
        choices = ask.rule.trace(target, draft_probs, inputs.noise, drafted, path, accepted, made)
    return RowVerdict(
        candidates=candidates,
        path=path,
        num_accepted=accepted,
        next_token_id=next_id,
        next_token_prob=float(verdict.next_token_probs[b]),
        views=views,
        choices=choices,
    )


def _views(
    ask: RoundAsk,
    row_inputs: RuleInputs,  # what the rule decided this row with
    candidates: tuple[CandidateTrace, ...],
    path: int,
    num_accepted: int,
    next_id: int | None,  # the emitted resampled or bonus token (whole vocabulary); None after an accepted EOS
) -> tuple[PositionView, ...]:
    """The inspector's p, q and residual along the accepted path, from the tensors the rule itself decided with."""
    vocab = row_inputs.vocab  # [V'] or empty: the ids, p and q are in the rule's vocabulary (V' or all V)
    tried = [w for w, c in enumerate(candidates) if num_accepted < len(c.tested) and c.tested[num_accepted]]
    tried = tried if ask.rule.next_from_residual else []  # the coupled rule draws the next token from p itself
    next_local = next_id
    if next_id is not None and len(vocab):
        next_local = int(torch.searchsorted(vocab, torch.tensor([next_id], device=vocab.device)))
    drafted = row_inputs.draft_token_ids[path, : len(candidates[path].token_ids) if candidates else 0].tolist()
    compact = vocab if len(vocab) else None
    target_probs, draft_probs = row_inputs.target_probs[path], row_inputs.draft_probs  # [K+1, V], [W, K, V]
    return path_views(target_probs, draft_probs, path, drafted, num_accepted, tried, next_local, compact)
