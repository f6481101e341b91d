"""Whether models fit a device: each listed model's parameters and shape (so a plan needs no network), a device as a
memory plan sees it, the plan of a target and its draft model at given run settings, and the words for a plan that
does not fit. Functions of model names, shapes and settings: the pairs' registry (pairs.py) is above."""

from __future__ import annotations

import torch

from specdemo.models.loading import (
    MEMORY_HEADROOM,
    OFFLINE_DEFAULT,
    Progress,
    device_memory,
    float16_overflow,
    load_config,
    parameter_count,
    readable_bytes,
    resolve_source,
)
from specdemo.models.memory import Device, MemoryPlan, ModelShape, RunSettings, plan_memory, weights_plan
from specdemo.models.passes import uses_fixed_shape

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


def device_words(device: torch.device) -> str:
    """How a sentence names `device`: "this CPU", "this GPU"."""
    return {"cpu": "this CPU", "cuda": "this GPU"}.get(device.type, f"this {device.type} device")


def device_spec(device: torch.device) -> Device:
    """`device` as a memory plan sees it: its whole memory and its passes' shape."""
    return Device(device_words(device), device_memory(device)[1], uses_fixed_shape(device))


def plan_models(
    target: str,
    draft: str | None,  # the draft model's name (the target's own for a self-drafting pair); None: a model-free drafter
    device: Device,
    dtype: torch.dtype,
    settings: RunSettings,  # the largest runs the plan holds room for
    shapes: dict[str, ModelShape] | None = None,  # default: MODEL_SHAPES
    usable: int | None = None,  # default: MEMORY_HEADROOM of the whole device
) -> MemoryPlan | None:
    """The memory plan of `target` drafted by `draft` on `device` in `dtype`, at the largest limits that fit; None when
    a model's shape is not known (a custom pair's: planned on its config when it loads)."""
    shapes = MODEL_SHAPES if shapes is None else shapes
    names = list(dict.fromkeys([target] + ([draft] if draft is not None else [])))
    if any(name not in shapes for name in names):
        return None
    weights = sum(shapes[name].parameters for name in names) * dtype.itemsize
    usable = int(MEMORY_HEADROOM * device.total_bytes) if usable is None else usable
    if not device.fixed_shape:
        return weights_plan(weights, usable)
    return plan_memory(shapes[target], None if draft is None else shapes[draft], weights, dtype, usable, settings)


def too_big_words(model_names: list[str], plan: MemoryPlan, dtype: torch.dtype, this: str) -> str:
    """A few words for models whose plan does not fit: "too big for this GPU[ in float32, which Qwen2 and Qwen2.5
    need here]: needs N, U usable (the most for <term>: B)"."""
    overflow = float16_overflow(model_names) if dtype == torch.float32 and this.endswith("GPU") else None
    need = f" in float32, which {overflow} need here (float16 overflows)" if overflow else ""
    return (
        f"too big for {this}{need}: needs {readable_bytes(plan.needed)}, {readable_bytes(plan.usable)} usable "
        f"(the most for {plan.biggest}: {readable_bytes(plan.terms[plan.biggest])})"
    )


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
