"""The planted bugs: each a mistake real samplers made, planted around the very rule the engine runs (verify_rows),
so the audit's control and its mutants run the same code; and the coupled rule's, planted in its noise: each reads
the noise at the wrong positions. `planted_rule` hands either to the engine as a rule (core/rules.py)."""

# B = rows, W = num_candidates, K = num_draft_tokens, n = positions a round decides (K+1), V = vocab_size

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace

import torch

from specdemo.config import MAX_NUM_DRAFT_TOKENS
from specdemo.core.coupled import Noise, NoiseAsk, gumbel_noise, position_noise
from specdemo.core.rules import CoupledRule, Rule, StandardRule
from specdemo.core.sampling import sample_from_probs
from specdemo.core.verify import CandidateVerdict, Verify, verify_rows

RAW_TEMPERATURE = 1.5  # the "wrong q" bug divides by the draft's distribution before this temperature
BUGS = {
    "none": "the project's sampler",
    "resample from p": "after a rejection the next token comes from p instead of norm(max(0, p - q))",
    "always accept": "every draft token is accepted",
    "wrong q": f"the test uses the draft's raw distribution (before its temperature {RAW_TEMPERATURE:g}), not the "
    "one it sampled from",
    "shared uniform": "one uniform draw serves every test and the final draw",
    "ReDrafter's rule, as released": "each beam is tested on its own with min(1, p/q), the longest accepted beam "
    "wins and the next token comes from that beam's residual (apple/ml-recurrent-drafter; exact only for W = 1 "
    "or greedy)",
}


def verifier(bug: str, rule: Verify = verify_rows) -> Verify:
    """The engine's rule itself for "none", else that rule with the named bug planted around it; `inspect.unwrap`
    of any of them is `rule`."""
    if bug not in BUGS:
        raise ValueError(f"Unknown bug {bug!r}: pick one of {', '.join(repr(b) for b in BUGS)}.")
    if bug == "none":
        return rule
    planted = functools.partial(PLANTED[bug], rule)
    functools.update_wrapper(planted, rule)  # planted.__wrapped__ is rule
    return planted


def _resampling_from_p(rule: Verify, ids, lengths, draft_probs, target_probs, uniforms) -> CandidateVerdict:
    verdict = rule(ids, lengths, draft_probs, target_probs, uniforms)
    rows = torch.arange(ids.shape[0], device=ids.device)
    node = target_probs[rows, verdict.path, verdict.num_accepted]  # [B, V] p where the next token is drawn
    from_p = sample_from_probs(node, uniforms[:, -1])
    stopped = verdict.num_accepted < lengths[rows, verdict.path]  # a rejection, not a bonus
    return replace(verdict, next_token_ids=torch.where(stopped, from_p, verdict.next_token_ids))


def _always_accepting(rule: Verify, ids, lengths, draft_probs, target_probs, uniforms) -> CandidateVerdict:
    passing = uniforms.clone()
    passing[:, :-1] = -1.0  # u * q < p for every drafted token (q > 0): every test passes
    return rule(ids, lengths, draft_probs, target_probs, passing)


def _with_raw_q(rule: Verify, ids, lengths, draft_probs, target_probs, uniforms) -> CandidateVerdict:
    raw = draft_probs.double() ** RAW_TEMPERATURE  # softmax(l / T) ** T is proportional to softmax(l)
    raw = (raw / raw.sum(dim=-1, keepdim=True).clamp(min=1e-300)).to(draft_probs.dtype)  # padding stays 0
    return rule(ids, lengths, raw, target_probs, uniforms)


def _with_one_uniform(rule: Verify, ids, lengths, draft_probs, target_probs, uniforms) -> CandidateVerdict:
    return rule(ids, lengths, draft_probs, target_probs, uniforms[:, :1].expand_as(uniforms).contiguous())


def _redrafter_released(rule: Verify, ids, lengths, draft_probs, target_probs, uniforms) -> CandidateVerdict:
    """The rule run on each beam alone, as a chain with that beam's own draws (candidate w at depth j draws
    j*W + w), then the longest accepted beam kept: after rejecting one beam, the next is not tested against what
    remains of p, so tokens both beams reach are over-sampled."""
    num_rows, num_candidates, depth = ids.shape
    drafted = (lengths > 0)[..., None, None]  # [B, W, 1, 1]: a padding candidate (a row with fewer) has p = 0, so
    target_probs = torch.where(drafted, target_probs, target_probs[:, :1])  # its chain reads the first one's p
    chains = [
        rule(
            ids[:, w : w + 1],
            lengths[:, w : w + 1],
            draft_probs[:, w : w + 1],
            target_probs[:, w : w + 1],
            torch.cat([uniforms[:, w : depth * num_candidates : num_candidates], uniforms[:, -1:]], dim=1),
        )
        for w in range(num_candidates)
    ]
    reached = torch.stack([chain.num_accepted for chain in chains], dim=1).masked_fill(lengths == 0, -1)  # [B, W]
    path = reached.argmax(dim=1)  # [B] the first of the longest

    def by_candidate(name: str) -> torch.Tensor:  # [B, W, K] each chain's column side by side
        return torch.cat([getattr(chain, name) for chain in chains], dim=1)

    def on_path(name: str) -> torch.Tensor:  # [B] the kept beam's value
        return torch.stack([getattr(chain, name) for chain in chains], dim=1)[
            torch.arange(num_rows, device=path.device), path
        ]

    return CandidateVerdict(
        tested=by_candidate("tested"),
        accepted=by_candidate("accepted"),
        target_draft_probs=by_candidate("target_draft_probs"),
        draft_draft_probs=by_candidate("draft_draft_probs"),
        acceptance_probs=by_candidate("acceptance_probs"),
        uniforms=by_candidate("uniforms"),
        path=path,
        num_accepted=on_path("num_accepted"),
        next_token_ids=on_path("next_token_ids"),
        next_token_probs=on_path("next_token_probs"),
    )


