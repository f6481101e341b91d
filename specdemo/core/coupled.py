"""Pure: the coupled rule, "same text for any drafter". Every position t of a row's text has its own noise G_t, one
Gumbel value per vocabulary id from a counter hash of (seed, t, id). The target's token at t is y_t = argmax_v
(log p_t(v) + G_t(v)), an exact sample from p_t (the Gumbel-max trick), and a sampling drafter proposes x_t = argmax_v
(log q_t(v) + G_t(v)) with the same noise. Verification compares, as greedy decoding does: accept while the draft
equals y_t, then emit y_t. Every emitted token is the target's own Gumbel-max sample, so the text is target-only
decoding's text for that seed, whatever drafted it (Daliri, Musco and Suresh, arXiv 2408.07978)."""

# B = rows, W = num_candidates, K = num_draft_tokens (the longest candidate), n = positions (K+1), V = vocab_size

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdemo.core.fixed_rule import GAMMA, MIX_1, MIX_2, shift_right_logical
from specdemo.core.verify import CandidateVerdict, first_rejection_index

POSITION_SALT = 0x2545F4914F6CDD1D  # keeps a position's key apart from the id stream it seeds


# --- the noise: a counter hash of (seed, position, id) ---------------------------------------------------------------


def mix64(values: torch.Tensor) -> torch.Tensor:  # [...] int64 -> [...] int64
    """splitmix64's finaliser on the uint64 bit pattern, in int64 arithmetic that wraps as uint64 does."""
    z = (values ^ shift_right_logical(values, 30)) * MIX_1
    z = (z ^ shift_right_logical(z, 27)) * MIX_2
    return z ^ shift_right_logical(z, 31)


def noise_bits(
    seeds: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B, n] int64: where each token stands in its row's text (0 is the prompt's first)
    vocab_size: int,
) -> torch.Tensor:  # [B, n, V] int64
    """64 random bits per (seed, position, id), integer operations only, so the same bits on any device, and whatever
    the rows beside it, the round or the drafter: the position's key, then splitmix64's stream from that key."""
    keys = mix64(seeds[:, None] * POSITION_SALT + (positions + 1) * GAMMA)  # [B, n]
    ids = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=seeds.device)  # [V]
    return mix64(keys[..., None] + ids * GAMMA)


def uniform_from_bits(bits: torch.Tensor) -> torch.Tensor:  # [...] int64 -> [...] float64
    """u = (x + 0.5) * 2^-52 with x the top 52 bits: x + 0.5 < 2^52 is exact in float64 (53 significant bits), so u
    lies in [2^-53, 1 - 2^-53], never 0 or 1, and -log(-log(u)) is finite. With 53 bits the + 0.5 rounds away for
    x >= 2^52 and x = 2^53 - 1 gives u = 1.0, G = +inf."""
    return (shift_right_logical(bits, 12).double() + 0.5) * 2.0**-52


def gumbel_noise(
    seeds: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B, n] int64
    vocab_size: int,
) -> torch.Tensor:  # [B, n, V] float64
    """G = -log(-log(u)), u strictly inside (0, 1) from the position's bits (uniform_from_bits): finite, one fused
    expression."""
    return -torch.log(-torch.log(uniform_from_bits(noise_bits(seeds, positions, vocab_size))))


@dataclass(frozen=True)
class NoiseAsk:
    """What a round's noise is asked for: a row's positions start .. start + count - 1, and what a planted bug may read
    (the round, the first candidate's tokens)."""

    seed: int  # the row's noise seed
    start: int  # the position of the round's first decided token: the row's length
    count: int  # K + 1
    round_index: int
    draft: tuple[int, ...]  # the first candidate's tokens
    vocab_size: int
    device: torch.device


Noise = Callable[[NoiseAsk], torch.Tensor]  # -> [count, V] float64; the audit plants its noise bugs here


def position_noise(ask: NoiseAsk) -> torch.Tensor:  # [count, V] float64
    """The rule's noise: G_t for t = start .. start + count - 1, from the seed and the position alone."""
    return row_noise([ask.seed], [ask.start], ask.count, ask.vocab_size, ask.device)[0]


