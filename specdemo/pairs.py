"""The registry of draft/target pairs: data, not code paths."""

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
    free_memory_bytes,
    load_config,
    pick_device,
    readable_bytes,
    resolve_dtype,
    resolve_source,
    weight_bytes,
)
from specdemo.models.shared import ModelCache


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

    @property
    def uses_draft_model(self) -> bool:
        return not is_model_free(self.drafter)


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
        "half of them to requests it wrote itself (benchmarks/gpu_heads.sh on a GPU; python -m specdemo train-drafter "
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
    ),
    Pair(
        "gemma-3-270m-1b",
        "gemma-3-270m-it → gemma-3-1b-it",
        "google/gemma-3-1b-it",
        "google/gemma-3-270m-it",
        "The smallest Gemma drafting for the next size up (gated on the Hub: accept the licence).",
        needs_hub=True,
        suggested_hardware="gpu",
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
    )


def pairs_table() -> str:
    """The pairs as the CLI lists them."""
    lines = [f"{'key':22s} {'network':8s} {'hardware':8s} label"]
    for pair in PAIRS:
        lines.append(
            f"{pair.key:22s} {'Hub' if pair.needs_hub else 'offline':8s} {pair.suggested_hardware:8s} "
            f"{pair.label}\n{'':40s}{pair.note}"
        )
    return "\n".join(lines)


def load_pair(
    pair: Pair,
    cache: ModelCache,
    progress: Progress = lambda message: None,
    device: torch.device | None = None,
    allow_local: bool = False,
    dtype: torch.dtype | None = None,  # default: the device's (bfloat16 on CUDA, float32 elsewhere)
) -> tuple[LoadedModel, LoadedModel | None]:
    """The pair's target and draft model (None for prompt lookup), through the shared cache; refuses a pair whose
    weights do not fit the device's free memory before loading either, and a draft whose tokenizer differs from the
    target's before anything runs."""
    check_pair_fits(pair, cache, progress, device or pick_device(), dtype, allow_local)
    target = cache.get(pair.target, progress, device=device, allow_local=allow_local, dtype=dtype)
    if not pair.uses_draft_model:
        prepare_drafter(pair.drafter, target, progress)  # e.g. measure pass costs, outside any run's time
        return target, None
    draft = cache.get(pair.drafter, progress, device=target.device, allow_local=allow_local, dtype=dtype)
    check_same_tokenizer(target, draft)
    return target, draft


def check_pair_fits(
    pair: Pair,
    cache: ModelCache,
    progress: Progress,
    device: torch.device,
    dtype: torch.dtype | None,
    allow_local: bool,
) -> None:
    """Refuse, before either loads, a pair whose models not yet held need more than the device's free memory
    together (each alone is checked again as it loads)."""
    names = [pair.target] + ([pair.drafter] if pair.uses_draft_model else [])
    missing = [name for name in dict.fromkeys(names) if not cache.holds(name, device=device, dtype=dtype)]
    if len(missing) < 2:
        return
    dtype = dtype or resolve_dtype("auto", device)
    needed = {
        name: weight_bytes(load_config(name, resolve_source(name, progress, allow_local)), dtype) for name in missing
    }
    free = free_memory_bytes(device)
    if sum(needed.values()) > MEMORY_HEADROOM * free:
        each = " and ".join(f"{name} {readable_bytes(size)}" for name, size in needed.items())
        raise ValueError(
            f"The pair '{pair.key}' needs about {readable_bytes(sum(needed.values()))} for its weights ({each}) but "
            f"only {readable_bytes(free)} is free on {device.type}: pick a smaller pair, or run it on a machine with a "
            "larger GPU."
        )


def make_drafter(pair: Pair, target: LoadedModel, draft: LoadedModel | None, options: object | None = None) -> Drafter:
    """A fresh drafter for the pair (its state is its own), with its kind's `options` (None: the defaults)."""
    return build_drafter(pair.drafter, target, draft, options)
