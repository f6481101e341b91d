"""The hybrid drafter: the suffix drafter's copy and the recurrent head's draft, which catch different tokens, as
candidates of one pass. Each round the cost-aware planner keeps the copy, the head's draft, or both, cut to the depth
with the most expected tokens per unit of the target's pass cost. The head runs only when, and only as deep as, a
draft of its could be kept: its chances are known before it drafts, so a round in which it cannot pay costs no head
steps. A copy is a point mass (one-hot q), the head's tokens carry the q they were sampled from: the multi-candidate
rule is exact for such mixed candidates."""

# W = candidates kept, K = num_draft_tokens, V = vocab_size

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace

import torch

from specdemo.core.planning import PassCosts, plan_draft
from specdemo.drafters.base import Draft, DraftRequest
from specdemo.drafters.recurrent import RecurrentDrafter
from specdemo.drafters.suffix import SuffixDrafter

COPY, HEAD = "copy", "head"


@dataclass(frozen=True)
class HybridOptions:
    """None of its own: the suffix drafter's and the head's defaults."""


class HybridDrafter:
    """Proposes, per row, the copy and the head's draft ordered by their first token's chance, and keeps what the
    planner (core.planning.plan_draft) expects the most of per step. `sources` names each candidate's drafter."""

    reads_hidden_state = True

    def __init__(
        self, suffix: SuffixDrafter, head: RecurrentDrafter, costs: Callable[[int], PassCosts], vocab_size: int
    ) -> None:
        self.suffix = suffix
        self.head = head
        self.hidden_layers = head.hidden_layers
        self.costs = costs
        self.vocab_size = vocab_size

    def forget(self, key: Hashable) -> None:
        self.suffix.forget(key)
        self.head.forget(key)

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        copies = self.suffix.propose(requests)
        for request in requests:  # the head's chances this round, as its propose would learn them
            self.head.learn(request)
        widest = max(r.num_candidates * r.num_draft_tokens + 1 for r in requests)
        costs = self.costs(widest)
        depths = [self._head_depth(r, c, costs) for r, c in zip(requests, copies, strict=True)]
        asked = [i for i, depth in enumerate(depths) if depth]
        drafted = self.head.propose(
            [replace(requests[i], num_candidates=max(1, requests[i].num_candidates - 1), num_draft_tokens=depths[i])
             for i in asked]
        ) if asked else []  # fmt: skip
        heads = dict(zip(asked, drafted, strict=True))
        return [
            self._combine(copy, heads.get(i, Draft([], None)), costs, r.num_candidates)
            for i, (copy, r) in enumerate(zip(copies, requests, strict=True))
        ]

    def _head_depth(self, request: DraftRequest, copy: Draft, costs: PassCosts) -> int:
        """How deep the head's draft could be kept this round; 0: not at all, and then the head does not run. The
        planner is asked with stand-ins for the head's candidates: their chances are the row's, known before drafting,
        and their first tokens differ from the copy's, which real drafts can only match (a shared first token counts
        once), never better. So a head the stand-ins do not pay for would not have been kept either."""
        if request.hidden_state is None:
            return 0  # the row's first round: the head has nothing to read yet
        width, depth = max(1, request.num_candidates - 1), request.num_draft_tokens
        stand_ins = self.head.with_chances(request.key, Draft([[-1 - w] * depth for w in range(width)], None))
        kept = self._combine(copy, stand_ins, costs, request.num_candidates)
        return kept.plan.num_tokens if kept.plan is not None and HEAD in (kept.sources or ()) else 0

    def _combine(self, copy: Draft, head: Draft, costs: PassCosts, width: int) -> Draft:
        """At most `width` of the copies and the head's drafts: those the planner expects the most of per step."""
        found = [(COPY, w, c) for w, c in enumerate(copy.token_ids) if c]
        found += [(HEAD, w, c) for w, c in enumerate(head.token_ids) if c]
        if not found:
            return Draft([], None, plan=copy.plan)
        chances = {COPY: copy.chances or [[0.5] * len(c) for c in copy.token_ids], HEAD: head.chances or []}
        firsts = [chances[source][w][0] for source, w, _ in found]
        ranked = sorted(range(len(found)), key=lambda i: -firsts[i])  # stable: the copy first on a tie
        # the best `width` by first chance, or one candidate led by each of the others (W = 1: the copy or the head)
        subsets = [ranked[:width]] + [[i, *(j for j in ranked if j != i)][:width] for i in ranked[1:]]
        planned = [(plan_draft(_estimates(found, chances, order), costs), order) for order in subsets]
        plan, order = max(planned, key=lambda p: p[0].expected_tokens / p[0].expected_steps)  # first on a tie
        estimates = _estimates(found, chances, order)
        kept = order[: plan.num_candidates]
        token_ids = [found[i][2][: plan.num_tokens] for i in kept]
        if plan.num_tokens == 0:
            return Draft([], None, head.forward_seconds, plan=plan)
        probs = None
        if head.probs is not None:  # sampled: the head's q beside the copies' point masses
            depth = max(map(len, token_ids))
            probs = torch.zeros(len(kept), depth, self.vocab_size, device=head.probs.device)
            for row, i in enumerate(kept):
                source, w, _ = found[i]
                if source == HEAD:
                    probs[row, : len(token_ids[row])] = head.probs[w, : len(token_ids[row])]
                else:
                    positions = torch.arange(len(token_ids[row]), device=probs.device)
                    probs[row, positions, torch.tensor(token_ids[row], device=probs.device)] = 1.0
        return Draft(
            token_ids,
            probs,
            head.forward_seconds,
            plan=plan,
            chances=[estimates[r][: plan.num_tokens] for r in range(len(kept))],
            sources=[found[i][0] for i in kept],
        )


def _estimates(
    found: list[tuple[str, int, list[int]]], chances: dict[str, list[list[float]]], order: list[int]
) -> list[list[float]]:
    """[W'][K] each candidate's chances in `order`; candidates sharing a first token share its test, so its chance
    counts once, and the first tokens' chances are scaled to add up to at most 1."""
    estimates = [list(chances[found[i][0]][found[i][1]]) for i in order]
    seen: set[int] = set()
    for estimate, i in zip(estimates, order, strict=True):
        token = found[i][2][0]
        estimate[0] = 0.0 if token in seen else estimate[0]
        seen.add(token)
    total = sum(estimate[0] for estimate in estimates)
    for estimate in estimates:
        estimate[0] /= max(1.0, total)
    return estimates
