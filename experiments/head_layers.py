"""The head's ablations on one set of texts: which target layers it reads (the final state alone, or an early, a middle
and the final one fused), what draft positions 2..K read in training (the text's tokens, its own drafts, or both),
and optionally its labels (argmax or soft) and residual blocks.
Each variant is fitted for --steps on train-drafter's texts (cached: written here where missing) and measured on the
same held-out texts: α per draft position (greedy, against the target's argmax) and tokens per pass.

    python -m experiments.head_layers --steps 1000 \\
        --variants 30:teacher 8,15,30:teacher 4,15,30:teacher 15,22,30:teacher 8,15,30:drafts
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.common import parser
from specdemo import load_model
from specdemo.drafters.head import layer_indices
from specdemo.drafters.head_file import save_head, target_fingerprint
from specdemo.models import onednn
from specdemo.models.offline import cache_root
from specdemo.training.data import DataSettings, write_features, write_texts
from specdemo.training.fit import FitSettings, fit, read_positions


def main(argv: list[str] | None = None) -> list[dict]:
    onednn.uncap()  # as train-drafter runs (specdemo/models/onednn.py)
    flags = parser(__doc__.split("\n\n")[0])
    flags.add_argument("--steps", type=int, default=1000)
    flags.add_argument(
        "--variants", nargs="+", required=True, help="layers:unroll[:labels[:blocks]], e.g. 8,15,30:drafts:soft:2"
    )
    flags.add_argument("--cache", type=Path, default=cache_root() / "training")
    flags.add_argument("--heads", type=Path, help="write each variant's head file in this directory")
    flags.add_argument("--texts", type=int, default=DataSettings.num_texts)
    flags.add_argument("--new-tokens", type=int, default=DataSettings.max_new_tokens)
    args = flags.parse_args(argv)
    target = load_model(args.model, device=torch.device("cpu"), dtype=getattr(torch, args.dtype))
    fingerprint = target_fingerprint(target.model)
    name = f"{target.name.replace('/', '--')}-{fingerprint}-{args.dtype}"
    data = DataSettings(num_texts=args.texts, max_new_tokens=args.new_tokens)
    chunks = write_texts(target, data, args.cache / name)
    settings = FitSettings(steps=args.steps)
    held_out_chunks = max(1, min(-(-settings.held_out_texts // data.batch_size), len(chunks) - 1))
    rows = []
    for variant in args.variants:
        parts = variant.split(":")
        layers_text, unroll, labels, blocks = [*parts, *("", "teacher", "argmax", "1")[len(parts) :]]
        layers = layer_indices(target.model, tuple(int(layer) for layer in layers_text.split(",")))
        write_features(target, chunks, layers)
        train = read_positions(chunks[:-held_out_chunks], layers, settings.depth)
        held_out = read_positions(chunks[-held_out_chunks:], layers, settings.depth)
        chosen = replace(settings, layers=layers, unroll=unroll, labels=labels, num_blocks=int(blocks))
        started = time.perf_counter()
        tag = f"{layers_text.replace(',', '-')}-{unroll}-{labels}-{blocks}"
        checkpoint = args.cache / name / f"ablation-{tag}-{args.steps}.pt"
        head, curves = fit(target.model, train, held_out, chosen, checkpoint)
        row = dict(
            layers=list(layers),
            unroll=unroll,
            labels=labels,
            blocks=int(blocks),
            steps=args.steps,
            training_positions=len(train.hidden),
            held_out_positions=len(held_out.hidden),
            held_out_alpha=[round(a, 3) for a in curves.alpha[-1]],
            held_out_tokens_per_pass=round(curves.tokens_per_pass[-1], 3),
            tokens_per_pass_curve=[round(t, 3) for t in curves.tokens_per_pass],
            best_tokens_per_pass=round(max(curves.tokens_per_pass), 3),
            final_loss=round(curves.loss[-1], 3),
            seconds=round(time.perf_counter() - started, 1),
        )
        if args.heads:
            trained = dict(row, held_out_alpha=curves.alpha[-1])
            save_head(head, args.heads / f"head-{tag}.pt", fingerprint, trained)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    main()
