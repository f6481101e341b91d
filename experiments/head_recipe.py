"""What else the head's recipe could change, one variant a run: fitted on train-drafter's cached texts (the layers it
reads by default, 15, 22 and 30) and measured on the same held-out texts, the last two chunks, as α per draft position
(greedy, against the target's argmax) and tokens per pass. The variants: how many texts it trains on (--train, chunks
of 32), the steps, the head's residual blocks, float32 products against bfloat16 ones, EAGLE's uniform feature noise
(relative to each layer's RMS), the previous position's states beside the last one's, and greedy texts beside the
sampled ones (--greedy chunks of the instructions in another seeded order, at T = 0). Texts and features are written
here where missing.
--head writes the variant's head file, for `python -m benchmarks.recurrent --head`.

    python -m experiments.head_recipe --train 0-57 --steps 2000 [--float32-products]
        [--noise 0.2 | --previous | --greedy 0-15] [--head F] >> rows.jsonl
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
from specdemo.training import fit as fitting
from specdemo.training.data import DataSettings, features_paths, write_features, write_texts
from specdemo.training.fit import FitSettings, Positions, fit, read_positions


def chunks(directory: Path, span: str) -> list[Path]:
    """train-drafter's text chunks FIRST-LAST of a cache directory."""
    first, last = map(int, span.split("-"))
    return [directory / f"texts-{index:04d}.pt" for index in range(first, last + 1)]


def with_previous(paths: list[Path], positions: Positions, layers: tuple[int, ...]) -> Positions:
    """Each position's states with those of the position before it, as twice the layers' worth."""
    previous = []
    for path in paths:
        files = features_paths(path, layers)
        record = torch.load(path, weights_only=True)
        states = [torch.load(files[f"layer {layer}"], weights_only=True)["hidden"] for layer in layers]
        for b, tokens in enumerate(record["token_ids"]):
            start, length = record["prompt_lengths"][b] - 1, len(tokens)
            if length - start < 2:
                continue
            t = torch.arange(start, length - 1, device="cpu") - 1
            previous.append(torch.cat([state[b][t] for state in states], dim=-1))
    return replace(positions, hidden=torch.cat([positions.hidden, torch.cat(previous)], dim=-1))


def noisy_loss(noise: float, hidden_size: int):
    """training_loss on states perturbed by U(-noise, noise) times each layer's RMS (EAGLE adds U(-0.1, 0.1))."""
    plain = fitting.training_loss

    def loss(head, batch, lookup, settings):
        parts = batch["hidden"].float().unflatten(-1, (-1, hidden_size))
        scale = parts.square().mean(dim=-1, keepdim=True).sqrt()
        parts = parts + (torch.rand_like(parts) * 2 - 1) * noise * scale
        return plain(head, dict(batch, hidden=parts.flatten(-2)), lookup, settings)

    return loss


def main(argv: list[str] | None = None) -> dict:
    onednn.uncap()  # as train-drafter runs (specdemo/models/onednn.py)
    flags = parser(__doc__.split("\n\n")[0])
    flags.add_argument("--texts", type=int, default=DataSettings.num_texts, help="sampled texts written")
    flags.add_argument("--new-tokens", type=int, default=DataSettings.max_new_tokens)
    flags.add_argument("--layers", default="15,22,30", help="the target's hidden states read")
    flags.add_argument("--train", default="0-57", help="the sampled chunks trained on")
    flags.add_argument("--held-out", default="58-59")
    flags.add_argument("--steps", type=int, default=2000)
    flags.add_argument("--blocks", type=int, default=FitSettings.num_blocks, help="the head's residual blocks")
    flags.add_argument("--labels", choices=fitting.LABELS, default=FitSettings.labels)
    flags.add_argument("--float32-products", action="store_true")
    flags.add_argument("--noise", type=float, default=0.0)
    flags.add_argument("--previous", action="store_true", help="the previous position's states too")
    flags.add_argument("--greedy", help="greedy chunks trained on besides, e.g. 0-15")
    flags.add_argument("--threads", type=int, default=1, help="two variants ran at once, one thread each")
    flags.add_argument("--cache", type=Path, default=cache_root() / "training")
    flags.add_argument("--head", type=Path)
    args = flags.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = load_model(args.model, device=torch.device("cpu"), dtype=getattr(torch, args.dtype))
    fingerprint = target_fingerprint(target.model)
    cache = args.cache / f"{target.name.replace('/', '--')}-{fingerprint}-{args.dtype}"
    layers = layer_indices(target.model, tuple(int(layer) for layer in args.layers.split(",")))
    data = DataSettings(num_texts=args.texts, max_new_tokens=args.new_tokens)
    write_features(target, write_texts(target, data, cache, layers), layers)
    trained, held_out = chunks(cache, args.train), chunks(cache, args.held_out)
    if args.greedy:
        count = (int(args.greedy.split("-")[1]) + 1) * data.batch_size
        greedy = replace(data, num_texts=count, temperature=0.0, seed=1)
        write_features(target, write_texts(target, greedy, cache / "greedy", layers), layers)
        trained += chunks(cache / "greedy", args.greedy)
    settings = FitSettings(steps=args.steps, layers=layers, labels=args.labels, num_blocks=args.blocks)
    train, held = read_positions(trained, layers, settings.depth), read_positions(held_out, layers, settings.depth)
    if args.previous:
        train, held = with_previous(trained, train, layers), with_previous(held_out, held, layers)
        twice = (*layers, *(layer - 1 for layer in layers))  # twice the states to fuse: only their count matters
        settings = replace(settings, layers=twice)
    plain = fitting.training_loss
    if args.noise:
        fitting.training_loss = noisy_loss(args.noise, target.model.config.hidden_size)
    started = time.perf_counter()
    checkpoint = Path(f"/tmp/head-recipe-{time.time_ns()}.pt")
    try:
        head, curves = fit(target.model, train, held, settings, checkpoint, low_precision=not args.float32_products)
    finally:
        fitting.training_loss = plain  # never left perturbed for whoever fits next in this process
        checkpoint.unlink(missing_ok=True)
    row = dict(
        train=args.train, greedy=args.greedy, steps=args.steps, labels=args.labels, blocks=args.blocks,
        float32_products=args.float32_products, noise=args.noise, previous=args.previous, positions=len(train.hidden),
        held_out_positions=len(held.hidden),
        alpha=[round(a, 3) for a in curves.alpha[-1]], tokens_per_pass=round(curves.tokens_per_pass[-1], 3),
        tokens_per_pass_curve=[round(t, 3) for t in curves.tokens_per_pass], final_loss=round(curves.loss[-1], 3),
        seconds=round(time.perf_counter() - started),
    )  # fmt: skip
    if args.head:
        save_head(head, args.head, fingerprint, dict(row, held_out_alpha=curves.alpha[-1]))
    print(json.dumps(row), flush=True)
    return row


if __name__ == "__main__":
    main()
