"""Pure: the record of one round of one row (what was drafted, tested, decided and emitted, and where its time went)
that the engine yields and the statistics, the page, the trace and the command line all read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from specdemo.core.inspection import PositionView
from specdemo.core.planning import Cut, Plan

NextKind = Literal["resampled", "bonus"]


@dataclass(frozen=True)
class CandidateTrace:
    """One candidate draft of a round and every test it met (lists run over its tokens)."""

    token_ids: list[int]
    target_probs: list[float]  # the remaining target probability of each token at its test (p(d) if untested)
    draft_probs: list[float]  # q(d)
    acceptance_probs: list[float]  # min(1, target / draft)
    uniforms: list[float]  # the test's draw: accepted when u * q < p
    tested: list[bool]
    accepted: list[bool]
    source: str = ""  # which drafter proposed it, where several did (the hybrid's "copy" or "head")
    noise: list[float] = field(default_factory=list)  # under the coupled rule, the noise G(d) of each token, which
    # decided its test (`uniforms` is then empty)


@dataclass(frozen=True)
class CoupledChoice:
    """One position of a coupled round's path (core/coupled.py): the target's token y = argmax(log p + G) and the
    drafted token x there, with the noise G that decided them; x is accepted when it is y."""

    target_id: int  # y
    target_score: float  # log p(y) + G(y), the largest at this position
    target_noise: float  # G(y)
    draft_id: int | None  # x, the path's token (where the path ended and a longer candidate on it was tested there,
    # that candidate's); None at the bonus position, where nothing was tested
    draft_score: float | None  # log p(x) + G(x): below the target's unless x is y
    draft_noise: float | None  # G(x)
    standard_chance: float | None  # 1 - TV(p, q): the chance the standard rule accepts x's candidate, drafted from q
    coupled_chance: float | None  # the chance that one of the num_alive candidates tested here matches y, at least
    coupled_chance_high: (
        float | None
    )  # and at most (core/match_chance.py's node_chances; p(x) for one deterministic draft)
    num_alive: int = 1  # candidates tested here (on the path so far, long enough): W at a sampling drafter's first
    # position, 1 past it; x matches y exactly when one of them does (else the path would be longer)


@dataclass(frozen=True)
class Round:
    """One draft proposal and one target verification pass of one row, with every number behind its outcome.

    With W candidates the path fields (draft_token_ids to uniforms) describe candidates[path], the candidate whose
    prefix was accepted. A pass shared by several rows counts in full for each: its seconds are the latency every
    row saw, and num_rows says how many rows shared it."""

    index: int
    draft_token_ids: list[int]  # the K proposed tokens (K may be 0: nothing to propose, a plain target step)
    target_probs: list[float]  # p(d_i) under the target, with the user's settings
    draft_probs: list[float]  # q(d_i), the probability the drafter sampled d_i with
    acceptance_probs: list[float]  # min(1, p(d_i) / q(d_i))
    uniforms: list[float]  # u_i; d_i was accepted when u_i * q(d_i) < p(d_i)
    num_accepted: int  # accepted drafts (drafts are cut after their first EOS before verification)
    next_token_id: int | None  # the resampled or bonus token; None when an accepted EOS ended the run
    next_kind: NextKind | None
    next_token_prob: float | None  # the target probability of next_token_id
    num_input_tokens: int  # tokens the target read for this row in this pass (the whole prompt in round 0)
    draft_seconds: float  # proposing, draft model forwards included
    verify_seconds: float  # the target forward pass
    other_seconds: float  # probabilities, rejection sampling and bookkeeping
    forward_seconds: float  # time inside model forward passes (draft and target), for the overhead figure
    candidates: tuple[CandidateTrace, ...] = ()  # all W candidates of the round
    path: int = 0  # the index of the accepted candidate in `candidates`
    num_rows: int = 1  # rows that shared the round's passes
    plan: Plan | None = None  # a cost-aware drafter's choice of how much to draft, with what it expected
    cut: Cut | None = None  # the draft cut for a pass shared with other rows
    views: tuple[PositionView, ...] = ()  # p, q and the residual at each tested position of the path (the inspector)
    coupled: tuple[CoupledChoice, ...] = ()  # the coupled rule's choice at each tested position of the path; () for
    # the standard rule
    noise: list[float] = field(default_factory=list)  # under the coupled rule, the noise G(d_i) that decided each
    # test (`uniforms` is then empty)

    @property
    def emitted_token_ids(self) -> list[int]:
        accepted = self.draft_token_ids[: self.num_accepted]
        return accepted if self.next_token_id is None else [*accepted, self.next_token_id]

    @property
    def wall_seconds(self) -> float:
        return self.draft_seconds + self.verify_seconds + self.other_seconds


NOTHING_DRAFTED = CandidateTrace([], [], [], [], [], [], [])  # the path of a round with no candidate (a target step)
