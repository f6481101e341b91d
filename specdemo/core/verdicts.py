"""Pure: what the engine asks its verifier about one row's round (`RoundAsk`), and what the verifier answers, in one
form whatever decided it, tree passes and the eager rule or the GPU's captured round (`RowVerdict`, or `Overflowed`
where the row's numbers left their format's range). The engine turns a verdict into a Round in one place
(engine/decoding.py)."""

# W = num_candidates, K = num_draft_tokens (the longest candidate), V = vocab_size, F = the hidden features a drafter
# reads (the chosen layers' hidden states side by side)

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from specdemo.config import SamplingConfig
from specdemo.core.inspection import PositionView
from specdemo.core.rounds import CandidateTrace, CoupledChoice
from specdemo.core.rules import Rule


class DeviceIds(Sequence[list[int]]):
    """A draft's W candidates of K tokens still on the device, as a drafter's captured program left them ([W, K]
    float32 or float64: ids below 2**24 are exact in either): a round program reads them there, so the host never
    waits for them before the round. The host reads them at most once: from the round's own read-back (`known`), or,
    where something on the host needs them first, with one read (a wait) at its first use. `on_known` callbacks run
    once, with the ids."""

    def __init__(self, ids: torch.Tensor) -> None:  # [W, K]
        self.tensor = ids
        self.host: list[list[int]] | None = None
        self.on_known: list[Callable[[list[list[int]]], None]] = []

    @property
    def lengths(self) -> list[int]:
        """Each candidate's length, read from the shape alone."""
        return [self.tensor.shape[1]] * self.tensor.shape[0]

    def known(self, ids: list[list[int]]) -> None:
        """The ids, read back by whoever read them first."""
        if self.host is None:
            self.host = ids
            for callback in self.on_known:
                callback(ids)

    def __len__(self) -> int:
        return self.tensor.shape[0]

    def __eq__(self, other: object) -> bool:  # as the list of the ids (read once)
        return list(self) == other

    __hash__ = None  # type: ignore[assignment]  # as a list's

    def __getitem__(self, index):  # type: ignore[override]  # what a list of the ids gives
        if self.host is None:
            self.known([[int(token) for token in row] for row in self.tensor.tolist()])
        assert self.host is not None
        return self.host[index]


def candidate_lengths(candidates: Sequence[list[int]]) -> list[int]:
    """Each candidate's length, without reading ids still on the device."""
    return candidates.lengths if isinstance(candidates, DeviceIds) else [len(c) for c in candidates]


def eos_cut(token_ids: list[int], eos_token_ids: frozenset[int]) -> int:
    """How many tokens to keep: up to and including the first EOS, since nothing after an EOS is emitted."""
    for position, token in enumerate(token_ids):
        if token in eos_token_ids:
            return position + 1
    return len(token_ids)


@dataclass(frozen=True)
class RoundAsk:
    """One row's round: its sequence, its drafted candidates (cut after an EOS) and how to decide them."""

    trunk_ids: list[int]  # the row's sequence so far
    candidates: Sequence[list[int]]  # W candidates of at most K tokens; [] when nothing was drafted; DeviceIds: on
    # the device, not cut after an EOS yet (on_host cuts them)
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

    def on_host(self) -> RoundAsk:
        """The ask with its candidates on the host, cut after their first EOS (what the eager rule reads)."""
        if not isinstance(self.candidates, DeviceIds):
            return self
        cut = [c[: eos_cut(c, self.eos_token_ids)] for c in self.candidates]
        probs = None if self.draft_probs is None else self.draft_probs[:, : max(map(len, cut), default=0)]
        return replace(self, candidates=cut, draft_probs=probs)

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
