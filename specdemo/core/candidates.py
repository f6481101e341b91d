"""Pure: the lossless rule for W candidate drafts of one prompt, and the draft-token choice of one beam, written
per sequence and lifted over beams and rows with torch.func.vmap, as the recurrent-drafter write-up lifts
`sample_seq` with jax.vmap(jax.vmap(...))."""

# B = rows, W = num_candidates, K = num_draft_tokens (the longest candidate), V = vocab_size

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdemo.core.sampling import sample_from_probs, sample_one
from specdemo.core.verify import first_rejection_index, residual_probs, select_positions


@dataclass(frozen=True)
class CandidateVerdict:
    """What the multi-candidate rule decided for each row (a leading B), or for one prompt (no B)."""

    tested: torch.Tensor  # [B, W, K] bool: candidate w's token at depth j met its acceptance test
    accepted: torch.Tensor  # [B, W, K] bool: ... and passed it
    target_draft_probs: torch.Tensor  # [B, W, K] float64 the (remaining) target probability of the token at its
    # test: p(d) for the first test at a node, norm(max(0, p - q...))(d) after rejections; p(d) when untested
    draft_draft_probs: torch.Tensor  # [B, W, K] float64 q(d), the probability the token was drafted with
    acceptance_probs: torch.Tensor  # [B, W, K] float64 min(1, target / draft)
    uniforms: torch.Tensor  # [B, W, K] float64 the draw of each test: accepted when u * q < p
    path: torch.Tensor  # [B] int64 the candidate whose prefix was accepted (0 when none was)
    num_accepted: torch.Tensor  # [B] int64 accepted tokens along the path
    next_token_ids: torch.Tensor  # [B] int64 the resampled or bonus token
    next_token_probs: torch.Tensor  # [B] float32 p(next token) at its node, before any rejection there


