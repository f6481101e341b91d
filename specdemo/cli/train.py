"""`python -m specdemo train-drafter`: train the recurrent drafter's head for a target on this machine."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from functools import partial
from pathlib import Path

from specdemo.drafters.head_file import head_path
from specdemo.models import onednn
from specdemo.models.loading import OFFLINE_DEFAULT, check_model_name, load_model
from specdemo.models.offline import cache_root
from specdemo.training.data import INSTRUCTIONS, DataSettings
from specdemo.training.fit import LABELS, UNROLLS, FitSettings
from specdemo.training.run import train_drafter

QUICK = dict(num_texts=512, steps=1500)  # --quick: minutes on a laptop's CPU (docs/recurrent-drafter.md)
DEFAULT_CURVES = Path("docs/recurrent-head-training.png")


def add_parser(commands: argparse._SubParsersAction, progress) -> None:
    train = commands.add_parser("train-drafter", help="train the recurrent drafter's head on the target's own texts")
    train.add_argument("--target", default=OFFLINE_DEFAULT, help="the target model (default: %(default)s)")
    train.add_argument("--quick", action="store_true", help="fewer texts and steps: minutes, and a weaker head")
    train.add_argument("--texts", type=int, help=f"texts the target writes (default {DataSettings.num_texts})")
    train.add_argument(
        "--instructions",
        choices=INSTRUCTIONS,
        default=DataSettings.instructions,
        help="what the target answers: the package's instructions, requests it writes itself, or half of each "
        "(default: %(default)s)",
    )
    train.add_argument("--new-tokens", type=int, default=DataSettings.max_new_tokens, help="tokens per text at most")
    train.add_argument("--steps", type=int, help=f"training steps (default {FitSettings.steps})")
    train.add_argument("--batch-size", type=int, default=FitSettings.batch_size, help="positions per step")
    train.add_argument("--depth", type=int, default=FitSettings.depth, help="draft positions trained")
    train.add_argument("--vocabulary-size", type=int, default=FitSettings.vocabulary_size, help="the head's tokens")
    train.add_argument("--labels", choices=LABELS, default=FitSettings.labels, help="the target's argmax, or its top")
    train.add_argument(
        "--layers",
        type=int,
        nargs="+",
        help="the target's hidden states the head reads, as indices into hidden_states (-1 the final one; default: "
        "an early, a middle and the final one)",
    )
    train.add_argument(
        "--unroll", choices=UNROLLS, default=FitSettings.unroll, help="what draft positions 2..K read in training"
    )
    train.add_argument("--generate-batch-size", type=int, default=DataSettings.batch_size, help="texts written at once")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--cache", type=Path, default=cache_root() / "training", help="texts and checkpoints")
    train.add_argument("--output", type=Path, help="the head file (default: the one the project ships)")
    train.add_argument(
        "--curves", type=Path, help=f"the curves picture (default with the shipped head: {DEFAULT_CURVES})"
    )
    train.set_defaults(run=partial(train_command, progress=progress))


def train_command(args: argparse.Namespace, progress) -> int:
    check_model_name(args.target, allow_local=True)
    onednn.uncap()  # before the target's first product: AMX's kernels where the CPU has them (models/onednn.py)
    quick = QUICK if args.quick else {}
    data = DataSettings(
        num_texts=quick.get("num_texts", DataSettings.num_texts) if args.texts is None else args.texts,
        max_new_tokens=args.new_tokens,
        batch_size=args.generate_batch_size,
        seed=args.seed,
        instructions=args.instructions,
    )
    settings = FitSettings(
        steps=quick.get("steps", FitSettings.steps) if args.steps is None else args.steps,
        batch_size=args.batch_size,
        depth=args.depth,
        vocabulary_size=args.vocabulary_size,
        labels=args.labels,
        layers=tuple(args.layers or ()),
        unroll=args.unroll,
        seed=args.seed,
    )
    if args.quick:
        settings = replace(settings, held_out_texts=min(settings.held_out_texts, 32))
    output = args.output or head_path(args.target)
    curves = args.curves or (DEFAULT_CURVES if args.output is None else output.with_suffix(".png"))
    target = load_model(args.target, progress)
    summary = train_drafter(target, data, settings, args.cache, output, curves, progress)
    print(json.dumps(summary))
    return 0
