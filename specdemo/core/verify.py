"""Pure: the lossless rule, once. Modified rejection sampling (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023)
over W candidate drafts per row (SpecInfer's multi-step speculative sampling), written per sequence and lifted over
rows with torch.func.vmap, as the recurrent-drafter write-up lifts `sample_seq` with jax.vmap(jax.vmap(...)).

The engine runs `verify_rows`; `rejection_sample` is its single-candidate entry point with drawn uniforms; the audit
plants its bugs around `verify_rows`. The acceptance test (`passes`), min(1, p/q) (`acceptance_probs`) and the
residual (`residual_probs`) are each written once, here."""

# B = rows, W = num_candidates, K = num_draft_tokens (the longest candidate), V = vocab_size

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdemo.core.sampling import Generators, draw_uniforms, sample_one, sample_rows

PADDING_ID = -1  # fills token_ids after the one resampled or bonus token


def passes(uniform: torch.Tensor, target: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """The acceptance test of a drafted token: u * q < p. No division, and p == 0 is never accepted, even with
    u == 0; with q == 0 (a token the drafter could not have drawn) only p > 0 passes."""
    return uniform * draft < target


def acceptance_probs(target: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """min(1, p/q), the chance `passes` accepts a token (1 where q == 0), for the trace: float64."""
    target, draft = target.double(), draft.double()
    return torch.where(draft > 0, (target / draft).clamp(max=1.0), 1.0)


def residual_probs(
    target_probs: torch.Tensor,  # [..., V] p at the rejected position (or what remains of it)
    draft_probs: torch.Tensor,  # [..., V] q there
) -> torch.Tensor:  # [..., V] unnormalised max(0, p - q), or p where that is all zero
    """Algorithm 1, line 12: resample from norm(max(0, p - q)); p itself when p == q numerically. Loop-free and
    without in-place writes, so vmap lifts it."""
    residual = (target_probs - draft_probs).clamp(min=0.0)
    return torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, target_probs)


def first_rejection_index(accepted: torch.Tensor) -> torch.Tensor:  # [B, K] bool -> [B] int64
    """Number of leading True values per row: how many drafts survive until the first rejection."""
    return accepted.long().cumprod(dim=1).sum(dim=1)


def first_nonfinite(
    scores: torch.Tensor,  # [..., N, V] raw logits (or q) at N positions
    read: torch.Tensor,  # [..., N] bool: the positions the round verifies
) -> torch.Tensor:  # [...] int64: the first read position holding inf or NaN, N where none does
    """Where a model's numbers left its format's range. Raw logits are finite unless a pass overflowed (masking and
    top-k write their -inf later, into the processed scores), and inf or NaN there makes p, and every draw from it,
    meaningless: Qwen2 in float16 writes "!!!!", token 0, the argmax of NaN."""
    # inf reaches amax, -inf amin, and NaN both: two reductions, a tenth of isfinite's time over 17 x 49,152 scores
    bad = read & ~(torch.isfinite(scores.amax(dim=-1)) & torch.isfinite(scores.amin(dim=-1)))  # [..., N]
    num_positions = bad.shape[-1]
    found = torch.where(bad, torch.arange(num_positions, device=bad.device), num_positions)  # [..., N]
    return torch.nn.functional.pad(found, (0, 1), value=num_positions).amin(dim=-1)  # N + 1 columns: never empty


def select_positions(
    probs: torch.Tensor,  # [B, N, V]
    positions: torch.Tensor,  # [B] int64 in [0, N)
) -> torch.Tensor:  # [B, V] probs[b, positions[b]]
    """One position per row, through a flat index_select (several times faster than advanced indexing)."""
    batch_size, num_positions, vocab_size = probs.shape
    if num_positions == 0:
        return probs.new_zeros(batch_size, vocab_size)
    rows = torch.arange(batch_size, device=probs.device)  # [B]
    return probs.reshape(batch_size * num_positions, vocab_size).index_select(0, rows * num_positions + positions)


@dataclass(frozen=True)
class CandidateVerdict:
    """What the rule decided for each row, with the numbers behind every decision."""

    tested: torch.Tensor  # [B, W, K] bool: candidate w's token at depth j met its acceptance test
    accepted: torch.Tensor  # [B, W, K] bool: ... and passed it
    target_draft_probs: torch.Tensor  # [B, W, K] float64 the (remaining) target probability of the token at its
    # test: p(d) for the first test at a node, norm(max(0, p - q...))(d) after rejections; p(d) when untested
    draft_draft_probs: torch.Tensor  # [B, W, K] float64 q(d), the probability the token was drafted with
    acceptance_probs: torch.Tensor  # [B, W, K] float64 min(1, target / draft)
    uniforms: torch.Tensor  # [B, W, K] float64 the draw of each test: accepted when u * q < p (zeros where the rule
    # draws none)
    path: torch.Tensor  # [B] int64 the candidate whose prefix was accepted (0 when none was)
    num_accepted: torch.Tensor  # [B] int64 accepted tokens along the path
    next_token_ids: torch.Tensor  # [B] int64 the resampled or bonus token
    next_token_probs: torch.Tensor  # [B] float32 p(next token) at its node, before any rejection there
    choices: torch.Tensor | None = None  # [B, K+1] the coupled rule's y along the path (core/coupled.py); None for
    # this rule
    noise: torch.Tensor | None = None  # [B, W, K] float64 the coupled rule's noise G(d) of each drafted token, which
    # decided its test; None for this rule


Verify = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], CandidateVerdict]


