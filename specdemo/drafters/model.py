"""A draft model: a smaller model sharing the target's tokenizer, sampling W beams per row through a tree KV cache, or
on fixed-shape passes as one program a round (drafters/model_steps.py)."""

# R = rows asking for drafts, W = num_candidates, K = num_draft_tokens, V = vocab_size

from __future__ import annotations

from collections.abc import Hashable

import torch
from transformers import PreTrainedModel

from specdemo.config import SamplingConfig
from specdemo.core.coupled import coupled_choice, coupled_top, row_noise
from specdemo.core.fixed_rule import draft_uniforms
from specdemo.core.sampling import build_warpers, logits_to_probs
from specdemo.core.verify import choose_draft_tokens
from specdemo.drafters.base import Draft, DraftRequest
from specdemo.drafters.model_steps import ModelSteps
from specdemo.models.passes import uses_fixed_shape
from specdemo.models.tree_cache import RowRequest, TreeCachedModel


class ModelDrafter:
    """A smaller model sharing the target's tokenizer. Each step feeds every row's W beams in one pass (a tree on the
    row's cache) and samples each beam's next token from its own draw: W i.i.d. drafts, q recorded per token. On
    fixed-shape passes, the K steps of the rows without a repetition penalty are one program (ModelSteps)."""

    def __init__(self, model: PreTrainedModel, sampling: SamplingConfig | None, vocab_size: int) -> None:
        self.cached = TreeCachedModel(model)
        self.sampling = sampling  # None: each row's own draft settings; q is whatever the draft really sampled from
        self.vocab_size = vocab_size  # the target's: a larger padded draft embedding is cut, a smaller one padded
        self.readable = model.get_input_embeddings().weight.shape[0]  # ids the draft has an embedding row for
        own = (getattr(model.config, "pad_token_id", None), getattr(model.config, "eos_token_id", None))
        self.stand_in = next((i for i in own if isinstance(i, int) and 0 <= i < self.readable), 0)  # read in place of
        # an id past them (a larger target's padding rows)
        self.steps: ModelSteps | None = None  # made at the first round on fixed-shape passes

    def readable_ids(self, token_ids: list[int]) -> list[int]:
        """The sequence as the draft reads it: an id it has no embedding row for becomes its stand-in (q stays what
        the draft sampled from, so the rule stays exact; the draft only reads a slightly different context)."""
        return [token if token < self.readable else self.stand_in for token in token_ids]

    def forget(self, key: Hashable) -> None:
        self.cached.drop(key)
        if self.steps is not None:
            self.steps.forget(key)

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        """Every row's draft: on fixed-shape passes, the K steps of the rows that draft in one program a group
        (ModelSteps); on tree passes, a pass a step for all rows."""
        if not uses_fixed_shape(self.cached.device):
            return self._tree_steps(requests)
        drafting = [r for r in requests if r.num_draft_tokens]
        if not drafting:
            return [Draft([[] for _ in range(r.num_candidates)], None) for r in requests]
        self.steps = self.steps or ModelSteps(self.cached.model, self.vocab_size)
        samplings = [self.sampling or r.sampling for r in drafting]
        drafts = iter(self.steps.propose(drafting, samplings, [self.readable_ids(r.sequence_ids) for r in drafting]))
        return [
            next(drafts) if r.num_draft_tokens else Draft([[] for _ in range(r.num_candidates)], None) for r in requests
        ]

    def _tree_steps(self, requests: list[DraftRequest]) -> list[Draft]:
        """The rows' K steps in tree passes on the rows' caches, a pass a step for all rows."""
        beams = [[[] for _ in range(r.num_candidates)] for r in requests]  # per row, W lists of drafted tokens
        probs: list[list[torch.Tensor]] = [[] for _ in requests]  # per row, K x [W, V]
        forward_before = self.cached.forward_seconds
        samplings = [self.sampling or r.sampling for r in requests]
        sequences = [self.readable_ids(r.sequence_ids) for r in requests]
        warpers = [build_warpers(sampling) for sampling in samplings]  # once per row, not per step
        drawn = [_draws(r, self.cached.device) for r in requests]  # [W, K] each: the rows' drafting draws
        for step in range(max((r.num_draft_tokens for r in requests), default=0)):
            drafting = [i for i, r in enumerate(requests) if step < r.num_draft_tokens]
            logits = self.cached.logits(
                {requests[i].key: RowRequest(sequences[i], beams[i] if step else [], "tips") for i in drafting}
            )  # per row [W, V] after each beam (or [1, V] after the sequence at the first step)
            step_probs, uniforms = [], []
            for i, row_logits in zip(drafting, logits, strict=True):
                contexts = torch.tensor([sequences[i] + beam for beam in beams[i]], device=row_logits.device)
                row_probs = logits_to_probs(  # [W, 1, V_draft] -> [W, V], q = 0 for the target's extra ids
                    row_logits[:, None, : self.vocab_size].expand(len(beams[i]), 1, -1),
                    contexts,
                    samplings[i],
                    warpers[i],
                )[:, 0]
                step_probs.append(torch.nn.functional.pad(row_probs, (0, self.vocab_size - row_probs.shape[-1])))
                uniforms.append(drawn[i][: len(beams[i]), step].to(row_logits.device))
            tokens = choose_draft_tokens(  # [R, W]: every beam of every row in one vmapped call
                torch.nn.utils.rnn.pad_sequence(step_probs, batch_first=True, padding_value=1.0),
                torch.nn.utils.rnn.pad_sequence(uniforms, batch_first=True),
            )
            for row, i in enumerate(drafting):  # the coupled rule's rows draw with the noise instead
                if requests[i].sampling.is_coupled and not samplings[i].is_greedy:
                    chosen = _coupled_tokens(requests[i], step, step_probs[row])  # [W'] W' <= W: ids with q > 0
                    del beams[i][len(chosen) :]  # fewer beams where q allows fewer first tokens
                    step_probs[row] = step_probs[row][: len(chosen)]
                    tokens[row, : len(chosen)] = chosen
            for row, i in enumerate(drafting):
                for w, beam in enumerate(beams[i]):
                    beam.append(int(tokens[row, w]))
                probs[i].append(step_probs[row])
        forward_seconds = self.cached.forward_seconds - forward_before
        return [
            Draft(
                row_beams,
                None if not row_probs or sampling.is_greedy else torch.stack(row_probs, dim=1),
                forward_seconds,
            )  # [W, K, V]
            for sampling, row_beams, row_probs in zip(samplings, beams, probs, strict=True)
        ]


def _coupled_tokens(request: DraftRequest, step: int, probs: torch.Tensor) -> torch.Tensor:  # probs [W, V] -> [W']
    """A coupled row's beams at a step: the W best of log q + G at the first (W distinct tokens with q > 0, fewer
    where q allows fewer; the first the target's own choice where q is p), then each beam's argmax of log q + G, G the
    noise of the token's position."""
    position = len(request.sequence_ids) + step
    noise = row_noise([request.seed], [position], 1, probs.shape[-1], probs.device)[0, 0]  # [V]
    if step == 0:
        ids, live = coupled_top(probs[0], noise, probs.shape[0])  # [W] each; the live ones come first
        return ids[live]
    return coupled_choice(probs, noise)


def _draws(request: DraftRequest, device: torch.device) -> torch.Tensor:  # [W, K] float64
    """A row's drafting draws for its round, beam w's at row w (core/fixed_rule.draft_uniforms, as the fixed-shape
    program draws them)."""
    width = request.num_candidates
    seeds = torch.full((width,), request.seed, dtype=torch.int64, device=device)
    starts = torch.full((width,), len(request.sequence_ids), dtype=torch.int64, device=device)
    return draft_uniforms(seeds, starts, torch.arange(width, device=device), request.num_draft_tokens)
