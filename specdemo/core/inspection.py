"""Pure: what the page's inspector draws for one round, taken from the very distributions the rule decided with: at
each position of the accepted path, the target's p and the drafter's q over their top tokens, and where the next
token was drawn after a rejection, the residual norm(max(0, p - q)) it came from."""

# K = draft tokens of the path, V = the vocabulary the rule ran on (all of it, or a greedy row's V'), W = candidates

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdemo.core.verify import residual_probs

TOP_ENTRIES = 8  # tokens kept per position: the largest by max(p, q), and by the residual; the rest is lumped


@dataclass(frozen=True)
class PositionView:
    """p, q and (after a rejection) the residual at one position, over the tokens that matter most there."""

    token_ids: list[int]  # the top tokens by max(p, q), then the residual's own top ones not among them
    target: list[float]  # p of each
    draft: list[float]  # q of each (all 0 at the bonus position, where nothing was drafted)
    residual: list[float]  # norm(max(0, p - q)) of each where the next token came from it; [] elsewhere
    target_rest: float  # p of every other token, together
    draft_rest: float
    residual_rest: float


def _largest(values: torch.Tensor) -> list[int]:  # [V] -> the TOP_ENTRIES largest positive ones' indices
    """The largest entries, largest first and ties by the smaller id, whatever order the kernel's top-k gives them."""
    top = values.topk(min(TOP_ENTRIES, len(values))).indices
    return sorted(top[values[top] > 0].tolist(), key=lambda i: (-float(values[i]), i))


def _view(
    p: torch.Tensor,  # [V]
    q: torch.Tensor,  # [V]
    residual: torch.Tensor | None,  # [V] normalised, where the next token came from it
    marked: list[int],  # tokens the view must hold: the drafted one, the one drawn
    vocab: torch.Tensor | None,  # [V] the token ids of a compact V
) -> PositionView:
    """The top entries of one position: by max(p, q), then by the residual, and the marked tokens."""
    top = _largest(torch.maximum(p, q))
    if residual is not None:
        top += _largest(residual)
    kept = list(dict.fromkeys([*top, *marked]))  # each once, in that order
    top = torch.tensor(kept, dtype=torch.long, device=p.device)
    ids = vocab[top] if vocab is not None else top

    def rest(probs: torch.Tensor) -> float:
        return max(0.0, float(probs.sum() - probs[top].sum()))

    return PositionView(
        token_ids=ids.tolist(),
        target=p[top].tolist(),
        draft=q[top].tolist(),
        residual=residual[top].tolist() if residual is not None else [],
        target_rest=rest(p),
        draft_rest=rest(q),
        residual_rest=rest(residual) if residual is not None else 0.0,
    )


def path_views(
    target_probs: torch.Tensor,  # [K+1, V] p along the accepted path (the path candidate's row)
    draft_probs: torch.Tensor,  # [W, K, V] q of every candidate
    path: int,
    drafted: list[int],  # the path candidate's tokens, in the rule's vocabulary
    num_accepted: int,
    tried_at_stop: list[int],  # the candidates tested where the path stopped, in the order the rule tried them
    next_token: int | None,  # the resampled or bonus token, in the rule's vocabulary; None after an accepted EOS
    vocab: torch.Tensor | None = None,  # [V] token ids of a compact vocabulary; None: V is the whole vocabulary
) -> tuple[PositionView, ...]:
    """A PositionView per tested position of the path (0 .. num_accepted), the last with the residual the next token
    was drawn from when the path stopped at a rejection: p less each tried candidate's q in turn, renormalised, as the
    rule does (with one candidate, norm(max(0, p - q)))."""
    views = []
    for position in range(min(num_accepted + 1, len(drafted) + 1)):
        p = target_probs[position].double()  # [V] one position at a time: the tensors stay as the rule had them
        drawn = [next_token] if position == num_accepted and next_token is not None else []
        if position == len(drafted):  # the bonus position: p alone
            views.append(_view(p, torch.zeros_like(p), None, drawn, vocab))
            break
        residual = None
        if position == num_accepted:  # the path's draft here was rejected, as was every candidate tried here
            residual = p
            for w in tried_at_stop:
                residual = residual_probs(residual, draft_probs[w, position].double())
                residual = residual / residual.sum()
        q = draft_probs[path, position].double()
        views.append(_view(p, q, residual, [drafted[position], *drawn], vocab))
    return tuple(views)