def verify_rows(
    draft_token_ids: torch.Tensor,  # [B, W, K] int64, each candidate padded past its length
    draft_lengths: torch.Tensor,  # [B, W] int64; 0 for a padding candidate
    draft_probs: torch.Tensor,  # [B, W, K, V] the distribution each token was drafted from (one-hot: deterministic)
    target_probs: torch.Tensor,  # [B, W, K+1, V] p along candidate w's path, position j after its first j tokens
    uniforms: torch.Tensor,  # [B, K*W + 1] float64: the test of candidate w at depth j uses j*W + w, the last is final
) -> CandidateVerdict:
    """The engine's rule: `verify_chains` when every row has one candidate (the same verdict bit for bit, in a dozen
    tensor operations instead of a dozen per depth), else `verify_candidates` lifted over rows. A drafted id outside
    the vocabulary (PADDING_ID among them) is refused alike by both."""
    drafted = check_draft_ids(draft_token_ids, draft_lengths, draft_probs.shape[-1])
    draft_token_ids = torch.where(drafted, draft_token_ids, 0)  # past a candidate's end, any id is padding
    verify = verify_chains if draft_token_ids.shape[1] == 1 else verify_tree
    return verify(draft_token_ids, draft_lengths, draft_probs, target_probs, uniforms)


def check_draft_ids(
    draft_token_ids: torch.Tensor,  # [B, W, K] int64
    draft_lengths: torch.Tensor,  # [B, W] int64
    vocab_size: int,
) -> torch.Tensor:  # [B, W, K] bool: within each candidate's length
    """A ValueError naming the first drafted id, within its candidate's length, that is not a token of the vocabulary:
    PADDING_ID (-1) pads outputs, never drafts. One host sync."""
    depth = torch.arange(draft_token_ids.shape[2], device=draft_token_ids.device)  # [K]
    drafted = depth < draft_lengths[..., None]  # [B, W, K]
    outside = drafted & ((draft_token_ids < 0) | (draft_token_ids >= vocab_size))
    if bool(outside.any()):
        b, w, j = outside.nonzero()[0].tolist()
        raise ValueError(
            f"Draft token {j} of candidate {w} in row {b} is {int(draft_token_ids[b, w, j])}, not a token id in "
            f"[0, {vocab_size}): a draft holds real ids up to its length ({PADDING_ID} only pads the rule's output)."
        )
    return drafted


