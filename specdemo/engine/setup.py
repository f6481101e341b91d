"""A pair on a device: the largest runs its plan holds room for, whether it fits and what the page and the command line
say when it does not, loading it through the shared cache, and making its drafter."""

from __future__ import annotations

import torch

from specdemo.config import MAX_NEW_TOKENS_LIMIT, MAX_NUM_CANDIDATES, MAX_NUM_DRAFT_TOKENS, MAX_PROMPT_TOKENS
from specdemo.drafters.base import Drafter
from specdemo.engine.costs import MEASURED_GROUPS, MEASURED_SLOTS
from specdemo.engine.drafting import build_drafter, prepare_drafter
from specdemo.engine.scheduler import MAX_BATCH_ROWS
from specdemo.models.fitting import (
    device_spec,
    device_words,
    model_shape,
    model_weight_bytes,
    plan_models,
    too_big_words,
)
from specdemo.models.loading import (
    MEMORY_HEADROOM,
    LoadedModel,
    Progress,
    check_same_tokenizer,
    gated_on_hub,
    gated_sentence,
    pick_device,
    readable_bytes,
)
from specdemo.models.memory import Device, MemoryPlan, ModelShape, RunSettings, weights_plan
from specdemo.models.passes import uses_fixed_shape
from specdemo.models.pools import limit_pools
from specdemo.models.shared import ModelCache
from specdemo.pairs import PAIRS, Pair, needs_token, pair_dtype

RUN_SETTINGS = RunSettings(  # the largest runs the app allows, which a pair's memory plan holds room for
    rows=MAX_BATCH_ROWS,
    candidates=MAX_NUM_CANDIDATES,
    draft_tokens=MAX_NUM_DRAFT_TOKENS,
    tokens=MAX_PROMPT_TOKENS + MAX_NEW_TOKENS_LIMIT,
    measured_slots=MEASURED_SLOTS,
    measured_groups=MEASURED_GROUPS,
)


def plan_pair(
    pair: Pair,
    device: Device,
    dtype: torch.dtype,
    shapes: dict[str, ModelShape] | None = None,  # default: models.fitting.MODEL_SHAPES
    usable: int | None = None,  # default: MEMORY_HEADROOM of the whole device
) -> MemoryPlan | None:
    """The pair's memory plan on `device` in `dtype` at RUN_SETTINGS, at the largest limits that fit; None when a
    model's shape is not known (a custom pair's: planned on its config when it loads)."""
    return plan_models(pair.target, pair.draft_model, device, dtype, RUN_SETTINGS, shapes, usable)


def pair_plan(pair: Pair, device: torch.device, dtype: torch.dtype) -> MemoryPlan | None:
    """plan_pair on a torch device."""
    return plan_pair(pair, device_spec(device), dtype)


def pair_fits(pair: Pair, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the pair's whole memory plan in `dtype` fits `device` with nothing else loaded, at some limits (an
    unlisted model: assumed so, and checked on load)."""
    plan = pair_plan(pair, device, dtype)
    return plan is None or plan.fits


def fitting_pairs(device: torch.device, dtype: torch.dtype) -> list[Pair]:
    """The registry's pairs whose memory plans in `dtype` fit `device`."""
    return [pair for pair in PAIRS if pair_fits(pair, device, dtype)]


def pair_marks(device: torch.device) -> dict[str, str]:
    """What the pair dropdown and the CLI's list add after each pair's label: too big for `device` in the format auto
    picks for it there, e.g. " — too big for this GPU: needs 22.5 GB, 12.7 GB usable (the most for weights: 18.5 GB)"
    (a T4), or gated with no token set."""
    marks = {}
    for pair in PAIRS:
        dtype = pair_dtype(pair, "auto", device)
        plan = pair_plan(pair, device, dtype)
        fits = plan is None or plan.fits
        mark = "" if fits else f" — {too_big_words(pair.model_names, plan, dtype, device_words(device))}"
        if needs_token(pair):
            mark += " — gated: needs HF_TOKEN"
        marks[pair.key] = mark
    return marks


