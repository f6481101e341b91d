"""The registry of draft/target pairs (data, not code paths), which of them fit a device or need a Hub token, and
loading a pair through the shared cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdemo.drafters.base import Drafter
from specdemo.drafters.registry import HYBRID, NGRAM, RECURRENT, SUFFIX, drafter_names, is_model_free
from specdemo.engine.drafting import build_drafter, prepare_drafter
from specdemo.models.loading import (
    MEMORY_HEADROOM,
    OFFLINE_DEFAULT,
    LoadedModel,
    Progress,
    check_model_name,
    check_same_tokenizer,
    device_memory,
    gated_on_hub,
    gated_sentence,
    hub_offline,
    hub_token_set,
    load_config,
    pick_device,
    readable_bytes,
    resolve_dtype,
    resolve_source,
    weight_bytes,
)
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
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "Same family, 2.7× the size: high acceptance, modest gain.",
        needs_hub=True,
        suggested_hardware="cpu",
    ),
    Pair(
        "smollm2-135m-1.7b",
        "SmolLM2-135M → SmolLM2-1.7B-Instruct",
        "HuggingFaceTB/SmolLM2-1.7B-Instruct",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
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
    """The pairs as the CLI lists them; a pair too big for this device in the format auto picks, or gated without
    a token, says so after its label."""
    marks = pair_marks(pick_device())
    lines = [f"{'key':22s} {'network':8s} {'hardware':8s} label"]
    for pair in PAIRS:
        lines.append(
            f"{pair.key:22s} {'Hub' if pair.needs_hub else 'offline':8s} {pair.suggested_hardware:8s} "
            f"{pair.label}{marks[pair.key]}\n{'':40s}{pair.note}"
        )
    return "\n".join(lines)


def pair_weight_bytes(pair: Pair, dtype: torch.dtype) -> int | None:
    """The bytes of the pair's weights in `dtype`, from PARAMETER_COUNTS (no network); None when a model is not
    listed."""
    counts = pair.parameter_counts.values()
    return None if None in counts else sum(counts) * dtype.itemsize  # type: ignore[arg-type]


def usable_bytes(device: torch.device) -> float:
    """What weights may take of the device's whole memory: the rest is for the KV cache and the passes."""
    return MEMORY_HEADROOM * device_memory(device)[1]


def pair_fits(pair: Pair, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the pair's weights in `dtype` fit `device` with nothing else loaded (an unlisted model: assumed so,
    and checked on load)."""
    needed = pair_weight_bytes(pair, dtype)
    return needed is None or needed <= usable_bytes(device)


def fitting_pairs(device: torch.device, dtype: torch.dtype) -> list[Pair]:
    """The registry's pairs whose weights in `dtype` fit `device`."""
    return [pair for pair in PAIRS if pair_fits(pair, device, dtype)]


def needs_token(pair: Pair) -> bool:
    """Whether the pair is gated and no Hub token is set (with HF_HUB_OFFLINE, files come from the local cache)."""
    return pair.gated and not hub_offline() and not hub_token_set()


def pair_marks(device: torch.device) -> dict[str, str]:
    """What the pair dropdown and the CLI's list add after each pair's label: too big for `device` in the format auto
    picks there, e.g. " — too big for this GPU: needs 18.5 GB, 12.7 GB usable" (a T4), or gated with no token set."""
    dtype, usable = resolve_dtype("auto", device), usable_bytes(device)
    marks = {}
    for pair in PAIRS:
        needed = pair_weight_bytes(pair, dtype)
        mark = ""
        if needed is not None and needed > usable:
            mark = f" — too big for {_this(device)}: needs {readable_bytes(needed)}, {readable_bytes(usable)} usable"
        if needs_token(pair):
            mark += " — gated: needs HF_TOKEN"
        marks[pair.key] = mark
    return marks


