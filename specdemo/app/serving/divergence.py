"""Where a speculative run's text first parts from the target alone's, for the runs that must agree token for token
(greedy, and sampled under the coupled rule): the token, how near the target's top two were there, and whether a
differing token falls on different sides of top-k or top-p in the two runs' passes, replayed."""

# T = prompt length, V = vocab_size, W = a round's candidates, K = its longest

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from specdemo.app.serving.runs import Run, decode_fn
from specdemo.app.views.render import token_text
from specdemo.app.views.same_text import CutoffCrossing, Divergence, first_difference
from specdemo.config import SamplingConfig
from specdemo.core.coupled import NoiseAsk, coupled_scores, position_noise
from specdemo.core.cutoff import crossed_cutoff, cutoff_names, cutoff_place
from specdemo.core.rounds import Round
from specdemo.core.sampling import build_warpers, logits_to_probs, penalised_scores
from specdemo.core.stats import emitted_ids
from specdemo.engine.decoding import stream_seed
from specdemo.engine.resources import openmp_workers_released
from specdemo.models.layout import RowRequest
from specdemo.models.passes import verifier_for

PASS_KEY = "divergence"  # the one row of the passes replayed here, on a cache of their own
NO_LOCK = nullcontext()  # where no other run's passes share the model (a test, a script)


@dataclass(frozen=True)
class PassShapes:
    """The target's logits for the first differing token as each run computed them, from its passes replayed."""

    one_token: torch.Tensor  # [V] the target alone's: one token a pass
    one_token_width: int  # tokens its pass read (1; the prompt's length at the first generated token)
    wide: torch.Tensor  # [V] the speculative run's: the pass of the round that emitted the token, all its drafts
    wide_width: int  # tokens that pass read (K+1; more with W candidates, or with the prompt in a row's first round)


def divergence(run: Run, rounds: list[Round], baseline: list[Round]) -> Divergence | None:
    """Where a greedy run's tokens, or a coupled sampled run's, first differ from the target alone's (None where one
    run's tokens begin the other's), explained from both runs' passes up to that token, replayed (only when they
    differ: about as long as those passes took to decode, each pass taking its turn among other runs' passes)."""
    if first_difference(emitted_ids(rounds), emitted_ids(baseline)) is None:
        return None
    capacity = len(run.prompts[0]) + run.request.speculative.max_new_tokens  # as the engine sizes the row
    with openmp_workers_released():  # a Gradio worker thread: it lives on, idle
        return divergence_of(
            run.target.model,
            run.prompts[0],
            rounds,
            baseline,
            run.request.sampling,
            decode_fn(run.target),
            capacity,
            run.schedulers.models_lock,
        )


@torch.inference_mode()
def divergence_of(
    model: PreTrainedModel,
    prompt_ids: list[int],
    rounds: Sequence[Round],  # the speculative run's
    baseline: Sequence[Round],  # the target alone's
    sampling: SamplingConfig,
    decode: Callable[[list[int]], str],
    capacity: int = 0,  # the row's prompt and max_new_tokens (fixed-shape passes size its slots by it); 0: not known
    lock: AbstractContextManager[object] = NO_LOCK,  # taken for each pass: other runs' passes wait for it
) -> Divergence | None:
    """`divergence` for a model, a prompt and both runs' rounds: the target's top two at the first differing token
    (logits; for a coupled run log p + G, its noise G) as the target alone computed them, and, for a coupled run
    with top-k or top-p, where each differing token stands against them in each run's pass."""
    speculative_ids, target_ids = emitted_ids(rounds), emitted_ids(baseline)
    first = first_difference(speculative_ids, target_ids)
    if first is None:
        return None
    context = [*prompt_ids, *target_ids[:first]]
    context_ids = torch.tensor([context], device=model.device)  # [1, T + first]
    one_token, one_width = replayed_logits(model, prompt_ids, baseline, first, capacity, lock)  # [V]
    wide, wide_width = replayed_logits(model, prompt_ids, rounds, first, capacity, lock)  # [V]
    shapes = PassShapes(one_token, one_width, wide, wide_width)
    scores, probs = argmax_scores(one_token, context, sampling)  # [V] each, as the target alone decided
    top_ids = scores.topk(2).indices  # [2]
    top_scores, top_probs = scores[top_ids], probs[top_ids]  # [2] each
    differing = (speculative_ids[first], target_ids[first])
    cutoffs = cutoff_names(sampling) if sampling.is_coupled else ""  # greedy runs take the argmax: no cut-off
    crossings = cutoff_crossings(shapes, context_ids, differing, sampling, decode) if cutoffs else ()
    alone_lead = differing_lead(shapes.one_token, context, differing[::-1], sampling)  # the alone's token ahead
    wide_lead = differing_lead(shapes.wide, context, differing, sampling)  # the speculative run's token ahead
    return Divergence(
        position=first + 1,
        speculative_text=token_text(decode, context, differing[0]),
        target_text=token_text(decode, context, differing[1]),
        top2_logit_gap=float(top_scores[0] - top_scores[1]),
        top2_probs=(float(top_probs[0]), float(top_probs[1])),
        dtype=str(model.dtype).removeprefix("torch."),
        temperature=sampling.temperature,
        cutoffs=cutoffs,
        crossings=crossings,
        leads=(alone_lead, wide_lead, shapes.one_token_width, shapes.wide_width),
    )


