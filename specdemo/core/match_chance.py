"""Pure: the coupled rule's theory beside its measurement (core/coupled.py has the rule). At a tested position the
target's token is y = argmax(log p + G); a candidate matches when its token is y. One candidate drafted from q matches
with chance sum_v 1 / sum_u max(p(u)/p(v), q(u)/q(v)) (the exponential race); the m best of log q + G, a sampling
drafter's first tokens, contain y with the chance top_match_probability computes; fixed tokens (prompt lookup, the
suffix drafter) with the chance p puts on them. path_choices gives the inspector each tested position's account."""

# K = num_draft_tokens, V = vocab_size, W = num_candidates, n = tested positions, A = candidates alive at a node,
# m = those drafted from one q, M = tokens v summed over, U = tokens u counted one by one, G = pieces the other u are
# merged into, Q = nodes of the integral over t, V' = the v that can match

from __future__ import annotations

import math

import torch

from specdemo.core.rounds import CoupledChoice


def match_probability(
    target: torch.Tensor,  # [..., V] p
    draft: torch.Tensor,  # [..., V] q
    top: int = 64,
    support: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:  # [...] float64 each: a lower and an upper bound
    """P(argmax(log p + G) = argmax(log q + G)) = sum_v 1 / sum_u max(p(u)/p(v), q(u)/q(v)) (the exponential race),
    bounded cheaply: the outer sum runs over the `top` tokens by min(p, q) (each left-out term is at most min(p(v),
    q(v))), the inner sum over the `support` tokens by p + q, the rest of it between max(p_rest/p(v), q_rest/q(v))
    and p_rest/p(v) + q_rest/q(v). Equal to 1 - TV for a one-hot q, as for the standard rule."""
    p, q = target.double(), draft.double()
    p, q = p / p.sum(dim=-1, keepdim=True), q / q.sum(dim=-1, keepdim=True)
    overlap = torch.minimum(p, q)  # [..., V]
    chosen = overlap.topk(min(top, overlap.shape[-1]), dim=-1).indices  # [..., M]
    kept = (p + q).topk(min(support, p.shape[-1]), dim=-1).indices  # [..., U]
    p_u, q_u = p.gather(-1, kept), q.gather(-1, kept)  # [..., U]
    p_rest = (1.0 - p_u.sum(dim=-1, keepdim=True)).clamp(min=0.0)  # [..., 1]
    q_rest = (1.0 - q_u.sum(dim=-1, keepdim=True)).clamp(min=0.0)
    p_v, q_v = p.gather(-1, chosen), q.gather(-1, chosen)  # [..., M]
    both = (p_v > 0) & (q_v > 0)
    p_v, q_v = torch.where(both, p_v, 1.0), torch.where(both, q_v, 1.0)  # no division by 0 where the term is 0
    inner = torch.maximum(p_u[..., None, :] / p_v[..., None], q_u[..., None, :] / q_v[..., None]).sum(dim=-1)
    rest_low = torch.maximum(p_rest / p_v, q_rest / q_v)  # [..., M]
    rest_high = p_rest / p_v + q_rest / q_v
    low = torch.where(both, 1.0 / (inner + rest_high), 0.0).sum(dim=-1)
    high = torch.where(both, 1.0 / (inner + rest_low), 0.0).sum(dim=-1)
    left_out = (overlap.sum(dim=-1) - overlap.gather(-1, chosen).sum(dim=-1)).clamp(min=0.0)
    return low, (high + left_out).clamp(max=1.0)


def truncated_product(
    left: torch.Tensor,  # [..., m] polynomial coefficients, z^0 first
    right: torch.Tensor,  # [..., m]
) -> torch.Tensor:  # [..., m] their product cut to degree m - 1: coefficient k is sum_(i <= k) left_i * right_(k-i)
    product = left[..., :1] * right
    for i in range(1, left.shape[-1]):
        product[..., i:] += left[..., i : i + 1] * right[..., : left.shape[-1] - i]
    return product


def ahead_counts(
    exposure: torch.Tensor,  # [..., U] t * c_u >= 0: u is ahead with chance 1 - exp(-t * c_u), independently
    width: int,  # m
) -> torch.Tensor:  # [..., m] P(N = k) for k < m, N the number of u ahead
    """The first m terms of a Poisson-binomial count's distribution: the coefficients of z^0 .. z^(m-1) of
    prod_u (behind_u + ahead_u z), multiplied pairwise in a tree (log2 U levels) and cut to degree m - 1 after each
    product. Every term is positive, so nothing cancels (as it would through Newton's identities)."""
    size = 1 << max(0, exposure.shape[-1] - 1).bit_length()  # a power of two: padding u have exposure 0, factor 1
    exposure = torch.nn.functional.pad(exposure, (0, size - exposure.shape[-1]))
    poly = exposure.new_zeros(*exposure.shape, width)  # [..., U, m]
    poly[..., 0] = torch.exp(-exposure)
    if width > 1:
        poly[..., 1] = -torch.expm1(-exposure)
    while poly.shape[-2] > 1:
        poly = truncated_product(poly[..., 0::2, :], poly[..., 1::2, :])  # [..., U/2, m]
    return poly[..., 0, :]


def poisson_at_most(rate: torch.Tensor, width: int) -> torch.Tensor:  # [...] -> [..., m]
    """P(Poisson(rate) <= j) for j < m, a sum of positive terms."""
    terms = [torch.exp(-rate)]
    for j in range(1, width):
        terms.append(terms[-1] * rate / j)
    return torch.stack(terms, dim=-1).cumsum(dim=-1)


def ahead_pieces(
    ratio: torch.Tensor,  # [V] q(u) / p(u) sorted, largest first (-1 where q(u) = 0: never ahead)
    target: torch.Tensor,  # [V] p(u) in that order, 0 for the u to leave out
    draft: torch.Tensor,  # [V] q(u) in that order, 0 for the u to leave out
    p_v: torch.Tensor,  # [M] p(v) > 0
    q_v: torch.Tensor,  # [M] q(v) > 0
    pieces: int,  # G
) -> torch.Tensor:  # [M, G] float64
    """sum_u c_u, c_u = max(0, p(v) q(u) / q(v) - p(u)), over G consecutive pieces of the u that can be ahead of v:
    those with q(u) / p(u) > q(v) / p(v), a prefix of the u sorted by that ratio, so cumulative sums give every v's
    pieces at once (exact, with no [M, V] table)."""
    cum_q = torch.nn.functional.pad(draft.cumsum(dim=0), (1, 0))  # [V+1]
    cum_p = torch.nn.functional.pad(target.cumsum(dim=0), (1, 0))
    count = torch.searchsorted(-ratio, -(q_v / p_v), side="left")  # [M] the u with a larger ratio
    edges = (count[:, None] * torch.arange(pieces + 1, device=count.device)).div(pieces, rounding_mode="floor")
    q_piece, p_piece = cum_q[edges].diff(dim=-1), cum_p[edges].diff(dim=-1)  # [M, G]
    return ((p_v / q_v)[:, None] * q_piece - p_piece).clamp(min=0.0)


def time_nodes(like: torch.Tensor, fastest: float, step: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:  # [Q] x2
    """Nodes and weights for integral_0^inf f(t) dt, f(0) = 1, f smooth and decaying at rates between 1 and `fastest`:
    the trapezoid rule in log t, spectrally accurate for such integrands (below 1e-6 at step 0.5, tested), from
    low = 1e-3 / fastest to 36 (past it, below e^-36); the grid goes on below `low` where f is 1 to within
    fastest * low, its nodes' weights summed at t = 0."""
    low, high = 1e-3 / fastest, 36.0
    count = math.ceil(math.log(high / low) / step) + 1
    times = torch.logspace(math.log10(low), math.log10(high), count, dtype=torch.float64, device=like.device)
    gap = math.log(high / low) / (count - 1)
    weights = times * gap  # dt = t d(log t)
    weights[-1] = weights[-1] / 2
    below = times.new_full((1,), low * gap * math.exp(-gap) / -math.expm1(-gap))  # sum_(k >= 1) gap * low e^(-k gap)
    return torch.cat([times.new_zeros(1), times]), torch.cat([below, weights])


def race_integrals(
    target: torch.Tensor,  # [V] p, normalised
    draft: torch.Tensor,  # [V] q, normalised
    ranked: tuple[torch.Tensor, torch.Tensor],  # [V] q / p sorted, largest first, and [V] the order (ahead_pieces)
    chosen: torch.Tensor,  # [M] int64 the v, each with p(v) > 0 and q(v) > 0
    width: int,  # m
    support: int,  # U
    pieces: int,  # G
) -> tuple[torch.Tensor, torch.Tensor]:  # [M] float64 each: integral e^-t P(N_v(t) < m) dt, at least and at most
    """The race's integral for each chosen v: the `support` u by p + q one by one (ahead_counts), the rest between a
    Poisson count of their total rate (each u's count is at most Poisson(t c_u): the lower bound) and G pieces, each
    counted once however many of its u are ahead (merging u only lowers N: the upper bound)."""
    p_v, q_v = target[chosen], draft[chosen]
    kept = (target + draft).topk(min(support, len(target))).indices  # [U]
    rates = (p_v[:, None] * draft[kept] / q_v[:, None] - target[kept]).clamp(min=0.0)  # [M, U] c_u
    ratio, order = ranked
    rest_p, rest_q = target.index_fill(0, kept, 0.0)[order], draft.index_fill(0, kept, 0.0)[order]  # the u left out
    rest = ahead_pieces(ratio, rest_p, rest_q, p_v, q_v, pieces)  # [M, G]
    t, weights = time_nodes(target, 1.0 + float((rates.sum(dim=1) + rest.sum(dim=1)).max()))  # [Q] each
    counts = ahead_counts(t[:, None, None] * rates, width)  # [Q, M, m] P(N_v^kept(t) = k)
    merged = truncated_product(counts, ahead_counts(t[:, None, None] * rest, width)).sum(dim=-1)  # [Q, M]
    spread = (counts * poisson_at_most(t[:, None] * rest.sum(dim=1), width).flip(-1)).sum(dim=-1)  # [Q, M]
    decay = (weights * torch.exp(-t))[:, None]  # [Q, 1]
    return (decay * spread).sum(dim=0), (decay * merged).sum(dim=0)


def top_match_probability(
    target: torch.Tensor,  # [V] p
    draft: torch.Tensor,  # [V] q the sampled candidates were drafted from
    width: int,  # m >= 1: the candidates are the m best of log q + G (Gumbel-top-m, ids with q > 0)
    fixed: torch.Tensor | None = None,  # [V] bool: fixed tokens F proposed beside them (one-hot q)
    top: int = 16,
    support: int = 256,
    pieces: int = 128,
) -> tuple[torch.Tensor, torch.Tensor]:  # [] float64 each: a lower and an upper bound
    """P(y in F or y among the m best of log q + G), y = argmax(log p + G). The exponential race: given y = v and its
    time t ~ Exp(1) (independent of v), each other u is ahead of v in q's order independently with chance
    1 - exp(-t c_u), c_u = max(0, p(v) q(u) / q(v) - p(u)); so P = p(F) + sum_(v not in F, q(v) > 0) p(v) integral
    e^-t P(N_v(t) < m) dt (m = 1: match_probability's sum, exact here over the whole vocabulary). Bounded cheaply:
    each v's term lies between p(v) (1 - (C_v / (1 + C_v))^m) (N_v is at most a Poisson(t C_v) count, C_v = sum_u c_u,
    exact for every v by ahead_pieces) and inclusion_bound; the `top` v with the widest gaps get race_integrals'
    tighter bounds."""
    p, q = target.double() / target.double().sum(), draft.double() / draft.double().sum()
    fixed = torch.zeros_like(p, dtype=torch.bool) if fixed is None else fixed
    ids = ((p > 0) & (q > 0) & ~fixed).nonzero()[:, 0]  # [V'] the v that can match through the m best
    ratio, order = torch.where(q > 0, q / p, -1.0).sort(descending=True)  # [V] each
    total = ahead_pieces(ratio, p[order], q[order], p[ids], q[ids], 1)[:, 0]  # [V'] C_v
    least = p[ids] * -torch.expm1(width * torch.log1p(-1.0 / (1.0 + total)))  # [V'] 1 - (C / (1 + C))^m
    most = least.clone()  # m = 1: the Poisson count's P(N = 0) = e^(-t C_v) is exact
    if width > 1:
        most = inclusion_bound(p, q, width)[ids].maximum(least)
    worst = (most - least).topk(min(top, len(ids)) if width > 1 else 0).indices  # [M] the widest gaps
    if len(worst):
        low_v, high_v = race_integrals(p, q, (ratio, order), ids[worst], width, support, pieces)  # [M] each
        least[worst], most[worst] = p[ids[worst]] * low_v, p[ids[worst]] * high_v
    sure = p[fixed].sum()  # y in F matches
    low = sure + least.sum()
    return low, (sure + most.sum()).clamp(max=1.0).maximum(low)


def inclusion_bound(
    target: torch.Tensor,  # [V] p, normalised
    draft: torch.Tensor,  # [V] q, normalised
    width: int,  # m
) -> torch.Tensor:  # [V] float64
    """An upper bound on P(y = v and v among the m best of log q + G): min(p(v), P(v among them)), the latter drawn
    one at a time without replacement, so at most sum_(k < m) q(v) / (1 - Q_k), Q_k the k largest q's sum."""
    largest = draft.topk(min(width, len(draft))).values.cumsum(dim=0)  # [m] Q_1 .. Q_m
    left = (1.0 - torch.cat([largest.new_zeros(1), largest[:-1]])).clamp(min=0.0)  # [m] 1 - Q_k, k < m
    spread = (1.0 / left).sum()  # inf where the m largest leave nothing: then p(v) bounds it
    return torch.where(draft > 0, torch.minimum(target, draft * spread), 0.0)


def node_chances(
    target_probs: torch.Tensor,  # [n, V] p at each tested node of the path
    alive: list[torch.Tensor],  # n x [A, V]: q of the candidates alive at each (on the path so far, long enough)
) -> list[tuple[float, float]]:  # per node, the chance that one of them matches y: a lower and an upper bound
    """One-hot q are fixed tokens F; the other candidates at a node share one q (a sampling drafter's first tokens are
    the m best of log q + G; past them a beam is alone on its path): top_match_probability. A lone sampled candidate
    (W = 1, or past the first token) is match_probability's, all such nodes in one call."""
    chances: list[tuple[float, float]] = [(0.0, 0.0)] * len(alive)
    lone = []  # nodes with one sampled candidate and no fixed token
    for node, drafts in enumerate(alive):
        one_hot = (drafts > 0).sum(dim=-1) == 1  # [A]
        fixed, sampled = drafts[one_hot].sum(dim=0) > 0, drafts[~one_hot]  # [V] F, [m, V]
        assert bool((sampled == sampled[:1]).all()), f"{len(sampled)} sampled candidates at one node, q not shared"
        p = target_probs[node].double() / target_probs[node].double().sum()
        if len(sampled) == 1 and not bool(fixed.any()):
            lone.append(node)
        elif len(sampled):
            low, high = top_match_probability(p, sampled[0], len(sampled), fixed)
            chances[node] = (float(low), float(high))
        else:
            chances[node] = (float(p[fixed].sum()),) * 2  # fixed tokens only: y is one of them
    if lone:
        drafts = torch.stack([alive[node][0] for node in lone])  # [nodes, V]
        bounds = match_probability(target_probs[lone], drafts)
        for node, low, high in zip(lone, *(bound.tolist() for bound in bounds), strict=True):
            chances[node] = (low, high)
    return chances


def alive_candidates(candidates: list[list[int]], path: int, num_accepted: int) -> list[list[int]]:
    """Per position 0..num_accepted of the path, the candidates tested there (on the path so far, long enough): the
    path's first, then the others in order (where the path ended, the longer ones on it); none at the bonus."""
    drafted = candidates[path] if candidates else []
    return [
        sorted((w for w, c in enumerate(candidates) if len(c) > j and c[:j] == drafted[:j]), key=lambda w: w != path)
        for j in range(num_accepted + 1)
    ]


def path_choices(
    target_probs: torch.Tensor,  # [K+1, V] p along the accepted path
    draft_probs: torch.Tensor,  # [W, K, V] q of each candidate
    noise: torch.Tensor,  # [K+1, V] float64 G at the round's positions
    candidates: list[list[int]],  # each candidate's tokens
    path: int,  # the accepted path's candidate
    num_accepted: int,
    choices: list[int],  # [K+1] y along the path (CandidateVerdict.choices)
) -> tuple[CoupledChoice, ...]:
    """The inspector's account of each tested position of the path: y and x with their log p + G and G, and at a
    drafted position the chance of a match: for the coupled rule, that one of the candidates alive there (on the path
    so far, long enough) is y; for the standard rule, that it accepts x's candidate (1 - TV)."""
    alive = alive_candidates(candidates, path, num_accepted)
    tested = [j for j in range(num_accepted + 1) if alive[j]]
    chances = node_chances(target_probs[tested], [draft_probs[alive[j], j] for j in tested])
    p, q = target_probs[tested].double(), draft_probs[[alive[j][0] for j in tested], tested].double()  # [n, V] x's q
    overlap = torch.minimum(p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)).sum(-1).tolist()  # 1 - TV

    def score(position: int, token: int) -> tuple[float, float]:
        value = float(noise[position, token])
        return float(target_probs[position, token].double().log()) + value, value

    shown = []
    for j in range(num_accepted + 1):
        target = (int(choices[j]), *score(j, int(choices[j])))
        if not alive[j]:  # the bonus: nothing drafted here
            shown.append(CoupledChoice(*target, None, None, None, None, None, None))
            continue
        draft_id, node = candidates[alive[j][0]][j], tested.index(j)
        low, high = chances[node]
        shown.append(
            CoupledChoice(*target, draft_id, *score(j, draft_id), overlap[node], low, high, num_alive=len(alive[j]))
        )
    return tuple(shown)