def load_pair(
    pair: Pair,
    cache: ModelCache,
    progress: Progress = lambda message: None,
    device: torch.device | None = None,
    allow_local: bool = False,
    dtype: torch.dtype | None = None,  # default: resolve_dtype("auto", device)
) -> tuple[LoadedModel, LoadedModel | None]:
    """The pair's target and draft model (None for a model-free drafter), through the shared cache. Before loading
    either, refuses a gated pair when no Hub token is set, and a pair whose weights do not fit the memory free on the
    device once idle models are evicted; after, a draft whose tokenizer differs from the target's."""
    if needs_token(pair):
        raise ValueError(gated_sentence([name for name in pair.model_names if gated_on_hub(name)]))
    check_pair_fits(pair, cache, progress, device or pick_device(), dtype, allow_local)
    target = cache.get(pair.target, progress, device=device, allow_local=allow_local, dtype=dtype)
    if not pair.uses_draft_model:
        prepare_drafter(pair.drafter, target, progress)  # e.g. measure pass costs, outside any run's time
        return target, None
    draft = cache.get(pair.drafter, progress, device=target.device, allow_local=allow_local, dtype=dtype)
    check_same_tokenizer(target, draft)
    return target, draft


def model_weight_bytes(name: str, dtype: torch.dtype, progress: Progress, allow_local: bool) -> int:
    """A model's weights in `dtype`: from PARAMETER_COUNTS, else counted on its config (which the Hub may have to
    send)."""
    count = PARAMETER_COUNTS.get(name)
    if count is not None:
        return count * dtype.itemsize
    return weight_bytes(load_config(name, resolve_source(name, progress, allow_local)), dtype)


def check_pair_fits(
    pair: Pair,
    cache: ModelCache,
    progress: Progress,
    device: torch.device,
    dtype: torch.dtype | None,  # None: whatever format a held model is in serves; auto's for the rest
    allow_local: bool,
) -> None:
    """Refuse, before either loads, a pair whose models not yet held need more than the memory free on `device`,
    after evicting idle models (least recently used first, never the pair's own) to make room; a pair too big for
    the whole device is refused without evicting anything."""
    missing = [name for name in pair.model_names if not cache.holds(name, device=device, dtype=dtype)]
    if not missing:
        return
    held = [name for name in pair.model_names if name not in missing]
    dtype = dtype or resolve_dtype("auto", device)
    needed = {name: model_weight_bytes(name, dtype, progress, allow_local) for name in missing}
    total = device_memory(device)[1]
    if sum(needed.values()) > MEMORY_HEADROOM * total:
        raise ValueError(_too_big(pair, needed, f"{_this(device)}'s {readable_bytes(total)}", device, dtype))
    free = cache.make_room(sum(needed.values()), device, keep=held)
    if sum(needed.values()) > MEMORY_HEADROOM * free:
        room = f"the {readable_bytes(free)} free on {_this(device)} once idle models are unloaded"
        raise ValueError(_too_big(pair, needed, room, device, dtype, MEMORY_HEADROOM * free))


def _this(device: torch.device) -> str:
    return {"cpu": "this CPU", "cuda": "this GPU"}.get(device.type, f"this {device.type} device")


def _too_big(
    pair: Pair,
    needed: dict[str, int],
    room: str,  # the memory it was measured against, in words
    device: torch.device,
    dtype: torch.dtype,
    usable: float | None = None,  # what weights may take of it; None: of the whole device
) -> str:
    """The refusal of a pair that does not fit, in one sentence: what it needs, what there is, and the pairs that
    fit."""
    each = " and ".join(f"{name} {readable_bytes(size)}" for name, size in needed.items())
    usable = usable_bytes(device) if usable is None else usable
    fitting = [other.key for other in fitting_pairs(device, dtype) if other.key != pair.key]
    instead = (
        f"pick a pair that fits ({', '.join(fitting)}), or run it on a machine with a larger GPU"
        if fitting
        else "run it on a machine with a larger GPU (no listed pair fits this one)"
    )
    return (
        f"The pair '{pair.key}' needs about {readable_bytes(sum(needed.values()))} for its weights ({each}) in "
        f"{str(dtype).removeprefix('torch.')}, more than the {readable_bytes(usable)} weights may take of {room}: "
        f"{instead}."
    )


def make_drafter(pair: Pair, target: LoadedModel, draft: LoadedModel | None, options: object | None = None) -> Drafter:
    """A fresh drafter for the pair (its state is its own), with its kind's `options` (None: the defaults)."""
    return build_drafter(pair.drafter, target, draft, options)
