"""The flags every command that decodes shares: the pair, the sampling and speculation settings, the drafter kinds'
own options (made from their options dataclasses), the number format, and reading them back as checked settings."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from specdemo.config import SamplingConfig, SpeculativeConfig, run_settings
from specdemo.drafters.registry import NGRAM, drafter_names, drafter_options, option_fields
from specdemo.models.loading import DTYPE_CHOICES, OFFLINE_DEFAULT, pick_device
from specdemo.pairs import PAIRS, Pair, custom_pair, find_pair, pair_dtype


@dataclass(frozen=True)
class CliSettings:
    """What the flags ask for, checked."""

    pair: Pair
    sampling: SamplingConfig
    speculative: SpeculativeConfig
    drafter_options: object | None  # the pair's drafter kind's options; None for a draft model
    dtype: torch.dtype


def add_pair_flags(parser: argparse.ArgumentParser, default_pair: str | None = None) -> None:
    parser.add_argument("--pair", default=default_pair, help="a pair from `python -m specdemo pairs`")
    parser.add_argument("--target", default=OFFLINE_DEFAULT, help="model name, Hub id or directory (without --pair)")
    parser.add_argument(
        "--draft", default=NGRAM, help=f"{drafter_names()} (no model), or a draft model name/Hub id/dir"
    )


def flag(name: str) -> str:
    """A setting's flag: `max_new_tokens` is --max-new-tokens."""
    return "--" + name.replace("_", "-")


def add_run_flags(parser: argparse.ArgumentParser, num_candidates: bool = True) -> None:
    """Sampling, speculation, every drafter kind's options, and the number format."""
    for name, (default, spec) in (run_settings(SamplingConfig) | run_settings(SpeculativeConfig)).items():
        if name == "num_candidates" and not num_candidates:
            continue
        shown = "" if default is None else f", default {default}"
        kind = str if spec.choices else int if spec.whole else float
        parser.add_argument(  # checked by the config, with its sentence (no argparse choices: the config's sentence)
            flag(name), type=kind, default=default, help=f"{spec.help}; {spec.limits()}{shown}"
        )
    for kind, spec in option_fields():  # one flag per option, made from the kind's options dataclass
        low, high = spec.metadata["low"], spec.metadata["high"]
        parser.add_argument(
            flag(spec.name),
            type=int,
            help=f"{spec.metadata['help']}, {low:,}..{high:,} (default {spec.default:,}; --draft {kind.name})",
        )
    parser.add_argument(  # no argparse choices: an unknown format gets resolve_dtype's sentence
        "--dtype",
        default="auto",
        metavar="{" + ",".join(DTYPE_CHOICES) + "}",
        help="weights and activations (probabilities stay float32); auto (the default): bfloat16 on GPUs of compute "
        "8.0 or newer and on CPUs with AMX or AVX-512 BF16, float16 on older GPUs (a T4), float32 elsewhere",
    )
    parser.add_argument("--debug", action="store_true", help="show the Python traceback when a run fails")


def cli_pair(args: argparse.Namespace) -> Pair:
    if args.pair:
        if args.target != OFFLINE_DEFAULT or args.draft != NGRAM:
            raise ValueError("Give either --pair or --target/--draft, not both.")
        return find_pair(args.pair)
    registered = [pair for pair in PAIRS if (pair.target, pair.drafter) == (args.target, args.draft)]
    if registered:
        return registered[0]
    return custom_pair(args.target, args.draft, allow_local=True)  # the command line may name directories


def read_settings(args: argparse.Namespace) -> CliSettings:
    """The flags as checked settings, before any model loads; a ValueError names the first bad one."""
    pair = cli_pair(args)
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p, args.repetition_penalty, args.seed, args.rule)
    speculative = SpeculativeConfig(
        num_draft_tokens=args.num_draft_tokens,
        max_new_tokens=args.max_new_tokens,
        draft_temperature=pair.draft_temperature if args.draft_temperature is None else args.draft_temperature,
        num_candidates=getattr(args, "num_candidates", SpeculativeConfig.num_candidates),  # bench: its list of W apart
    )
    given = {spec.name: (kind, getattr(args, spec.name)) for kind, spec in option_fields()}
    given = {name: (kind, value) for name, (kind, value) in given.items() if value is not None}
    for name, (kind, _) in given.items():
        if kind.name != pair.drafter:
            raise ValueError(
                f"--{name.replace('_', '-')} is an option of --draft {kind.name}, and this run drafts with "
                f"{pair.drafter}: leave it out, or pick --draft {kind.name}."
            )
    options = drafter_options(pair.drafter, {name: value for name, (_, value) in given.items()})
    return CliSettings(pair, sampling, speculative, options, pair_dtype(pair, args.dtype, pick_device()))
