"""Where a speculative run's text first parts from the target alone's, for the runs that must agree token for token
(greedy, and sampled under the coupled rule): the token, and how near the target's top two were there."""

from __future__ import annotations

import torch

from specdemo.app.serving.runs import Run, decode_fn
from specdemo.app.views.render import token_text
from specdemo.app.views.summary import Divergence, first_difference
from specdemo.config import SamplingConfig
from specdemo.core.coupled import NoiseAsk, coupled_scores, position_noise
from specdemo.core.rounds import Round
from specdemo.core.sampling import build_warpers, logits_to_probs, penalised_scores
from specdemo.core.stats import emitted_ids
from specdemo.engine.decoding import stream_seed
from specdemo.engine.resources import openmp_workers_released


@torch.inference_mode()
def divergence(run: Run, rounds: list[Round], baseline: list[Round]) -> Divergence | None:
    """Where a greedy run's tokens, or a coupled sampled run's, first differ from the target alone's, with the target's
    top two there (logits; for a coupled run log p + G, its noise G), from one pass over the shared prefix (only taken
    when they differ); None where one run's tokens begin the other's."""
    speculative_ids, target_ids = emitted_ids(rounds), emitted_ids(baseline)
    first = first_difference(speculative_ids, target_ids)
    if first is None:
        return None
    context = [*run.prompts[0], *target_ids[:first]]
    context_ids = torch.tensor([context], device=run.target.device)  # [1, T + first]
    with run.schedulers.models_lock, openmp_workers_released():  # apart from other runs' passes; a Gradio thread
        logits = run.target.model(input_ids=context_ids, logits_to_keep=1).logits  # [1, 1, V]
    sampling = run.request.sampling
    if sampling.is_coupled:  # what the rule takes the argmax of, at the differing token's position
        probs = logits_to_probs(logits, context_ids, sampling, build_warpers(sampling))[0, 0]  # [V]
        seed, vocab_size = noise_seed(sampling, run.target.device), logits.shape[-1]
        noise = position_noise(NoiseAsk(seed, len(context), 1, 0, (), vocab_size, logits.device))[0]  # [V]
        scores = coupled_scores(probs, noise)  # [V]
        top_ids = scores.topk(2).indices  # [2]
        top_scores, top_probs = scores[top_ids], probs[top_ids]  # [2] each
    else:
        scores = penalised_scores(logits, context_ids, sampling)[0, 0]  # [V] what greedy takes the argmax of
        top_scores = scores.topk(2).values  # [2]
        top_probs = scores.softmax(dim=-1).topk(2).values  # [2]
    decode = decode_fn(run.target)
    return Divergence(
        position=first + 1,
        speculative_text=token_text(decode, context, speculative_ids[first]),
        target_text=token_text(decode, context, target_ids[first]),
        top2_logit_gap=float(top_scores[0] - top_scores[1]),
        top2_probs=(float(top_probs[0]), float(top_probs[1])),
        dtype=str(run.target.model.dtype).removeprefix("torch."),
        temperature=sampling.temperature,
    )


def noise_seed(sampling: SamplingConfig, device: torch.device) -> int:
    """The coupled rule's noise seed of a row decoded on `device` with `sampling`, drawn as BatchDecoder.add draws it
    (from a generator seeded with the run's seed)."""
    return stream_seed(torch.Generator(device=device).manual_seed(sampling.seed))
