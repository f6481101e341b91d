"""The registry of draft/target pairs (data, not code paths), which of them fit a device or need a Hub token, and
loading a pair through the shared cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdemo.config import MAX_NEW_TOKENS_LIMIT, MAX_NUM_CANDIDATES, MAX_NUM_DRAFT_TOKENS, MAX_PROMPT_TOKENS
from specdemo.drafters.base import Drafter
from specdemo.drafters.registry import HYBRID, NGRAM, RECURRENT, SUFFIX, drafter_names, is_model_free
from specdemo.engine.costs import MEASURED_GROUPS, MEASURED_SLOTS
from specdemo.engine.drafting import build_drafter, prepare_drafter
from specdemo.engine.scheduler import MAX_BATCH_ROWS
from specdemo.models.loading import (
    MEMORY_HEADROOM,
    OFFLINE_DEFAULT,
    LoadedModel,
    Progress,
    check_model_name,
    check_same_tokenizer,
    device_memory,
    float16_overflow,
    gated_on_hub,
    gated_sentence,
    hub_offline,
    hub_token_set,
    load_config,
    parameter_count,
    pick_device,
    readable_bytes,
    resolve_model_dtype,
    resolve_source,
)
from specdemo.models.memory import Device, MemoryPlan, ModelShape, RunSettings, plan_memory, weights_plan
from specdemo.models.passes import uses_fixed_shape
from specdemo.models.pools import limit_pools
from specdemo.models.shared import ModelCache

PARAMETER_COUNTS = {  # model -> parameters (a tied embedding once), so a pair's weights are known with no network
    OFFLINE_DEFAULT: 134_515_008,  # counted here from the offline package's config, as HuggingFaceTB's below
    "gemma-3-270m": 268_098_176,  # counted here from the offline package's config
    "HuggingFaceTB/SmolLM2-135M-Instruct": 134_515_008,
    "HuggingFaceTB/SmolLM2-360M-Instruct": 361_800_000,  # the rest: the model cards' counts, rounded
    "HuggingFaceTB/SmolLM2-1.7B-Instruct": 1_710_000_000,
    "Qwen/Qwen2.5-0.5B-Instruct": 494_000_000,
    "Qwen/Qwen2.5-1.5B-Instruct": 1_540_000_000,
    "Qwen/Qwen2.5-7B-Instruct": 7_620_000_000,
    "meta-llama/Llama-3.2-1B-Instruct": 1_240_000_000,
    "meta-llama/Llama-3.1-8B-Instruct": 8_030_000_000,
    "google/gemma-3-270m-it": 268_000_000,
    "google/gemma-3-1b-it": 1_000_000_000,
}


def _shape(name: str, layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int,
           vocab: int, context: int) -> ModelShape:  # fmt: skip
    return ModelShape(PARAMETER_COUNTS[name], layers, hidden, intermediate, heads, kv_heads, head_dim, vocab, context)


MODEL_SHAPES = {  # model -> what its memory depends on (models/memory.py), so a pair's plan needs no network: from
    # each model's config.json on the Hub as this file's authors know them (num_hidden_layers, hidden_size,
    # intermediate_size, num_attention_heads, num_key_value_heads, head_dim or hidden_size / heads, vocab_size,
    # max_position_embeddings); the offline ones as their packages' configs load here. tests/models/test_memory.py
    # builds each on the meta device and checks its parameters against PARAMETER_COUNTS.
    name: _shape(name, *figures)
    for name, figures in {
        OFFLINE_DEFAULT: (30, 576, 1536, 9, 3, 64, 49_152, 8192),
        "gemma-3-270m": (18, 640, 2048, 4, 1, 256, 262_144, 32_768),
        "HuggingFaceTB/SmolLM2-135M-Instruct": (30, 576, 1536, 9, 3, 64, 49_152, 8192),
        "HuggingFaceTB/SmolLM2-360M-Instruct": (32, 960, 2560, 15, 5, 64, 49_152, 8192),
        "HuggingFaceTB/SmolLM2-1.7B-Instruct": (24, 2048, 8192, 32, 32, 64, 49_152, 8192),
        "Qwen/Qwen2.5-0.5B-Instruct": (24, 896, 4864, 14, 2, 64, 151_936, 32_768),
        "Qwen/Qwen2.5-1.5B-Instruct": (28, 1536, 8960, 12, 2, 128, 151_936, 32_768),
        "Qwen/Qwen2.5-7B-Instruct": (28, 3584, 18_944, 28, 4, 128, 152_064, 32_768),
        "meta-llama/Llama-3.2-1B-Instruct": (16, 2048, 8192, 32, 8, 64, 128_256, 131_072),
        "meta-llama/Llama-3.1-8B-Instruct": (32, 4096, 14_336, 32, 8, 128, 128_256, 131_072),
        "google/gemma-3-270m-it": (18, 640, 2048, 4, 1, 256, 262_144, 32_768),
        "google/gemma-3-1b-it": (26, 1152, 6912, 4, 1, 256, 262_144, 32_768),
    }.items()
}
RUN_SETTINGS = RunSettings(  # the largest runs the app allows, which a pair's memory plan holds room for
    rows=MAX_BATCH_ROWS,
    candidates=MAX_NUM_CANDIDATES,
    draft_tokens=MAX_NUM_DRAFT_TOKENS,
    tokens=MAX_PROMPT_TOKENS + MAX_NEW_TOKENS_LIMIT,
    measured_slots=MEASURED_SLOTS,
    measured_groups=MEASURED_GROUPS,
)


@dataclass(frozen=True)
class Pair:
    """A target and its drafter, with why the pair is worth watching."""

    key: str
    label: str
    target: str  # an offline model name or a Hub id
    drafter: str  # a model-free kind (drafters.registry.DRAFTER_KINDS), or a model name sharing the target's tokenizer
    note: str
    needs_hub: bool  # False: runs with no network (offline packages)
    suggested_hardware: str  # "cpu" or "gpu"
    draft_temperature: float | None = None  # None: the draft samples with the target's settings
    gated: bool = False  # True: a model's licence must be accepted on the Hub, and HF_TOKEN set (loading.gated_on_hub)

    @property
    def uses_draft_model(self) -> bool:
        return not is_model_free(self.drafter)

    @property
    def model_names(self) -> list[str]:
        """The models it loads: the target, and the draft model unless it is the target or a model-free kind."""
        return list(dict.fromkeys([self.target] + ([self.drafter] if self.uses_draft_model else [])))

    @property
    def parameter_counts(self) -> dict[str, int | None]:
        """Each model's parameters, from PARAMETER_COUNTS; None for a model it does not list (a custom pair's).
        A model-free drafter counts nothing (a recurrent head's 3.7M parameters are left out)."""
        return {name: PARAMETER_COUNTS.get(name) for name in self.model_names}


PAIRS: tuple[Pair, ...] = (
    Pair(
        "smollm2-135m-ngram",
        "SmolLM2-135M-Instruct + prompt lookup (offline)",
        OFFLINE_DEFAULT,
        NGRAM,
        "No draft model at all: copies text that followed the same n-gram earlier; shines on summaries, edits "
        "and extraction, idles on free writing.",
        needs_hub=False,
        suggested_hardware="cpu",
    ),
    Pair(
        "smollm2-135m-suffix",
        "SmolLM2-135M-Instruct + suffix drafting, cost-aware (offline)",
        OFFLINE_DEFAULT,
        SUFFIX,
        "No draft model: drafts the most frequent continuation of the longest repeated suffix, as long as this "
        "machine's pass costs say it pays, and nothing when it would lose; the page says what it chose each round.",
        needs_hub=False,
        suggested_hardware="cpu",
    ),
    Pair(
        "smollm2-135m-recurrent",
        "SmolLM2-135M + recurrent drafter (trained here)",
        OFFLINE_DEFAULT,
        RECURRENT,
        "ReDrafter's drafter: a 3.7M-parameter RNN reads three of the target's layers, fused, and drafts through the "
        "target's own output layer, over the 8,192 tokens it writes most; trained here on the target's own answers, "
        "half of them to requests it wrote itself (experiments/gpu_heads.sh on a GPU; python -m specdemo train-drafter "
        "on a CPU). W > 1: beams.",
        needs_hub=False,
        suggested_hardware="cpu",
    ),
    Pair(
        "smollm2-135m-hybrid",
        "SmolLM2-135M + suffix copy and recurrent drafter (offline)",
        OFFLINE_DEFAULT,
        HYBRID,
        "Copying and the trained head catch different tokens: each round keeps the copy, the head's draft or "
        "both as candidates of one pass, as this machine's pass costs say pays; the tooltip names who proposed a "
        "token.",
        needs_hub=False,
        suggested_hardware="cpu",
    ),
    Pair(
        "smollm2-135m-self",
        "SmolLM2-135M-Instruct drafting for itself (offline)",
        OFFLINE_DEFAULT,
        OFFLINE_DEFAULT,
        "A teaching pair: with identical settings every draft is accepted; a hotter draft "
        "temperature shows rejections and resamples, and the output is still exactly the target's.",
        needs_hub=False,
        suggested_hardware="cpu",
        draft_temperature=1.5,
    ),
    Pair(
        "gemma-3-270m-ngram",
        "Gemma 3 270M + prompt lookup (offline, optional package)",
        "gemma-3-270m",
        NGRAM,
        "A base model with a 262k-token vocabulary: verification reads a much wider distribution per position.",
        needs_hub=False,
        suggested_hardware="cpu",
    ),
    Pair(
        "smollm2-135m-360m",
        "SmolLM2-135M → SmolLM2-360M-Instruct",
        "HuggingFaceTB/SmolLM2-360M-Instruct",
        OFFLINE_DEFAULT,
        "Same family, 2.7× the size: high acceptance, modest gain.",
        needs_hub=True,
        suggested_hardware="cpu",
    ),
    Pair(
        "smollm2-135m-1.7b",
        "SmolLM2-135M → SmolLM2-1.7B-Instruct",
        "HuggingFaceTB/SmolLM2-1.7B-Instruct",
        OFFLINE_DEFAULT,
        "The pair of the original write-up: a 12× cheaper draft.",
        needs_hub=True,
        suggested_hardware="gpu",
    ),
    Pair(
        "qwen2.5-0.5b-1.5b",
        "Qwen2.5-0.5B → Qwen2.5-1.5B-Instruct",
        "Qwen/Qwen2.5-1.5B-Instruct",
        "Qwen/Qwen2.5-0.5B-Instruct",
        "A close pair: acceptance stays high even when sampling.",
        needs_hub=True,
        suggested_hardware="gpu",
    ),
    Pair(
        "qwen2.5-0.5b-7b",
        "Qwen2.5-0.5B → Qwen2.5-7B-Instruct",
        "Qwen/Qwen2.5-7B-Instruct",
        "Qwen/Qwen2.5-0.5B-Instruct",
        "A 15× size gap, the regime where speculation pays most on a GPU.",
        needs_hub=True,
        suggested_hardware="gpu",
    ),
    Pair(
        "llama-3.2-1b-3.1-8b",
        "Llama-3.2-1B → Llama-3.1-8B-Instruct",
        "meta-llama/Llama-3.1-8B-Instruct",
        "meta-llama/Llama-3.2-1B-Instruct",
        "Across releases of one tokenizer (gated on the Hub: accept the licence).",
        needs_hub=True,
        suggested_hardware="gpu",
        gated=True,
    ),
    Pair(
        "gemma-3-270m-1b",
        "gemma-3-270m-it → gemma-3-1b-it",
        "google/gemma-3-1b-it",
        "google/gemma-3-270m-it",
        "The smallest Gemma drafting for the next size up (gated on the Hub: accept the licence).",
        needs_hub=True,
        suggested_hardware="gpu",
        gated=True,
    ),
)
PAIRS_BY_KEY = {pair.key: pair for pair in PAIRS}
DEFAULT_PAIR = PAIRS[0]


def find_pair(key: str) -> Pair:
    if key not in PAIRS_BY_KEY:
        raise ValueError(f"Unknown pair '{str(key)[:80]}': choose one of {', '.join(PAIRS_BY_KEY)}, or 'custom'.")
    return PAIRS_BY_KEY[key]


def custom_pair(target: str, drafter: str, allow_local: bool = False) -> Pair:
    """A pair of ids a user typed; the drafter may also be a model-free kind. Checked for syntax here, for tokenizers
    on load."""
    check_model_name(target, allow_local)
    if not is_model_free(drafter):
        try:
            check_model_name(drafter, allow_local)
        except ValueError as error:  # a misspelt drafter kind lands here too: name them
            raise ValueError(f"{str(error).removesuffix('.')}; a drafter may also be {drafter_names()}.") from None
    return Pair(
        "custom",
        f"{target} drafted by {drafter}",
        target,
        drafter,
        "Your own pair.",
        needs_hub=True,
        suggested_hardware="gpu",
        gated=gated_on_hub(target) or gated_on_hub(drafter),
    )


def pairs_table() -> str:
    """The pairs as the CLI lists them; a pair too big for this device in the format auto picks for it, or gated
    without a token, says so after its label."""
    marks = pair_marks(pick_device())
    lines = [f"{'key':22s} {'network':8s} {'hardware':8s} label"]
    for pair in PAIRS:
        lines.append(
            f"{pair.key:22s} {'Hub' if pair.needs_hub else 'offline':8s} {pair.suggested_hardware:8s} "
            f"{pair.label}{marks[pair.key]}\n{'':40s}{pair.note}"
        )
    return "\n".join(lines)


def device_spec(device: torch.device) -> Device:
    """`device` as a memory plan sees it: its whole memory and its passes' shape."""
    return Device(_this(device), device_memory(device)[1], uses_fixed_shape(device))


def pair_dtype(pair: Pair, name: str, device: torch.device) -> torch.dtype:
    """The number format `name` means for the pair on `device`: auto is float32 where float16 would overflow one of
    its models (loading.resolve_model_dtype)."""
    return resolve_model_dtype(name, device, pair.model_names)


def plan_pair(
    pair: Pair,
    device: Device,
    dtype: torch.dtype,
    shapes: dict[str, ModelShape] | None = None,  # default: MODEL_SHAPES
    usable: int | None = None,  # default: MEMORY_HEADROOM of the whole device
) -> MemoryPlan | None:
    """The pair's memory plan on `device` in `dtype`, at the largest limits that fit; None when a model's shape is
    not known (a custom pair's: planned on its config when it loads)."""
    shapes = MODEL_SHAPES if shapes is None else shapes
    if any(name not in shapes for name in pair.model_names):
        return None
    target = shapes[pair.target]
    draft = shapes[pair.drafter] if pair.uses_draft_model else None
    weights = sum(shapes[name].parameters for name in pair.model_names) * dtype.itemsize
    usable = int(MEMORY_HEADROOM * device.total_bytes) if usable is None else usable
    if not device.fixed_shape:
        return weights_plan(weights, usable)
    return plan_memory(target, draft, weights, dtype, usable, RUN_SETTINGS)


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


def needs_token(pair: Pair) -> bool:
    """Whether the pair is gated and no Hub token is set (with HF_HUB_OFFLINE, files come from the local cache)."""
    return pair.gated and not hub_offline() and not hub_token_set()


def pair_marks(device: torch.device) -> dict[str, str]:
    """What the pair dropdown and the CLI's list add after each pair's label: too big for `device` in the format auto
    picks for it there, e.g. " — too big for this GPU: needs 22.5 GB, 12.7 GB usable (the most for weights: 18.5 GB)"
    (a T4), or gated with no token set."""
    marks = {}
    for pair in PAIRS:
        dtype = pair_dtype(pair, "auto", device)
        plan = pair_plan(pair, device, dtype)
        mark = "" if plan is None or plan.fits else f" — {too_big_mark(pair, plan, dtype, _this(device))}"
        if needs_token(pair):
            mark += " — gated: needs HF_TOKEN"
        marks[pair.key] = mark
    return marks


def too_big_mark(pair: Pair, plan: MemoryPlan, dtype: torch.dtype, this: str) -> str:
    """A few words for a pair whose plan does not fit: "too big for this GPU[ in float32, which Qwen2 and Qwen2.5
    need here]: needs N, U usable (the most for <term>: B)"."""
    overflow = float16_overflow(pair.model_names) if dtype == torch.float32 and this.endswith("GPU") else None
    need = f" in float32, which {overflow} need here (float16 overflows)" if overflow else ""
    return (
        f"too big for {this}{need}: needs {readable_bytes(plan.needed)}, {readable_bytes(plan.usable)} usable "
        f"(the most for {plan.biggest}: {readable_bytes(plan.terms[plan.biggest])})"
    )


def limits_line(pair: Pair, device: torch.device, dtype: torch.dtype) -> str | None:
    """What the page says when the pair runs here with less than the settings allow, e.g. "On this GPU this pair
    holds rows of at most 2,047 tokens (prompt and new tokens) and 32 chain rows at once (runs × candidates)";
    None when nothing is cut."""
    plan = pair_plan(pair, device, dtype)
    if plan is None or plan.full or not plan.fits:
        return None
    return (
        f"On {_this(device)} this pair holds rows of at most {plan.limits.tokens:,} tokens (prompt and new tokens) "
        f"and {plan.limits.chains} chain rows at once (runs × candidates)"
    )


def check_run_limits(
    pair: Pair, device: torch.device, dtype: torch.dtype, tokens: int, candidates: int, what: str = "a run"
) -> None:
    """Refuse, in one sentence, a run whose row (`tokens`: prompt and new tokens) or candidates exceed what the pair's
    memory plan holds on `device` (limits_line says the limits on the page); nothing where the settings' own fit."""
    plan = pair_plan(pair, device, dtype)
    if plan is None or plan.full or not plan.fits:
        return
    limits = plan.limits
    if tokens > limits.tokens:
        raise ValueError(
            f"On {_this(device)} the pair '{pair.key}' holds rows of at most {limits.tokens:,} tokens, and {what} "
            f"needs {tokens:,} (prompt and max new tokens): shorten the prompt or lower max new tokens."
        )
    if candidates > limits.chains:
        raise ValueError(
            f"On {_this(device)} the pair '{pair.key}' holds {limits.chains} chain rows at once, and {what} asks for "
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
    if not pair.uses_draft_model:
        _hold_to_plan(pair, target, None)
        prepare_drafter(pair.drafter, target, progress)  # e.g. measure pass costs, outside any run's time
        return target, None
    draft = cache.get(pair.drafter, progress, device=target.device, allow_local=allow_local, dtype=dtype)
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


def model_weight_bytes(name: str, dtype: torch.dtype, progress: Progress, allow_local: bool) -> int:
    """A model's weights in `dtype`: from PARAMETER_COUNTS, else counted on its config (which the Hub may have to
    send)."""
    count = PARAMETER_COUNTS.get(name)
    if count is not None:
        return count * dtype.itemsize
    return parameter_count(load_config(name, resolve_source(name, progress, allow_local))) * dtype.itemsize


def model_shape(name: str, progress: Progress, allow_local: bool) -> ModelShape:
    """A model's shape: from MODEL_SHAPES, else read on its config (which the Hub may have to send)."""
    shape = MODEL_SHAPES.get(name)
    if shape is not None:
        return shape
    config = load_config(name, resolve_source(name, progress, allow_local))
    return ModelShape.from_config(config, PARAMETER_COUNTS.get(name) or parameter_count(config))


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


def _this(device: torch.device) -> str:
    return {"cpu": "this CPU", "cuda": "this GPU"}.get(device.type, f"this {device.type} device")


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
        f"more than the "
        f"{readable_bytes(usable)} usable of {room}: {instead}."
    )


def make_drafter(pair: Pair, target: LoadedModel, draft: LoadedModel | None, options: object | None = None) -> Drafter:
    """A fresh drafter for the pair (its state is its own), with its kind's `options` (None: the defaults)."""
    return build_drafter(pair.drafter, target, draft, options)
