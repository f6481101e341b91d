"""The command line's entry point: `python -m specdemo generate|bench|race|pairs|train-drafter ...`; every refusal is
one sentence and exit code 2, a failed run one sentence and exit code 1."""

from __future__ import annotations

import argparse
import sys

from specdemo.cli import bench, generate, race, train
from specdemo.engine.setup import pair_marks
from specdemo.models.loading import pick_device
from specdemo.pairs import pairs_table

EXIT_BAD_INPUT = 2  # as argparse uses for bad arguments
EXIT_RUN_FAILED = 1  # the settings were fine but the run failed (a model error, out of memory...)


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m specdemo", description="Speculative decoding, made visible.")
    commands = parser.add_subparsers(dest="command", required=True)
    generate.add_parser(commands, _progress)
    commands.add_parser("pairs", help="list the draft/target pairs").set_defaults(run=_pairs)
    bench.add_parser(commands, _progress)
    race.add_parser(commands, _progress)
    train.add_parser(commands, _progress)
    return parser


def _pairs(args: argparse.Namespace) -> int:
    print(pairs_table(pair_marks(pick_device())))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as error:  # a model error, out of memory...: one sentence, the traceback only on request
        if getattr(args, "debug", False):
            raise
        detail = str(error).strip().splitlines()[0][:200] if str(error).strip() else "no message"
        print(
            f"error: the run failed ({error.__class__.__name__}: {detail}); run it again with --debug for the "
            "traceback.",
            file=sys.stderr,
        )
        return EXIT_RUN_FAILED
