"""Pure: what the engine asks its verifier about one row's round (`RoundAsk`), and what the verifier answers, in one
form whatever decided it, tree passes and the eager rule or the GPU's captured round (`RowVerdict`, or `Overflowed`
where the row's numbers left their format's range). The engine turns a verdict into a Round in one place
(engine/decoding.py)."""

# W = num_candidates, K = num_draft_tokens (the longest candidate), V = vocab_size, F = the hidden features a drafter
# reads (the chosen layers' hidden states side by side)

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdemo.config import SamplingConfig
from specdemo.core.inspection import PositionView
from specdemo.core.rounds import CandidateTrace, CoupledChoice
from specdemo.core.rules import Rule


@dataclass(frozen=True)
class RoundAsk:
    """One row's round: its sequence, its drafted candidates (cut after an EOS) and how to decide them."""

    trunk_ids: list[int]  # the row's sequence so far
    candidates: list[list[int]]  # W candidates of at most K tokens; [] when nothing was drafted
    capacity: int  # the most tokens the row will hold (its prompt and max_new_tokens)
    sampling: SamplingConfig
    rule: Rule
    seed: int  # the row's stream seed (the standard rule's draws, the coupled rule's noise)
    draws: int  # draws of that stream used before this round
    round_index: int
    draft_probs: torch.Tensor | None = None  # [W, K, V] q each token was drafted from; None: deterministic drafts
    views: bool = True  # the inspector's entries are read (rows that draft); target-only rows read none
    sources: tuple[str, ...] = ()  # which drafter proposed each candidate, where several did
    eos_token_ids: frozenset[int] = frozenset()  # no token follows an accepted EOS

    def next_follows(self, path: int, num_accepted: int) -> bool:
        """A next token follows the accepted tokens: they do not end with an EOS (drafts end at their first one)."""
        return not (num_accepted and self.candidates[path][num_accepted - 1] in self.eos_token_ids)


@dataclass(frozen=True)
class RowVerdict:
    """What the rule decided for one row, as plain numbers: every candidate's tests, the accepted path and the next
    token, with the inspector's entries and what the verifier read."""

    candidates: tuple[CandidateTrace, ...]  # one per candidate; () when nothing was drafted
    path: int  # the candidate whose prefix was accepted
    num_accepted: int
    next_token_id: int  # the resampled or bonus token
    next_token_prob: float  # p(next token) at its node
    views: tuple[PositionView, ...] = ()  # p, q and the residual at each tested position of the path
    choices: tuple[CoupledChoice, ...] = ()  # the coupled rule's y and x at each tested position; () otherwise
    num_input_tokens: int = 0  # tokens the target read for this row in this pass
    hidden_state: torch.Tensor | None = None  # [F] where the next round's logits were read, for a drafter that reads it


@dataclass(frozen=True)
class Overflowed:
    """A row whose round read inf or NaN: the first such column of the target's logits and of q (None: finite)."""

    target_column: int | None
    draft_column: int | None
