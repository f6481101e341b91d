"""The pass seam: which cache and pass shape the target uses on a device. Fixed-shape passes on a GPU, where kernels
differ by shape (models/fixed_shape.py); tree passes on the CPU, where padding costs and the kernels keep a row's sums
in order (models/tree_cache.py, models/attention.py). The engine asks `verifier_for` and does not choose."""

from __future__ import annotations

import os
import time

import torch
from transformers import PreTrainedModel

from specdemo.config import SamplingConfig
from specdemo.models.fixed_pass import ChainRequest
from specdemo.models.fixed_shape import MIN_SLOTS, FixedShapeModel
from specdemo.models.graphs import uses_graphs
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
    """Where rounds replay CUDA graphs: capture a MIN_SLOTS group's greedy and sampled round programs now, kept for the
    process, so that the first run replays them; the line for the load's progress (None where there are no graphs).
    Other groups and modes are captured once, at their first use, with a line in the log."""
    if not (uses_fixed_shape(model.device) and uses_graphs(model.device)):
        return None
    passes, started = FixedShapeModel(model), time.perf_counter()
    for sampling in (SamplingConfig(), SamplingConfig(temperature=1.0)):
        passes.decide({"load": ChainRequest([0, 0], [], MIN_SLOTS // 2, sampling, 0, 0, None)})
        passes.drop("load")
    if not passes.replays_graphs:
        return "CUDA graphs could not be captured: rounds run eagerly (the log says why)."
    seconds = time.perf_counter() - started
    return f"Captured greedy and sampled rounds as CUDA graphs ({MIN_SLOTS} slots) in {seconds:.1f} s."