def limits_line(pair: Pair, device: torch.device, dtype: torch.dtype) -> str | None:
    """What the page says when the pair runs here with less than the settings allow, e.g. "On this GPU this pair
    holds rows of at most 2,047 tokens (prompt and new tokens) and 32 chain rows at once (runs × candidates)";
    None when nothing is cut."""
    plan = pair_plan(pair, device, dtype)
    if plan is None or plan.full or not plan.fits:
        return None
    return (
        f"On {device_words(device)} this pair holds rows of at most {plan.limits.tokens:,} tokens (prompt and new "
        f"tokens) and {plan.limits.chains} chain rows at once (runs × candidates)"
    )


def check_run_limits(
    pair: Pair, device: torch.device, dtype: torch.dtype, tokens: int, candidates: int, what: str = "a run"
) -> None:
    """Refuse, in one sentence, a run whose row (`tokens`: prompt and new tokens) or candidates exceed what the pair's
    memory plan holds on `device` (limits_line says the limits on the page); nothing where the settings' own fit."""
    plan = pair_plan(pair, device, dtype)
    if plan is None or plan.full or not plan.fits:
        return
    limits, this = plan.limits, device_words(device)
    if tokens > limits.tokens:
        raise ValueError(
            f"On {this} the pair '{pair.key}' holds rows of at most {limits.tokens:,} tokens, and {what} "
            f"needs {tokens:,} (prompt and max new tokens): shorten the prompt or lower max new tokens."
        )
    if candidates > limits.chains:
        raise ValueError(
            f"On {this} the pair '{pair.key}' holds {limits.chains} chain rows at once, and {what} asks for "
            f"{candidates} candidates: lower the number of candidates to {limits.chains} or fewer."
        )


def load_pair(
    pair: Pair,
    cache: ModelCache,
    progress: Progress = lambda message: None,
    device: torch.device | None = None,
    allow_local: bool = False,
    dtype: torch.dtype | None = None,  # default: pair_dtype(pair, "auto", device)
) -> tuple[LoadedModel, LoadedModel | None]:
    """The pair's target and draft model (None for a model-free drafter), through the shared cache. Before loading
    either, refuses a gated pair when no Hub token is set, and a pair whose memory plan does not fit the memory free on
    the device once idle models are evicted; after, a draft whose tokenizer differs from the target's. The target's
    groups are held to the plan (models/pools.py)."""
    if needs_token(pair):
        raise ValueError(gated_sentence([name for name in pair.model_names if gated_on_hub(name)]))
    device = device or pick_device()
    dtype = dtype or pair_dtype(pair, "auto", device)
    check_pair_fits(pair, cache, progress, device, dtype, allow_local)
    target = cache.get(pair.target, progress, device=device, allow_local=allow_local, dtype=dtype)
    if pair.draft_model is None:
        _hold_to_plan(pair, target, None)
        prepare_drafter(pair.drafter, target, progress)  # e.g. measure pass costs, outside any run's time
        return target, None
    draft = cache.get(pair.draft_model, progress, device=target.device, allow_local=allow_local, dtype=dtype)
    check_same_tokenizer(target, draft)
    _hold_to_plan(pair, target, draft)
    return target, draft


def _hold_to_plan(pair: Pair, target: LoadedModel, draft: LoadedModel | None) -> None:
    """Where passes are fixed-shape, the target's groups held to the pair's plan, in the format it loaded in."""
    if not uses_fixed_shape(target.device):
        return
    dtype = target.model.dtype
    shapes = {
        loaded.name: ModelShape.from_config(loaded.model.config, loaded.model.num_parameters())
        for loaded in (target, draft)
        if loaded is not None
    }
    plan = plan_pair(pair, device_spec(target.device), dtype, shapes)
    assert plan is not None, f"shapes of {pair.model_names}, got {list(shapes)}"
    limit_pools(target.model, plan.pool_bytes, shapes[target.name].group_bytes(1, dtype))