PLANTED: dict[str, Callable[..., CandidateVerdict]] = {
    "resample from p": _resampling_from_p,
    "always accept": _always_accepting,
    "wrong q": _with_raw_q,
    "shared uniform": _with_one_uniform,
    "ReDrafter's rule, as released": _redrafter_released,
}


# --- the coupled rule's bugs: the noise read at the wrong positions ---------------------------------------------------

ROUND_STRIDE = MAX_NUM_DRAFT_TOKENS + 1  # "noise by round" gives each round this many positions of its own
COUPLED_BUGS = {
    "none": "the project's noise: G_t from the seed and the token's place t in the text alone",
    "noise by round": f"G indexed by the round and the depth in it (position round × {ROUND_STRIDE} + depth), not by "
    "the token's place in the text: each round is exact, but the text changes with K",
    "one noise vector": "one G (position 0's) serves every position: each token alone follows p, but tokens at "
    "different positions are correlated",
    "noise from the draft": "G at a drafted position is read at that position shifted by the drafted token's id: the "
    "drafter changes the text",
}
RULE_BUGS = {"standard": BUGS, "coupled": COUPLED_BUGS}  # SamplingConfig.rule -> the bugs planted in that rule

NoisePositions = Callable[[torch.Tensor, int, torch.Tensor, torch.Tensor], torch.Tensor]
"""(starts [B], n, round indices [B], drafts [B, n-1] padded with -1) -> [B, n] int64: the positions whose noise a
row's round reads."""


def _at_positions(starts: torch.Tensor, count: int, rounds: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    return starts[:, None] + torch.arange(count, device=starts.device)  # the rule: the tokens' places in the text


def _by_round(starts: torch.Tensor, count: int, rounds: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    return rounds[:, None] * ROUND_STRIDE + torch.arange(count, device=starts.device)


def _one_vector(starts: torch.Tensor, count: int, rounds: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    return torch.zeros(len(starts), count, dtype=torch.int64, device=starts.device)


def _shifted_by_draft(starts: torch.Tensor, count: int, rounds: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    shifts = torch.nn.functional.pad(drafts.clamp(min=0), (0, 1))  # [B, n]; no draft (the bonus, padding): no shift
    return _at_positions(starts, count, rounds, drafts) + shifts


NOISE_POSITIONS: dict[str, NoisePositions] = {
    "none": _at_positions,
    "noise by round": _by_round,
    "one noise vector": _one_vector,
    "noise from the draft": _shifted_by_draft,
}


def noise_for(bug: str) -> Noise:
    """The engine's noise itself (position_noise) for "none", else the coupled rule's noise with the named bug
    planted: BatchDecoder's `noise`."""
    if bug not in COUPLED_BUGS:
        raise ValueError(
            f"Unknown bug {bug!r} for the coupled rule: pick one of {', '.join(repr(b) for b in COUPLED_BUGS)}."
        )
    if bug == "none":
        return position_noise
    return functools.partial(_planted_noise, bug)


def _planted_noise(bug: str, ask: NoiseAsk) -> torch.Tensor:  # [n, V] float64
    """One row's noise with the bug planted: batch_noise for a batch of one."""
    assert len(ask.draft) < ask.count, f"a draft of {len(ask.draft)} tokens for {ask.count} positions"
    draft = torch.full((1, ask.count - 1), -1, dtype=torch.int64, device=ask.device)  # [1, n-1]
    draft[0, : len(ask.draft)] = torch.tensor(ask.draft, dtype=torch.int64, device=ask.device)

    def one(value: int) -> torch.Tensor:  # [1] int64
        return torch.tensor([value], dtype=torch.int64, device=ask.device)

    return batch_noise(bug, one(ask.seed), one(ask.start), ask.count, one(ask.round_index), draft, ask.vocab_size)[0]


def batch_noise(
    bug: str,
    seeds: torch.Tensor,  # [B] int64
    starts: torch.Tensor,  # [B] int64: each row's NoiseAsk.start
    count: int,  # n
    rounds: torch.Tensor,  # [B] int64: each row's NoiseAsk.round_index
    drafts: torch.Tensor,  # [B, n-1] int64: each row's NoiseAsk.draft, padded with -1
    vocab_size: int,
) -> torch.Tensor:  # [B, n, V] float64
    """noise_for(bug) for many rows at once, row b's as noise_for(bug) gives it for row b's NoiseAsk (the toy audit
    decides many rows' rounds together)."""
    return gumbel_noise(seeds, NOISE_POSITIONS[bug](starts, count, rounds, drafts), vocab_size)


def planted_rule(rule: str, bug: str) -> Rule:
    """The engine's rule named `rule` ("standard" or "coupled", SamplingConfig.rule) with the named bug planted: the
    rule BatchDecoder is given. With "none", the engine's own."""
    return CoupledRule(noise_for(bug)) if rule == "coupled" else StandardRule(verifier(bug))