def _row_of(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # [W, ...] float, [] int64 -> [...]
    """table[index] for a batched 0-d index, as an exact one-hot sum (vmap-friendly)."""
    return torch.tensordot(torch.nn.functional.one_hot(index, table.shape[0]).to(table.dtype), table, dims=1)


def verify_candidates(
    draft_token_ids: torch.Tensor,  # [W, K] int64, each candidate padded past its length
    draft_lengths: torch.Tensor,  # [W] int64; 0 for a padding candidate
    draft_probs: torch.Tensor,  # [W, K, V] the distribution each token was drafted from (one-hot: deterministic)
    target_probs: torch.Tensor,  # [W, K+1, V] p along candidate w's path, position j after its first j tokens
    uniforms: torch.Tensor,  # [K*W + 1] float64: the test of candidate w at depth j uses j*W + w, the last is final
) -> tuple[torch.Tensor, ...]:
    """SpecInfer's multi-step speculative sampling over the candidates' tree, for one prompt.

    At each depth the candidates still on the accepted path are tried in order: accept token x with min(1, p/q),
    and after each rejection p <- norm(max(0, p - q)). A token comes from the remaining p when all are rejected, or
    from p at the path's end (the bonus). Sampled candidates (i.i.d. from the draft) follow the target exactly.
    A deterministic candidate has a one-hot q: it is accepted with the remaining p of its token, so the rule is
    "sample y from p; descend if y is a child" (EAGLE, SGLang), and under greedy p it takes the longest prefix
    matching the argmax. With W = 1 this is rejection_sample on the same K + 1 draws, bit for bit.
    """
    num_candidates, num_draft = draft_token_ids.shape
    false = torch.zeros((), dtype=torch.bool, device=draft_token_ids.device)
    alive = draft_lengths > 0  # [W] candidates that share the accepted path so far
    done, path, num_accepted = false, torch.zeros_like(draft_lengths[0]), torch.zeros_like(draft_lengths[0])
    tested, accepted, target_draft, draft_draft = [], [], [], []
    final = target_probs[0, 0]  # [V] the next token's distribution, once decided
    final_node = final  # [V] p at the node where the next token is drawn
    for depth in range(num_draft):
        node = _row_of(target_probs[:, depth], path)  # [V] p after the accepted path
        residual, scale, taken, chosen = node, torch.ones_like(node[0]), false, path
        depth_tested, depth_accepted, depth_target, depth_draft = [], [], [], []
        for w in range(num_candidates):
            token = draft_token_ids[w, depth]
            tryable = alive[w] & (draft_lengths[w] > depth) & ~done & ~taken
            target = residual[token] / scale  # the remaining p, normalised; p itself before any rejection
            draft = draft_probs[w, depth, token]
            passed = tryable & (uniforms[depth * num_candidates + w] * draft < target)
            rejected = tryable & ~passed
            remaining = (residual / scale - draft_probs[w, depth]).clamp(min=0.0)  # Algorithm 1, line 12
            remaining = torch.where(remaining.sum() > 0, remaining, residual / scale)  # p == q numerically
            residual = torch.where(rejected, remaining, residual)
            scale = torch.where(rejected, remaining.sum(), scale)
            taken, chosen = taken | passed, torch.where(passed, w, chosen)
            depth_tested.append(tryable)
            depth_accepted.append(passed)
            depth_target.append(torch.where(tryable, target, target_probs[w, depth, token]).double())
            depth_draft.append(draft.double())
        stops = ~done & ~taken  # nothing accepted here: the next token comes from what remains at this node
        final, final_node = torch.where(stops, residual, final), torch.where(stops, node, final_node)
        num_accepted = num_accepted + (~done & taken).long()
        path = torch.where(~done & taken, chosen, path)
        alive = alive & taken & (draft_token_ids[:, depth] == draft_token_ids[chosen, depth])
        done = done | stops
        for table, column in zip(
            (tested, accepted, target_draft, draft_draft),
            (depth_tested, depth_accepted, depth_target, depth_draft),
            strict=True,
        ):
            table.append(torch.stack(column))
    bonus = _row_of(target_probs[:, num_draft], path)  # [V] p after a path accepted to depth K
    final, final_node = torch.where(done, final, bonus), torch.where(done, final_node, bonus)
    next_token = sample_one(final, uniforms[-1])
    return (
        *(_by_candidate(t, num_candidates) for t in (tested, accepted, target_draft, draft_draft)),
        path,
        num_accepted,
        next_token,
        final_node[next_token],
    )


def _by_candidate(columns: list[torch.Tensor], num_candidates: int) -> torch.Tensor:  # K x [W] -> [W, K]
    return torch.stack(columns, dim=1) if columns else torch.zeros(num_candidates, 0)


def verify_batch(
    draft_token_ids: torch.Tensor,  # [B, W, K]
    draft_lengths: torch.Tensor,  # [B, W]
    draft_probs: torch.Tensor,  # [B, W, K, V]
    target_probs: torch.Tensor,  # [B, W, K+1, V]
    uniforms: torch.Tensor,  # [B, K*W + 1] float64
) -> CandidateVerdict:
    """verify_candidates for every row at once."""
    tested, accepted, target_draft, draft_draft, path, num_accepted, next_ids, next_probs = torch.func.vmap(
        verify_candidates
    )(draft_token_ids, draft_lengths, draft_probs, target_probs, uniforms)
    num_rows, num_candidates, num_draft = draft_token_ids.shape
    draws = uniforms[:, : num_draft * num_candidates].reshape(num_rows, num_draft, num_candidates).transpose(1, 2)
    acceptance = torch.where(draft_draft > 0, (target_draft / draft_draft).clamp(max=1.0), 1.0)
    return CandidateVerdict(
        tested=tested.bool(),
        accepted=accepted.bool(),
        target_draft_probs=target_draft,
        draft_draft_probs=draft_draft,
        acceptance_probs=acceptance,
        uniforms=draws,
        path=path,
        num_accepted=num_accepted,
        next_token_ids=next_ids,
        next_token_probs=next_probs.float(),
    )


def verify_chains(
    draft_token_ids: torch.Tensor,  # [B, 1, K]
    draft_lengths: torch.Tensor,  # [B, 1]
    draft_probs: torch.Tensor,  # [B, 1, K, V]
    target_probs: torch.Tensor,  # [B, 1, K+1, V]
    uniforms: torch.Tensor,  # [B, K+1] float64
) -> CandidateVerdict:
    """verify_batch where every row has one candidate, as Algorithm 1 vectorised over depth (rejection_sample's
    steps, with ragged lengths): the same verdict bit for bit, in a dozen tensor operations instead of a dozen per
    depth (tests/test_candidates.py times both)."""
    tokens, lengths = draft_token_ids[:, 0], draft_lengths[:, 0]  # [B, K], [B]
    draft, target = draft_probs[:, 0], target_probs[:, 0]  # [B, K, V], [B, K+1, V]
    num_draft = tokens.shape[1]
    index = tokens.unsqueeze(-1)  # [B, K, 1]
    target_draft = target[:, :num_draft].gather(-1, index).squeeze(-1).double()  # [B, K] p(d)
    draft_draft = draft.gather(-1, index).squeeze(-1).double()  # [B, K] q(d)
    drafted = torch.arange(num_draft, device=tokens.device) < lengths.unsqueeze(1)  # [B, K]
    passed = drafted & (uniforms[:, :num_draft] * draft_draft < target_draft)  # u * q < p, as verify_candidates
    num_accepted = first_rejection_index(passed)  # [B]
    tested = drafted & (torch.arange(num_draft, device=tokens.device) <= num_accepted.unsqueeze(1))
    # At the first rejection the next token comes from norm(max(0, p - q)); after the whole chain, from p (bonus).
    node = select_positions(target, num_accepted)  # [B, V]
    rejected = (num_accepted < lengths).unsqueeze(-1)  # [B, 1]
    next_draft = select_positions(draft, num_accepted.clamp(max=max(num_draft - 1, 0))) * rejected
    next_ids = sample_from_probs(residual_probs(node, next_draft), uniforms[:, -1])  # [B]
    acceptance = torch.where(draft_draft > 0, (target_draft / draft_draft).clamp(max=1.0), 1.0)
    return CandidateVerdict(
        tested=tested.unsqueeze(1),
        accepted=(tested & passed).unsqueeze(1),
        target_draft_probs=target_draft.unsqueeze(1),
        draft_draft_probs=draft_draft.unsqueeze(1),
        acceptance_probs=acceptance.unsqueeze(1),
        uniforms=uniforms[:, :num_draft].unsqueeze(1),
        path=torch.zeros_like(lengths),
        num_accepted=num_accepted,
        next_token_ids=next_ids,
        next_token_probs=node.gather(1, next_ids.unsqueeze(1)).squeeze(1).float(),
    )


def verify_rows(
    draft_token_ids: torch.Tensor,  # [B, W, K]
    draft_lengths: torch.Tensor,  # [B, W]
    draft_probs: torch.Tensor,  # [B, W, K, V]
    target_probs: torch.Tensor,  # [B, W, K+1, V]
    uniforms: torch.Tensor,  # [B, K*W + 1] float64
) -> CandidateVerdict:
    """The engine's rule: verify_chains when every row has one candidate, else the vmapped tree rule."""
    chains = draft_token_ids.shape[1] == 1
    return (verify_chains if chains else verify_batch)(
        draft_token_ids, draft_lengths, draft_probs, target_probs, uniforms
    )


Verify = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], CandidateVerdict]  # as above


def choose_draft_tokens(
    draft_probs: torch.Tensor,  # [B, W, V] each beam's next-token distribution
    uniforms: torch.Tensor,  # [B, W] float64, one draw per beam
) -> torch.Tensor:  # [B, W] int64
    """One beam's next draft token is sample_one of its distribution and its draw; lifted over beam and batch."""
    return torch.func.vmap(torch.func.vmap(sample_one))(draft_probs, uniforms)
