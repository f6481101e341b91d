"""The Audit tab's words and file: the verdict over an audit's charts and the JSON record it offers, for toy and model
audits, from the audit's settings and its result as a dict (plain values: no models, no gradio)."""

from __future__ import annotations

from collections.abc import Sequence

from specdemo.app.views.render import Decode
from specdemo.config import RULE_LABELS


def sampler_sentence(rule: str, bug: str, planted: str, seed: int) -> str:
    """Which sampler ran (the project's, or the planted bug `bug`, which `planted` describes), its rule and seed."""
    sampler = "The project's sampler." if bug == "none" else f"Planted bug, {bug}: {planted}."
    return f"{sampler} Rule: {RULE_LABELS[rule]}. Seed {seed}."


def toy_verdict(result: dict, settings: dict, planted: str, seconds: float) -> str:
    """The toy audit's verdict in bold, then what ran: the sampler, N, K and W, and how long it took."""
    ran = sampler_sentence(settings["rule"], settings["bug"], planted, settings["seed"])
    sizes = f"N = {settings['num_samples']:,}, K = {settings['num_draft_tokens']}, W = {settings['num_candidates']}"
    return f"**{result['verdict']}**\n\n{ran} {sizes}; {seconds:.1f} s."


def toy_record(result: dict, settings: dict, seconds: float) -> dict:
    """The toy audit as the downloaded JSON: its settings, counts, fits, TV curve and verdict, and its time."""
    return {"settings": settings, **result, "seconds": seconds}


def model_verdict(result: dict, settings: dict, planted: str, seconds: float) -> str:
    """The model audit's verdict in bold, then what ran: the sampler, the pair, the samples a side and the distinct
    sequences they drew, and how long it took."""
    sampling = settings["sampling"]
    ran = sampler_sentence(sampling["rule"], settings["bug"], planted, sampling["seed"])
    drawn = f"{sum(result['speculative']):,} samples a side, {len(result['sequences']):,} distinct sequences"
    return f"**{result['verdict']}**\n\n{ran} Pair {settings['pair']}, {drawn}; {seconds:.1f} s."


def model_record(result: dict, settings: dict, decode: Decode, seconds: float) -> dict:
    """The model audit as the downloaded JSON: its settings, every sequence drawn with its counts and text, the test,
    the verdict, and its time."""
    texts = [decode(list(sequence)) for sequence in result["sequences"]]
    return {"settings": settings, **result, "texts": texts, "seconds": seconds}


def sequence_labels(sequences: Sequence[Sequence[int]], decode: Decode) -> list[str]:
    """Each sequence's tokens as the chart's axis shows them: escaped, joined by a middle dot."""
    return [" · ".join(repr(decode([token]))[1:-1] for token in sequence) for sequence in sequences]
