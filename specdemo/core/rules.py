"""Pure: the rules that decide a round, as objects. A row's rule comes from its SamplingConfig (`rule_for`): the
standard rule (modified rejection sampling, core/verify.py) or the coupled rule (same text for any drafter,
core/coupled.py). Each rule owns its randomness (the standard rule's counter-based draws, the coupled rule's noise),
its verdict, its trace for the inspector and its name on the page. The audit plants a bug by handing the engine a rule
built with a broken part (`StandardRule(verify=...)`, `CoupledRule(noise=...)`); a rule whose parts are the engine's
own is `captured`: the GPU's round program (core/chain_round.py) runs it on the device."""

# W = num_candidates, K = num_draft_tokens (the longest candidate), V = the vocabulary the rule runs on

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdemo.config import RULE_LABELS, SamplingConfig
from specdemo.core.coupled import Noise, NoiseAsk, position_noise, verify_coupled
from specdemo.core.fixed_rule import row_round_uniforms
from specdemo.core.match_chance import path_choices
from specdemo.core.rounds import CoupledChoice
from specdemo.core.verify import CandidateVerdict, Verify, verify_rows

if TYPE_CHECKING:  # rule_inputs.py names the rule its rows are decided by
    from specdemo.core.rule_inputs import RuleBatch


@dataclass(frozen=True)
class RuleAsk:
    """What a rule's randomness depends on for one row's round."""

    seed: int  # the row's stream seed
    draws: int  # draws of that stream used before this round
    start: int  # the position of the round's first decided token: the row's length
    round_index: int
    candidates: list[list[int]]  # the drafted candidates
    depth: int  # K: positions drafted, the longest candidate
    vocab_size: int  # V: the rule's vocabulary (a greedy row's V' tokens, or all)
    device: torch.device


@dataclass(frozen=True)
class StandardRule:
    """Modified rejection sampling over W candidates: a drafted token is accepted when u * q < p, u the row's counter
    draw for that test; after a rejection the next token comes from the residual norm(max(0, p - q))."""

    verify: Verify = verify_rows  # the audit plants its bugs around the engine's own function

    name = "standard"
    next_from_residual = True  # the inspector shows the residual of the candidates tried where the path stopped

    @property
    def captured(self) -> bool:
        return self.verify is verify_rows

    @property
    def label(self) -> str:
        return RULE_LABELS[self.name]

    def draws(self, ask: RuleAsk) -> tuple[torch.Tensor, torch.Tensor | None]:  # [K*W + 1] float64, None
        """The round's K*W + 1 counter draws (core/fixed_rule.py), and no noise."""
        draws = row_round_uniforms(ask.seed, ask.draws, ask.depth * len(ask.candidates))
        return torch.from_numpy(draws).to(ask.device), None

    def decide(self, batch: RuleBatch) -> CandidateVerdict:
        """The verdict on rows padded to one shape, by their draws."""
        return self.verify(
            batch.draft_token_ids, batch.draft_lengths, batch.draft_probs, batch.target_probs, batch.uniforms
        )

    def test_draws(self, verdict: CandidateVerdict) -> torch.Tensor:  # [B, W, K] float64
        """What decided each test: its uniform draw."""
        return verdict.uniforms

    def traced_draws(self, draws: list[float]) -> dict[str, list[float]]:
        """A candidate's test draws as its trace names them (CandidateTrace.uniforms)."""
        return {"uniforms": draws, "noise": []}

    def trace(self, *_: object) -> tuple[CoupledChoice, ...]:
        """The standard rule's tests are shown by their draws alone: no choices."""
        return ()


@dataclass(frozen=True)
class CoupledRule:
    """The coupled rule: y = argmax(log p + G) at each position, G the row's noise there from its seed and the
    position alone; a drafted token is accepted when it is y."""

    noise: Noise = position_noise  # the audit plants its noise bugs here

    name = "coupled"
    next_from_residual = False  # the next token is y, drawn from p itself

    @property
    def captured(self) -> bool:
        return self.noise is position_noise

    @property
    def label(self) -> str:
        return RULE_LABELS[self.name]

    def draws(self, ask: RuleAsk) -> tuple[torch.Tensor, torch.Tensor | None]:  # [K*W + 1] float64, [K+1, V]
        """No counter draws (zeros of the standard rule's shape), and the noise at the round's K+1 positions."""
        first = tuple(ask.candidates[0]) if ask.candidates else ()
        count = ask.depth + 1
        noise = self.noise(NoiseAsk(ask.seed, ask.start, count, ask.round_index, first, ask.vocab_size, ask.device))
        uniforms = torch.zeros(ask.depth * len(ask.candidates) + 1, dtype=torch.float64, device=ask.device)
        return uniforms, noise

    def decide(self, batch: RuleBatch) -> CandidateVerdict:
        """The verdict on rows padded to one shape, by their noise."""
        assert batch.noise is not None, "the coupled rule decides with its noise"
        return verify_coupled(
            batch.draft_token_ids, batch.draft_lengths, batch.draft_probs, batch.target_probs, batch.noise
        )

    def test_draws(self, verdict: CandidateVerdict) -> torch.Tensor:  # [B, W, K] float64
        """What decided each test: the noise G(d) of its token."""
        assert verdict.noise is not None, "the coupled rule's verdict names its noise"
        return verdict.noise

    def traced_draws(self, draws: list[float]) -> dict[str, list[float]]:
        """A candidate's tests' noise as its trace names it (CandidateTrace.noise); it draws no uniforms."""
        return {"uniforms": [], "noise": draws}

    def trace(
        self,
        target_probs: torch.Tensor,  # [K+1, V] p along the accepted path
        draft_probs: torch.Tensor,  # [W, K, V]
        noise: torch.Tensor | None,  # [K+1, V] float64
        candidates: list[list[int]],
        path: int,
        num_accepted: int,
        choices: list[int] | None,  # [K+1] y along the path (CandidateVerdict.choices)
    ) -> tuple[CoupledChoice, ...]:
        """y and x at each tested position of the path, with their scores, noise and match chances."""
        assert noise is not None and choices is not None, "the coupled rule's verdict names its noise and choices"
        return path_choices(target_probs, draft_probs, noise, candidates, path, num_accepted, choices)


Rule = StandardRule | CoupledRule

STANDARD = StandardRule()
COUPLED = CoupledRule()


def rule_for(sampling: SamplingConfig) -> Rule:
    """A row's rule: the coupled rule for a sampled row that asks for it, else the standard one (a greedy row's p is
    one-hot, and both rules then take the argmax)."""
    return COUPLED if sampling.is_coupled else STANDARD
