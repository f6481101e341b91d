"""The pass seam: which cache and pass shape the target uses on a device. Fixed-shape passes on a GPU, where kernels
differ by shape (models/fixed_shape.py); tree passes on the CPU, where padding costs and the kernels keep a row's sums
in order (models/tree_cache.py, models/attention.py). The engine asks `verifier_for` and does not choose."""

from __future__ import annotations

import os
import time

import torch
from transformers import PretrainedConfig, PreTrainedModel

from specdemo.config import SamplingConfig
from specdemo.core.rules import STANDARD
from specdemo.core.verdicts import RoundAsk
from specdemo.models import fusion
from specdemo.models.fixed_shape import MIN_SLOTS, FixedShapeModel
from specdemo.models.graphs import capture_failed, free_cached_memory, uses_graphs
from specdemo.models.pools import pools_for
from specdemo.models.tree_cache import TreeCachedModel

PASS_SHAPE_VARIABLE = "SPECDEMO_PASS_SHAPE"  # "fixed" or "tree" overrides the device's default (fixed on a GPU)

Verifier = TreeCachedModel | FixedShapeModel


def uses_fixed_shape(device: torch.device) -> bool:
    """Fixed-shape passes on a GPU (any device but the CPU), tree passes on the CPU, unless SPECDEMO_PASS_SHAPE says."""
    forced = os.environ.get(PASS_SHAPE_VARIABLE, "").strip().lower()
    if forced in ("fixed", "tree"):
        return forced == "fixed"
    return device.type != "cpu"


def verifier_for(target: PreTrainedModel, hidden_layers: tuple[int, ...] = ()) -> Verifier:
    """The target's cache and passes on its device, keeping the hidden states of `hidden_layers` (a drafter's)."""
    if uses_fixed_shape(target.device):
        return FixedShapeModel(target, hidden_layers)
    return TreeCachedModel(target, hidden_layers)


def capture_at_load(model: PreTrainedModel) -> str | None:
    """Where rounds replay CUDA graphs: compile (where rounds are fused, models/fusion.py) and capture a MIN_SLOTS
    group's greedy and sampled round programs now, with the inspector's entries and without (a drafting row's, a
    target-only row's), kept for the process, so that the first run and its comparison replay them; the line for the
    load's progress, with the seconds (None where there are no graphs). Other groups and modes are captured once, at
    their first use, with a line in the log. A model whose RoPE reads values back to the host inside its pass decodes
    eagerly (under strict graphs: CaptureFailed); where the device runs out of memory, what the load made goes and the
    rounds are captured at their first use."""
    if not (uses_fixed_shape(model.device) and uses_graphs(model.device)):
        return None
    rope_type = host_read_rope_type(model.config)
    if rope_type is not None:
        return _eager_rope(model, rope_type)
    passes, started, compiled = FixedShapeModel(model), time.perf_counter(), fusion.compile_seconds(model)
    if not _load_rounds(passes):
        _let_go(passes)
        return "The GPU ran out of memory capturing rounds as CUDA graphs at load: each is captured at its first use."
    if not passes.replays_graphs:
        return "CUDA graphs could not be captured: rounds run eagerly (the log says why)."
    if len(passes.pools.captures) == passes.captures_before:
        return "No round was captured at load: kept from earlier, or eager where memory ran short (the log says which)."
    seconds, compiled = time.perf_counter() - started, fusion.compile_seconds(model) - compiled
    fused = f", {compiled:.1f} s of it compiling fused kernels" if compiled else ""
    return f"Captured greedy and sampled rounds as CUDA graphs ({MIN_SLOTS} slots) in {seconds:.1f} s{fused}."


def host_read_rope_type(config: PretrainedConfig) -> str | None:
    """The config's rope_type whose rotary frequencies transformers recomputes inside the forward behind a comparison
    read back to the host (dynamic NTK: `if seq_len > max_seq_len_cached` in modeling_rope_utils.dynamic_rope_update,
    for every type with "dynamic" in its name), or None. Longrope's update there stays on the device (torch.where
    into the same buffer), which a graph captures."""
    parameters = getattr(config.get_text_config(), "rope_parameters", None) or {}
    per_layer_type = [entry for entry in parameters.values() if isinstance(entry, dict)]
    kinds = [entry.get("rope_type", "default") for entry in per_layer_type or [parameters]]
    return next((kind for kind in kinds if "dynamic" in kind), None)


def _eager_rope(model: PreTrainedModel, rope_type: str) -> str:
    """The model's rounds run eagerly, marked before any capture is tried; the progress line that says why."""
    reason = f"scales RoPE dynamically (rope_type {rope_type!r}), which reads values back from the GPU inside its pass"
    capture_failed(("round", MIN_SLOTS), RuntimeError(f"the model {reason}"), "decoding")  # strict graphs: raised
    pools_for(model).graphs_failed = True
    return f"The model {reason}: rounds run eagerly, without CUDA graphs."


def _load_rounds(passes: FixedShapeModel) -> bool:
    """A MIN_SLOTS group's greedy and sampled rounds, run once each (captured at that first use); False where the
    device ran out of memory."""
    try:
        for sampling in (SamplingConfig(), SamplingConfig(temperature=1.0)):
            for views in (True, False):
                passes.decide({"load": RoundAsk([0, 0], [], MIN_SLOTS // 2, sampling, STANDARD, 0, 0, 0, views=views)})
                passes.drop("load")
    except torch.OutOfMemoryError:
        return False
    return True


def _let_go(passes: FixedShapeModel) -> None:
    """What the load's rounds made goes (their group and its programs, the model's idle groups), and on CUDA what the
    allocator keeps unused."""
    passes.close()
    free_cached_memory(passes.device)  # a round that ran out of memory leaves its tensors in reference cycles