def _row_of(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # [W, ...] float, [] int64 -> [...]
    """table[index] for a batched 0-d index, as an exact one-hot sum (vmap-friendly)."""
    return torch.tensordot(torch.nn.functional.one_hot(index, table.shape[0]).to(table.dtype), table, dims=1)


def verify_candidates(
    draft_token_ids: torch.Tensor,  # [W, K] int64, each candidate padded past its length
    draft_lengths: torch.Tensor,  # [W] int64; 0 for a padding candidate
    draft_probs: torch.Tensor,  # [W, K, V]
    target_probs: torch.Tensor,  # [W, K+1, V]
    uniforms: torch.Tensor,  # [K*W + 1] float64
) -> tuple[torch.Tensor, ...]:
    """The rule for one prompt: SpecInfer's multi-step speculative sampling over its candidates' tree.

    At each depth the candidates still on the accepted path are tried in order: accept token x with min(1, p/q),
    and after each rejection p <- norm(max(0, p - q)). A token comes from the remaining p when all are rejected, or
    from p at the path's end (the bonus). Sampled candidates (i.i.d. from the draft) follow the target exactly.
    A deterministic candidate has a one-hot q: it is accepted with the remaining p of its token, so the rule is
    "sample y from p; descend if y is a child" (EAGLE, SGLang), and under greedy p it takes the longest prefix
    matching the argmax. With W = 1 it is Algorithm 1 on the same K + 1 draws, bit for bit (verify_chains)."""
    num_candidates, num_draft = draft_token_ids.shape
    false = torch.zeros((), dtype=torch.bool, device=draft_token_ids.device)
    alive = draft_lengths > 0  # [W] candidates that share the accepted path so far
    done, path, num_accepted = false, torch.zeros_like(draft_lengths[0]), torch.zeros_like(draft_lengths[0])
    columns: list[list[torch.Tensor]] = [[], [], [], []]  # per depth: tested, accepted, target, draft, each [W]
    final = target_probs[0, 0]  # [V] the next token's distribution, once decided
    final_node = final  # [V] p at the node where the next token is drawn
    for depth in range(num_draft):
        node = _row_of(target_probs[:, depth], path)  # [V] p after the accepted path
        residual, scale, taken, chosen = node, torch.ones_like(node[0]), false, path
        at_depth: list[list[torch.Tensor]] = [[], [], [], []]
        for w in range(num_candidates):
            token = draft_token_ids[w, depth]
            tryable = alive[w] & (draft_lengths[w] > depth) & ~done & ~taken
            target = residual[token] / scale  # the remaining p, normalised; p itself before any rejection
            draft = draft_probs[w, depth, token]
            passed = tryable & passes(uniforms[depth * num_candidates + w], target, draft)
            rejected = tryable & ~passed
            remaining = residual_probs(residual / scale, draft_probs[w, depth])
            residual = torch.where(rejected, remaining, residual)
            scale = torch.where(rejected, remaining.sum(), scale)
            taken, chosen = taken | passed, torch.where(passed, w, chosen)
            shown = torch.where(tryable, target, target_probs[w, depth, token])  # p(d) when untested
            for column, value in zip(at_depth, (tryable, passed, shown, draft), strict=True):
                column.append(value)
        stops = ~done & ~taken  # nothing accepted here: the next token comes from what remains at this node
        final, final_node = torch.where(stops, residual, final), torch.where(stops, node, final_node)
        num_accepted = num_accepted + (~done & taken).long()
        path = torch.where(~done & taken, chosen, path)
        alive = alive & taken & (draft_token_ids[:, depth] == draft_token_ids[chosen, depth])
        done = done | stops
        for table, column in zip(columns, at_depth, strict=True):
            table.append(torch.stack(column))
    bonus = _row_of(target_probs[:, num_draft], path)  # [V] p after a path accepted to depth K
    final, final_node = torch.where(done, final, bonus), torch.where(done, final_node, bonus)
    next_token = sample_one(final, uniforms[-1])
    by_candidate = [
        torch.stack(c, dim=1) if c else torch.zeros(num_candidates, 0, device=draft_token_ids.device) for c in columns
    ]  # [W, K] each
    return (*by_candidate, path, num_accepted, next_token, final_node[next_token])


def verify_tree(
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
    return CandidateVerdict(
        tested=tested.bool(),
        accepted=accepted.bool(),
        target_draft_probs=target_draft.double(),
        draft_draft_probs=draft_draft.double(),
        acceptance_probs=acceptance_probs(target_draft, draft_draft),
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
    """verify_tree where every row has one candidate: Algorithm 1 vectorised over depth, with ragged lengths."""
    tokens, lengths = draft_token_ids[:, 0], draft_lengths[:, 0]  # [B, K], [B]
    draft, target = draft_probs[:, 0], target_probs[:, 0]  # [B, K, V], [B, K+1, V]
    num_draft = tokens.shape[1]
    index = tokens.unsqueeze(-1)  # [B, K, 1]
    target_draft = target[:, :num_draft].gather(-1, index).squeeze(-1).double()  # [B, K] p(d)
    draft_draft = draft.gather(-1, index).squeeze(-1).double()  # [B, K] q(d)
    drafted = torch.arange(num_draft, device=tokens.device) < lengths.unsqueeze(1)  # [B, K]
    passed = drafted & passes(uniforms[:, :num_draft], target_draft, draft_draft)
    num_accepted = first_rejection_index(passed)  # [B]
    tested = drafted & (torch.arange(num_draft, device=tokens.device) <= num_accepted.unsqueeze(1))
    # At the first rejection the next token comes from norm(max(0, p - q)); after the whole chain, from p (bonus).
    node = select_positions(target, num_accepted)  # [B, V]
    rejected = (num_accepted < lengths).unsqueeze(-1)  # [B, 1]
    next_draft = select_positions(draft, num_accepted.clamp(max=max(num_draft - 1, 0))) * rejected
    next_ids = sample_rows(residual_probs(node, next_draft), uniforms[:, -1])  # [B]
    return CandidateVerdict(
        tested=tested.unsqueeze(1),
        accepted=(tested & passed).unsqueeze(1),
        target_draft_probs=target_draft.unsqueeze(1),
        draft_draft_probs=draft_draft.unsqueeze(1),
        acceptance_probs=acceptance_probs(target_draft, draft_draft).unsqueeze(1),
        uniforms=uniforms[:, :num_draft].unsqueeze(1),
        path=torch.zeros_like(lengths),
        num_accepted=num_accepted,
        next_token_ids=next_ids,
        next_token_probs=node.gather(1, next_ids.unsqueeze(1)).squeeze(1).float(),
    )


@dataclass(frozen=True)
class RejectionResult:
    """What one verification of one candidate per row decided, with the numbers behind every decision."""

    token_ids: torch.Tensor  # [B, K+1] accepted drafts, one resampled or bonus token, then PADDING_ID
    num_accepted: torch.Tensor  # [B] accepted draft tokens; the next token is bonus when == K
    target_draft_probs: torch.Tensor  # [B, K] p(d_i), the target probability of each draft token
    draft_draft_probs: torch.Tensor  # [B, K] q(d_i), the probability the draft token was sampled with
    acceptance_probs: torch.Tensor  # [B, K] float64 min(1, p(d_i) / q(d_i))
    uniforms: torch.Tensor  # [B, K] float64 the draws u_i; d_i is accepted when u_i * q < p
    next_token_ids: torch.Tensor  # [B] the resampled (num_accepted < K) or bonus token
    next_token_probs: torch.Tensor  # [B] float32 the target probability of next_token_ids at its position


def rejection_sample(
    draft_token_ids: torch.Tensor,  # [B, K] int64 proposed tokens
    draft_probs: torch.Tensor,  # [B, K, V] the distributions the draft tokens were sampled from
    target_probs: torch.Tensor,  # [B, K+1, V] target distributions, position i on prefix + d_1..d_i
    *,
    generator: Generators = None,  # one for the batch, or one per row (rows then never interact)
) -> RejectionResult:
    """Accept each draft token with probability min(1, p/q), then emit one resampled or bonus token: the engine's
    rule (verify_rows) on one candidate per row. Row b draws K+1 uniforms from its generator: K acceptance tests,
    then one for the next token."""
    batch_size, num_draft, vocab_size = draft_probs.shape
    assert target_probs.shape == (batch_size, num_draft + 1, vocab_size), (
        f"target_probs {tuple(target_probs.shape)} does not fit draft_probs {tuple(draft_probs.shape)}"
    )
    uniforms = draw_uniforms(generator, batch_size, num_draft + 1, draft_probs.device)  # [B, K+1]
    lengths = torch.full((batch_size, 1), num_draft, device=draft_token_ids.device)  # [B, 1]
    verdict = verify_rows(draft_token_ids[:, None], lengths, draft_probs[:, None], target_probs[:, None], uniforms)
    return RejectionResult(
        token_ids=emitted_token_ids(draft_token_ids, verdict.num_accepted, verdict.next_token_ids),
        num_accepted=verdict.num_accepted,
        target_draft_probs=verdict.target_draft_probs[:, 0],
        draft_draft_probs=verdict.draft_draft_probs[:, 0],
        acceptance_probs=verdict.acceptance_probs[:, 0],
        uniforms=verdict.uniforms[:, 0],
        next_token_ids=verdict.next_token_ids,
        next_token_probs=verdict.next_token_probs,
    )


def emitted_token_ids(
    draft_token_ids: torch.Tensor,  # [B, K]
    num_accepted: torch.Tensor,  # [B]
    next_token_ids: torch.Tensor,  # [B]
) -> torch.Tensor:  # [B, K+1] accepted drafts, the next token, then PADDING_ID
    positions = torch.arange(draft_token_ids.shape[1] + 1, device=draft_token_ids.device)  # [K+1]
    padded_ids = torch.nn.functional.pad(draft_token_ids, (0, 1), value=PADDING_ID)  # [B, K+1]
    token_ids = torch.where(positions < num_accepted[:, None], padded_ids, PADDING_ID)
    rows = torch.arange(draft_token_ids.shape[0], device=draft_token_ids.device)
    token_ids[rows, num_accepted] = next_token_ids
    return token_ids


def choose_draft_tokens(
    draft_probs: torch.Tensor,  # [B, W, V] each beam's next-token distribution
    uniforms: torch.Tensor,  # [B, W] float64, one draw per beam
) -> torch.Tensor:  # [B, W] int64
    """One beam's next draft token is sample_one of its distribution and its draw; lifted over beam and batch."""
    return torch.func.vmap(torch.func.vmap(sample_one))(draft_probs, uniforms)
