"""The recurrent drafter: a RecurrentHead's W candidates per row from the target's hidden states (beam search for greedy
rows, W sampled beams else, q = 0 outside the head's sub-vocabulary so the rule stays exact) and each row's chances."""

# R = rows asking for drafts, W = num_candidates, K = num_draft_tokens, F = the target's states the head reads,
# V = the target's vocab_size

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace

import torch

from specdemo.config import MAX_NUM_DRAFT_TOKENS
from specdemo.core.coupled import row_noise
from specdemo.core.verdicts import DeviceIds, candidate_lengths
from specdemo.drafters.base import Draft, DraftRequest
from specdemo.drafters.head import RecurrentHead
from specdemo.drafters.head_steps import step_settings, steps_for


@dataclass(frozen=True)
class RecurrentOptions:
    """None yet: the head's shape is its file's, and W and K are the run's."""


class RecurrentDrafter:
    """Drafts with a RecurrentHead from each row's hidden state (DraftRequest.hidden_state, which the engine fills
    because `reads_hidden_state`); a row without one yet (its first round) gets no draft. Sampled rows draw W
    i.i.d. sequences, greedy rows get beam search's W best. It counts how often each row's tokens are accepted at
    each draft position (the head's held-out figures as a prior), which is the chance it tells the planner: a row's
    chances, and so what the hybrid keeps of its drafts, are its own, the same in any batch."""

    reads_hidden_state = True
    PRIOR_WEIGHT = 20.0  # the prior counts as this many tested tokens at each position

    def __init__(self, head: RecurrentHead, vocab_size: int) -> None:
        self.head = head
        self.hidden_layers = head.shape.layers  # what the engine hands it (drafters.base.hidden_layers)
        self.vocab_size = vocab_size
        prior = list(head.trained.get("held_out_alpha") or [0.5])
        self.prior = [prior[min(k, len(prior) - 1)] for k in range(MAX_NUM_DRAFT_TOKENS)]  # K <= MAX_NUM_DRAFT_TOKENS
        self.counts: dict[Hashable, tuple[list[float], list[float]]] = {}  # per row and position: tested, accepted
        self.last: dict[Hashable, tuple[int, list[list[int]]]] = {}  # per row: its length then, and its candidates
        self.steps = steps_for(head, vocab_size)  # its K steps (as programs where the target's rounds are), per head

    def forget(self, key: Hashable) -> None:
        self.last.pop(key, None)
        self.counts.pop(key, None)

    def _counts(self, key: Hashable) -> tuple[list[float], list[float]]:
        """The row's tested and accepted tokens by draft position, the prior counting as PRIOR_WEIGHT of each."""
        if key not in self.counts:
            tested = [self.PRIOR_WEIGHT] * MAX_NUM_DRAFT_TOKENS
            self.counts[key] = (tested, [self.PRIOR_WEIGHT * alpha for alpha in self.prior])
        return self.counts[key]

    def alpha(self, key: Hashable, depth: int) -> list[float]:
        """The estimated chance that the row's token at each draft position is accepted, given its prefix was."""
        tested, accepted = self._counts(key)
        return [accepted[k] / tested[k] for k in range(depth)]

    def learn(self, request: DraftRequest) -> None:
        """The tokens emitted since the row's last draft against its candidates: the longest match was accepted
        (a rejected token is never emitted in its place, as its residual is 0). Once per draft: propose calls it."""
        if request.key not in self.last:
            return
        length, candidates = self.last.pop(request.key)
        emitted = request.sequence_ids[length:]
        matches = [_common_prefix(candidate, emitted) for candidate in candidates]
        best = max(range(len(candidates)), key=matches.__getitem__)
        tested, accepted = self._counts(request.key)
        for k in range(min(matches[best] + 1, len(candidates[best]))):
            tested[k] += 1
            accepted[k] += k < matches[best]

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        started = time.perf_counter()
        for request in requests:
            self.learn(request)
        drafts = {i: Draft([], None) for i, r in enumerate(requests) if r.hidden_state is None}
        ready = [i for i in range(len(requests)) if i not in drafts]
        groups: dict[tuple[str, int, int], list[int]] = {}  # rows drafted together: same way, W and K
        for i in ready:
            r = requests[i]
            way = "greedy" if r.sampling.is_greedy else "coupled" if r.sampling.is_coupled else "sampled"
            groups.setdefault((way, r.num_candidates, r.num_draft_tokens), []).append(i)
        for (way, width, depth), rows in groups.items():
            drafts.update(zip(rows, self._draft([requests[i] for i in rows], way, width, depth), strict=True))
        seconds = time.perf_counter() - started
        for i in ready:
            self.last[requests[i].key] = (len(requests[i].sequence_ids), drafts[i].token_ids)
        return [
            replace(self.with_chances(requests[i].key, d), forward_seconds=seconds) if d.token_ids else d
            for i, d in sorted(drafts.items())
        ]

    def with_chances(self, key: Hashable, draft: Draft) -> Draft:
        """The draft with the row's chance for each of its tokens: they depend on the positions, not the tokens."""
        chances = [self.alpha(key, length) for length in candidate_lengths(draft.token_ids)]
        first = sum(candidate[0] for candidate in chances)
        for candidate in chances:  # W candidates' first tokens cannot together be accepted more than once
            candidate[0] /= max(1.0, first)
        return replace(draft, chances=chances)

    def _draft(self, requests: list[DraftRequest], way: str, width: int, depth: int) -> list[Draft]:
        """The rows' K steps (head_steps.py: one program where the target's rounds replay graphs, whose drafts stay on
        the device for the round's; the coupled rule's run as they are)."""
        states = [r.hidden_state for r in requests]
        if way == "coupled":
            return self._coupled(requests, torch.stack(states).to(self.head.output_rows.dtype), width, depth)
        settings = step_settings(requests)
        on_device = self.steps.on_device(states[0].device)
        if way == "greedy":
            ids = self.steps.greedy(states, settings, min(width, len(self.head.vocabulary)), depth)
            return [Draft(_drafted(row, on_device), None) for row in ids]
        ids, probs = self.steps.sampled(states, settings, width, depth)
        return [Draft(_drafted(row, on_device), row_probs) for row, row_probs in zip(ids, probs, strict=True)]

    def _coupled(self, requests: list[DraftRequest], states: torch.Tensor, width: int, depth: int) -> list[Draft]:
        """The coupled rule's beams: argmax(log q + G) with the row's noise, W distinct first tokens, read back."""
        tokens = torch.tensor([r.sequence_ids[-1] for r in requests], device=states.device)  # [R]
        temperatures = torch.tensor([r.sampling.temperature for r in requests], device=states.device)
        starts = [len(r.sequence_ids) for r in requests]
        noise = row_noise([r.seed for r in requests], starts, depth, self.vocab_size, states.device)  # [R, K, V]
        ids, probs, live = self.head.coupled_beams(
            states, tokens, noise[..., self.head.vocabulary], temperatures, min(width, len(self.head.vocabulary))
        )
        full = probs.new_zeros(*probs.shape[:-1], self.vocab_size)  # [R, W, K, V]
        full[..., self.head.vocabulary] = probs
        counts = live.sum(dim=1).tolist()  # [R] live beams come first: q allows fewer than W where top-k < W
        return [Draft(row[:n], row_probs[:n]) for row, row_probs, n in zip(ids.tolist(), full, counts, strict=True)]


def _drafted(ids: torch.Tensor, on_device: bool) -> Sequence[list[int]]:  # [W, K] float32
    """A row's candidates: left on the device for the round program, or read here."""
    return DeviceIds(ids) if on_device else ids.long().tolist()


def _common_prefix(first: list[int], second: list[int]) -> int:
    length = 0
    while length < min(len(first), len(second)) and first[length] == second[length]:
        length += 1
    return length