def differing_lead(
    logits: torch.Tensor,  # [V] one run's logits for the differing token
    context: list[int],  # the shared prefix
    token_ids: tuple[int, int],  # (the token this run emitted, the other run's)
    sampling: SamplingConfig,
) -> float:
    """How far this run's token led the other run's in this run's pass, in what the run took the argmax of: > 0 where
    the pass chose as the run did."""
    scores, _ = argmax_scores(logits, context, sampling)  # [V]
    return float(scores[token_ids[0]] - scores[token_ids[1]])


def argmax_scores(
    logits: torch.Tensor,  # [V] the target's logits after the shared prefix
    context: list[int],  # the shared prefix
    sampling: SamplingConfig,
) -> tuple[torch.Tensor, torch.Tensor]:  # [V] each: what the run takes the argmax of, and p
    """A coupled run's log p + G (its noise G at this position), or a greedy run's logits after the penalty; with p."""
    context_ids = torch.tensor([context], device=logits.device)  # [1, T + first]
    if sampling.is_coupled:
        probs = logits_to_probs(logits[None, None], context_ids, sampling, build_warpers(sampling))[0, 0]  # [V]
        ask = NoiseAsk(noise_seed(sampling, logits.device), len(context), 1, 0, (), len(logits), logits.device)
        return coupled_scores(probs, position_noise(ask)[0]), probs
    scores = penalised_scores(logits[None, None], context_ids, sampling)[0, 0]  # [V]
    return scores, scores.softmax(dim=-1)


def replayed_logits(
    model: PreTrainedModel,
    prompt_ids: list[int],
    rounds: Sequence[Round],
    index: int,
    capacity: int = 0,
    lock: AbstractContextManager[object] = NO_LOCK,  # taken for each pass, so other runs' passes go on between
) -> tuple[torch.Tensor, int]:  # [V], the tokens that pass read
    """The target's logits for generated token `index` as the run of `rounds` computed them: its passes replayed in
    order, each round's sequence and candidates asked as the engine asked them, on a cache of the device's own kind
    (models/passes.py), up to the round that emitted the token. Not one pass over the shared prefix: a prefix read in
    one pass leaves other bits in the cache than the rounds that built it, and in bfloat16 those bits move the
    logits by whole steps. The replay is of the row alone, reading its prompt in its first round, as the runs the page
    explains were decoded: their passes shared with no other row (a row that joined a running batch read its prompt
    in a pass of its own)."""
    passes, sequence, start = verifier_for(model), list(prompt_ids), 0
    try:
        for round_ in rounds:
            candidates = [list(c.token_ids) for c in round_.candidates]  # what the round's pass verified
            if not candidates and round_.draft_token_ids:  # a round recorded without its candidates
                candidates = [list(round_.draft_token_ids)]
            with lock:  # the replay's cache is its own; the model's passes take turns
                logits = passes.logits({PASS_KEY: RowRequest(sequence, candidates, "all", capacity)})[0]  # [W, K+1, V]
            emitted = round_.emitted_token_ids
            if start + len(emitted) > index:  # tokens start..index-1 were the round's accepted drafts
                return logits[round_.path, index - start], passes.last_input_lengths[PASS_KEY]
            sequence, start = [*sequence, *emitted], start + len(emitted)
    finally:
        with lock:
            passes.drop(PASS_KEY)  # fixed-shape passes give their rows back to the model's pools
    raise AssertionError(f"the rounds emitted {start} tokens, not token {index}")


def cutoff_crossings(
    shapes: PassShapes,
    context_ids: torch.Tensor,  # [1, T + first] the shared prefix, for the repetition penalty
    token_ids: tuple[int, int],  # the speculative run's token and the target alone's
    sampling: SamplingConfig,
    decode: Callable[[list[int]], str],
) -> tuple[CutoffCrossing, ...]:
    """The differing tokens that one pass shape keeps and the other cuts at top-k or top-p (p = 0 there, so the
    coupled rule's log p + G is -inf and the other token wins)."""
    one_scores = penalised_scores(shapes.one_token[None, None], context_ids, sampling)[0, 0]  # [V]
    wide_scores = penalised_scores(shapes.wide[None, None], context_ids, sampling)[0, 0]  # [V]
    crossings = []
    for token_id in dict.fromkeys(token_ids):
        one, wide = cutoff_place(one_scores, token_id, sampling), cutoff_place(wide_scores, token_id, sampling)
        crossed = crossed_cutoff(one, wide, sampling)
        if crossed is not None:
            text = token_text(decode, context_ids[0].tolist(), token_id)
            crossings.append(CutoffCrossing(text, *crossed, one, wide, shapes.one_token_width, shapes.wide_width))
    return tuple(crossings)


def noise_seed(sampling: SamplingConfig, device: torch.device) -> int:
    """The coupled rule's noise seed of a row decoded on `device` with `sampling`, drawn as BatchDecoder.add draws it
    (from a generator seeded with the run's seed)."""
    return stream_seed(torch.Generator(device=device).manual_seed(sampling.seed))