def check_pair_fits(
    pair: Pair,
    cache: ModelCache,
    progress: Progress,
    device: torch.device,
    dtype: torch.dtype | None,  # None: whatever format a held model is in serves; pair_dtype's auto for the rest
    allow_local: bool,
) -> None:
    """Refuse, before either loads, a pair whose memory plan (its weights, and on a GPU its runs' memory) needs more
    than the device has, or, less the weights of its models already held, more than is free on `device` after
    evicting idle models (least recently used first, never the pair's own); a pair too big for the whole device is
    refused without evicting anything."""
    missing = [name for name in pair.model_names if not cache.holds(name, device=device, dtype=dtype)]
    if not missing:
        return
    dtype = dtype or pair_dtype(pair, "auto", device)
    weights = {name: model_weight_bytes(name, dtype, progress, allow_local) for name in pair.model_names}
    spec = device_spec(device)
    if spec.fixed_shape:
        shapes = {name: model_shape(name, progress, allow_local) for name in pair.model_names}
        plan = plan_pair(pair, spec, dtype, shapes)
    else:
        plan = weights_plan(sum(weights.values()), int(MEMORY_HEADROOM * spec.total_bytes))
    assert plan is not None, f"shapes of {pair.model_names}"
    if not plan.fits:
        raise ValueError(
            _too_big(pair, plan, weights, f"{spec.name}'s {readable_bytes(spec.total_bytes)}", device, dtype)
        )
    needed = plan.needed - sum(size for name, size in weights.items() if name not in missing)
    free = cache.make_room(needed, device, keep=[name for name in pair.model_names if name not in missing])
    if needed > MEMORY_HEADROOM * free:
        room = f"the {readable_bytes(free)} free on {spec.name} once idle models are unloaded"
        held = {"usable": int(MEMORY_HEADROOM * free), "needed": needed}
        raise ValueError(_too_big(pair, plan, weights, room, device, dtype, held))


def _too_big(
    pair: Pair,
    plan: MemoryPlan,
    weights: dict[str, int],  # each model's
    room: str,  # the memory it was measured against, in words
    device: torch.device,
    dtype: torch.dtype,
    free: dict[str, int] | None = None,  # what is needed and usable of the memory free now; None: the plan's own
) -> str:
    """The refusal of a pair that does not fit, in one sentence: what it needs in `dtype` and its biggest term, what
    there is, and the pairs that fit."""
    needed, usable = (plan.needed, plan.usable) if free is None else (free["needed"], free["usable"])
    each = " and ".join(f"{name} {readable_bytes(size)}" for name, size in weights.items())
    if len(plan.terms) == 1:
        most = f"for its weights ({each})"
    else:
        detail = each if plan.biggest == "weights" else readable_bytes(plan.terms[plan.biggest])
        smallest = "even at its smallest limits, " if free is None else ""
        most = f"{smallest}the most for {plan.biggest} ({detail})"
    fitting = [other.key for other in fitting_pairs(device, dtype) if other.key != pair.key]
    instead = (
        f"pick a pair that fits ({', '.join(fitting)}), or run it on a machine with a larger GPU"
        if fitting
        else "run it on a machine with a larger GPU (no listed pair fits this one)"
    )
    return (
        f"The pair '{pair.key}' needs about {readable_bytes(needed)} in {str(dtype).removeprefix('torch.')} {most}, "
        f"more than the {readable_bytes(usable)} usable of {room}: {instead}."
    )


def make_drafter(pair: Pair, target: LoadedModel, draft: LoadedModel | None, options: object | None = None) -> Drafter:
    """A fresh drafter for the pair (its state is its own), with its kind's `options` (None: the defaults)."""
    return build_drafter(pair.drafter, target, draft, options)
