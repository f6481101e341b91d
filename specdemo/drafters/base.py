"""The drafter seam: what a drafter is asked (DraftRequest) and answers (Draft), the protocol every drafter follows, and
what describes a kind of drafter (DrafterKind): its options, and how to build one from them."""

# R = rows asking for drafts, W = num_candidates, K = num_draft_tokens, T = sequence length, V = vocab_size

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers import PreTrainedModel

from specdemo.config import MAX_NUM_CANDIDATES, MAX_NUM_DRAFT_TOKENS, SamplingConfig, check_int
from specdemo.core.planning import PassCosts, Plan


@dataclass(frozen=True)
class DraftRequest:
    """One row's ask: up to `num_candidates` drafts of up to `num_draft_tokens` tokens continuing its sequence."""

    key: Hashable  # the row, stable while it decodes (a drafter with a cache keeps the row's cache under it)
    sequence_ids: list[int]  # prompt and emitted tokens
    num_draft_tokens: int
    num_candidates: int
    sampling: SamplingConfig  # what a draft model samples with for this row
    generator: torch.Generator  # the row's own, for a drafter of one's own to draw from; the built-in ones draw
    # by counter from `seed` (core/fixed_rule.draft_uniforms), the same on every path
    hidden_state: torch.Tensor | None = None  # [len(layers) * H] the target's hidden states at the last accepted
    # position (the `hidden_layers` it reads, concatenated), for a drafter that `reads_hidden_state`; None before the
    # row's first target pass
    seed: int = 0  # the row's stream seed: under the coupled rule (sampling.is_coupled) a drafter that samples draws
    # token t as argmax(log q_t + G_t) with core/coupled.py's noise at the token's position, and else with the
    # row's drafting draws (core/fixed_rule.draft_uniforms)

    def __post_init__(self) -> None:  # every drafter may rely on these limits (a head counts by draft position)
        check_int("num-draft-tokens", self.num_draft_tokens, 0, MAX_NUM_DRAFT_TOKENS)
        check_int("num-candidates", self.num_candidates, 1, MAX_NUM_CANDIDATES)


@dataclass(frozen=True)
class Draft:
    """A row's W candidates and q, the exact distributions their tokens were drawn from (after every filter)."""

    token_ids: Sequence[list[int]]  # W candidates of at most K tokens; W may be 0 when there is nothing to propose;
    # core/verdicts.DeviceIds where a captured program drafted them and the round program reads them on the device
    probs: torch.Tensor | None  # [W, K, V] float32 (V the target's); None: deterministic, q one-hot on the tokens
    forward_seconds: float = 0.0  # time in the drafter's forward passes, shared by the rows drafted together
    plan: Plan | None = None  # how much a cost-aware drafter chose to draft, and what it expected of it
    chances: list[list[float]] | None = None  # [W][K] its estimate that each token is accepted given its prefix
    sources: list[str] | None = None  # [W] which drafter proposed each candidate, where several did (the hybrid)


class Drafter(Protocol):
    """Proposes candidates for every row that asks, in one go, so a draft model runs one pass per step for all."""

    def propose(self, requests: list[DraftRequest]) -> list[Draft]: ...

    def forget(self, key: Hashable) -> None:
        """The row left the batch: drop whatever is kept for it."""


def reads_hidden_state(drafter: Drafter) -> bool:
    """Whether the engine must hand the drafter each row's last hidden state (a drafter says so with a class attribute
    `reads_hidden_state = True`; the verification pass computes the states anyway)."""
    return bool(getattr(drafter, "reads_hidden_state", False))


def hidden_layers(drafter: Drafter) -> tuple[int, ...]:
    """Which of the target's hidden states the drafter reads, concatenated in this order: indices into Hugging Face's
    `hidden_states` (0 the embeddings, i the output of layer i, -1 the final normed state the LM head reads). A drafter
    that reads more than the final one says so with an attribute `hidden_layers`; () for one that reads none."""
    if not reads_hidden_state(drafter):
        return ()
    return tuple(getattr(drafter, "hidden_layers", (-1,)))


class NoDrafter:
    """Proposes nothing: every round is one target step, which is target-only decoding."""

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        return [Draft([], None) for _ in requests]

    def forget(self, key: Hashable) -> None:
        pass


@dataclass(frozen=True)
class DraftingContext:
    """What a drafter may use, handed over by whoever builds it (engine.drafting): nothing a drafter imports."""

    vocab_size: int  # the target's V: the last dimension of every draft distribution
    pass_costs: Callable[[int], PassCosts]  # the target's t(n) / t(1) on this device, for passes up to n tokens
    draft_model: PreTrainedModel | None = None  # a draft model's weights, for drafters that run one
    target_model: PreTrainedModel | None = None  # the target's weights, for a head that reads its embeddings
    target_name: str = ""  # the target's name, which names the head trained for it


@dataclass(frozen=True)
class DrafterKind:
    """A kind of drafter that needs no model of its own: a pair, the command line's --draft and the app's drafter
    field name it; its options dataclass makes its flags and its page controls."""

    name: str
    label: str  # what tables call it
    description: str
    options: type  # a frozen dataclass of `config.setting` fields, validated in __post_init__ (config.check_settings)
    build: Callable[[Any, DraftingContext], Drafter]  # (options, context) -> a fresh drafter, whose state is its own
    cost_aware: bool = False  # plans with the target's pass costs, which are measured when its pair loads