def row_noise(seeds: list[int], starts: list[int], count: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """[R, count, V] float64: row r's G_t for t = starts[r] .. starts[r] + count - 1 (what drafters draw with)."""
    seed = torch.tensor(seeds, dtype=torch.int64, device=device)
    positions = torch.tensor(starts, dtype=torch.int64, device=device)[:, None] + torch.arange(count, device=device)
    return gumbel_noise(seed, positions, vocab_size)


# --- choices ---------------------------------------------------------------------------------------------------------


def coupled_scores(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:  # [..., V] each -> [..., V] float64
    """log p + G, and -inf wherever p = 0 whatever the noise, so a filtered token is never chosen (-inf + inf would
    be NaN, which argmax picks)."""
    return torch.where(probs > 0, probs.double().log() + noise, -torch.inf)


def coupled_choice(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:  # [..., V] each -> [...] int64
    """argmax_v (log p(v) + G(v)): an exact sample from p (normalised) for noise G of i.i.d. Gumbel values."""
    return coupled_scores(probs, noise).argmax(dim=-1)


def coupled_top(
    probs: torch.Tensor,  # [..., V]
    noise: torch.Tensor,  # [..., V]
    width: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # [..., W] int64 ids, [..., W] bool: the id has p > 0
    """The W largest log p + G, best first: the first is coupled_choice, and the W are a sample without replacement
    from p (Gumbel-top-k), a drafter's W distinct first tokens. Where p allows fewer than W tokens (top-k < W, a
    small vocabulary), the ids past them are ties at -inf, any id at all: `live` marks the ones to draft."""
    scores, ids = coupled_scores(probs, noise).topk(width, dim=-1)
    return ids, scores > -torch.inf


# --- the rule --------------------------------------------------------------------------------------------------------


def verify_coupled(
    draft_token_ids: torch.Tensor,  # [B, W, K] int64, each candidate padded past its length
    draft_lengths: torch.Tensor,  # [B, W] int64; 0 for a padding candidate
    draft_probs: torch.Tensor,  # [B, W, K, V] q (for the trace only: the rule never reads it)
    target_probs: torch.Tensor,  # [B, W, K+1, V] p along candidate w's path, position j after its first j tokens
    noise: torch.Tensor,  # [B, K+1, V] float64: G at the round's K+1 positions (the same for every candidate)
) -> CandidateVerdict:
    """The tree walk: at each depth the target's token y is argmax(log p + G) at the accepted path's node, and the
    first candidate still on the path whose token equals y is accepted; at the first depth none does, y is emitted
    (resampled), and after a path accepted to its end the bonus is y at its end. With W = 1 and K = 0 it is
    target-only decoding's Gumbel-max draw."""
    num_rows, num_candidates, num_draft = draft_token_ids.shape
    device = draft_token_ids.device
    choices = coupled_choice(target_probs, noise[:, None])  # [B, W, K+1] y at each node of each candidate's path
    depth = torch.arange(num_draft, device=device)  # [K]
    drafted = depth < draft_lengths[..., None]  # [B, W, K]
    matched = drafted & (draft_token_ids == choices[..., :num_draft])  # [B, W, K]
    reached = first_rejection_index(matched.flatten(0, 1)).view(num_rows, num_candidates)  # [B, W]
    reached = reached.masked_fill(draft_lengths == 0, -1)
    path = reached.argmax(dim=1)  # [B] the first of the longest: the walk's choice at every depth
    rows = torch.arange(num_rows, device=device)
    num_accepted = reached[rows, path].clamp(min=0)  # [B]
    alive = alive_along(draft_token_ids, draft_lengths, path, num_accepted)  # [B, W, K]
    path_choice = choices[rows, path]  # [B, K+1] y along the accepted path
    hit = alive & (draft_token_ids == path_choice[:, None, :num_draft])  # [B, W, K]
    earlier = (hit.long().cumsum(dim=1) - hit.long()) > 0  # a candidate before w already matched at j
    tested, accepted = alive & ~earlier, hit & ~earlier
    index = draft_token_ids.clamp(min=0).unsqueeze(-1)  # [B, W, K, 1]
    target_draft = target_probs[:, :, :num_draft].gather(-1, index).squeeze(-1).double()  # [B, W, K] p(d)
    draft_draft = draft_probs.gather(-1, index).squeeze(-1).double()  # [B, W, K] q(d)
    next_ids = path_choice.gather(1, num_accepted[:, None]).squeeze(1)  # [B] y where the path stops
    node = target_probs[rows, path, num_accepted]  # [B, V]
    return CandidateVerdict(
        tested=tested,
        accepted=accepted,
        target_draft_probs=target_draft,
        draft_draft_probs=draft_draft,
        acceptance_probs=accepted.double(),  # the test is decided by the noise: 1 accepted, 0 not
        uniforms=torch.zeros_like(target_draft),  # no draws: the noise decides
        noise=noise[:, :num_draft].gather(-1, draft_token_ids.clamp(min=0).transpose(1, 2)).transpose(1, 2),
        path=path,
        num_accepted=num_accepted,
        next_token_ids=next_ids,
        next_token_probs=node.gather(1, next_ids[:, None]).squeeze(1).float(),
        choices=path_choice,
    )


def alive_along(
    draft_token_ids: torch.Tensor,  # [B, W, K] int64
    draft_lengths: torch.Tensor,  # [B, W] int64
    path: torch.Tensor,  # [B] int64 the accepted path's candidate
    num_accepted: torch.Tensor,  # [B] int64
) -> torch.Tensor:  # [B, W, K] bool
    """The candidates alive at each depth j of the path: longer than j, their first j tokens the path's, and the path
    got that far (match_chance.alive_candidates on the host)."""
    depth = torch.arange(draft_token_ids.shape[2], device=draft_token_ids.device)  # [K]
    on_path = draft_token_ids[torch.arange(len(path), device=path.device), path]  # [B, K]
    same_prefix = (draft_token_ids == on_path[:, None]).long().cumprod(dim=2)  # [B, W, K] equal through depth j
    alive = torch.cat([torch.ones_like(same_prefix[..., :1]), same_prefix[..., :-1]], 2).bool()  # through j - 1
    return alive & (depth < draft_lengths[..., None]) & (depth <= num_accepted[:, None, None])
