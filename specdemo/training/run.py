"""`train-drafter` from end to end: load the target, have it write its texts, recording the states of the layers the
head reads as it writes (both cached; texts written for other layers are read back for them), fit the head
(checkpointed), and write the head file and its curves."""

from __future__ import annotations

import ctypes
import gc
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from specdemo.drafters.head import layer_indices
from specdemo.drafters.head_file import save_head, target_fingerprint
from specdemo.models.loading import LoadedModel, Progress
from specdemo.training.curves import draw_curves
from specdemo.training.data import DataSettings, write_features, write_texts, written_with
from specdemo.training.fit import FitSettings, default_layers, fit, read_positions


def train_drafter(
    target: LoadedModel,
    data: DataSettings,
    settings: FitSettings,
    cache: Path,
    output: Path,
    curves_path: Path | None,
    progress: Progress,
) -> dict[str, object]:
    """Train and save a head for `target`; returns what was measured on the way."""
    started = time.perf_counter()
    target_name = target.name
    fingerprint = target_fingerprint(target.model)
    cache = cache / f"{target_name.replace('/', '--')}-{fingerprint}-{target.model.dtype}".replace("torch.", "")
    layers = layer_indices(target.model, settings.layers or default_layers(target.model))
    settings = replace(settings, layers=layers)
    chunks = write_texts(target, data, cache, layers)
    texts_seconds = time.perf_counter() - started
    write_features(target, chunks, layers)  # only where the texts were written for other layers, or earlier
    features_seconds = time.perf_counter() - started - texts_seconds
    release_memory()
    held_out_chunks = max(1, -(-settings.held_out_texts // data.batch_size))
    if held_out_chunks >= len(chunks):
        raise ValueError(
            f"{settings.held_out_texts} held-out texts leave nothing to train on among {data.num_texts}: write more "
            "--texts, or hold out fewer."
        )
    train = read_positions(chunks[:-held_out_chunks], layers, settings.depth)
    held_out = read_positions(chunks[-held_out_chunks:], layers, settings.depth)
    progress(f"{len(train.hidden):,} training positions, {len(held_out.hidden):,} held out.")
    name = f"{settings.labels}-{settings.unroll}-{'-'.join(map(str, layers))}"
    made_from = f"{written_with(data)}, {data.num_texts} texts, {len(train.hidden)} positions"
    head, curves = fit(target.model, train, held_out, settings, cache / f"checkpoint-{name}.pt", made_from=made_from)
    summary: dict[str, object] = dict(
        target=target_name,
        dtype=str(target.model.dtype).removeprefix("torch."),
        texts=asdict(data),
        fit=asdict(settings),
        training_positions=len(train.hidden),
        held_out_positions=len(held_out.hidden),
        texts_seconds=round(texts_seconds, 1),
        features_seconds=round(features_seconds, 1),
        seconds=round(time.perf_counter() - started, 1),
        held_out_alpha=curves.alpha[-1],
        held_out_tokens_per_pass=curves.tokens_per_pass[-1],
        final_loss=curves.loss[-1],
    )
    save_head(head, output, fingerprint, summary)
    if curves_path is not None:
        title = (
            f"recurrent head for {target_name}: {len(train.hidden):,} positions, layers {list(layers)}, "
            f"{settings.labels} labels, {settings.unroll} unroll"
        )
        draw_curves(curves, curves_path, title)
    progress(f"Wrote {output} ({output.stat().st_size / 1e6:.1f} MB) in {summary['seconds']} s.")
    torch.save(curves, cache / f"curves-{name}.pt")
    return summary


def release_memory() -> None:
    """Hands the memory the texts' part freed back to the system before the fit's part. glibc keeps freed heap for
    reuse, and the fit could not reuse it: in one process the fit's peak sat on top of the texts' (the figures are in
    docs/recurrent-drafter.md)."""
    gc.collect()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # another C library
            pass
