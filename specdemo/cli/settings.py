"""The flags every command that decodes shares: the pair, a flag per run setting (sampling, speculation and the
drafter kinds' options, as their configs declare them), the number format, and reading them back as checked
settings."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from specdemo.config import SamplingConfig, SpeculativeConfig, run_settings
from specdemo.drafters.registry import NGRAM, drafter_names, drafter_options, option_kinds, option_settings
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
    """A flag per run setting (sampling, speculation, every drafter kind's options: a kind's flags default to unset, so
    read_settings knows which were given), then the number format."""
    kinds = option_kinds()
    for name, (default, spec) in (
        run_settings(SamplingConfig) | run_settings(SpeculativeConfig) | option_settings()
    ).items():
        if name == "num_candidates" and not num_candidates:
            continue
        shown = "" if default is None else f", default {default:,}" if spec.whole else f", default {default}"
        draft = f" (--draft {kinds[name].name})" if name in kinds else ""
        parser.add_argument(  # checked by the config, with its sentence (no argparse choices: the config's sentence)
            flag(name),
            type=str if spec.choices else int if spec.whole else float,
            default=None if name in kinds else default,
            help=f"{spec.help}; {spec.limits()}{shown}{draft}",
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
    sampling = SamplingConfig(**{name: getattr(args, name) for name in run_settings(SamplingConfig)})
    speculative = SpeculativeConfig(  # bench: its list of W apart, so no --num-candidates
        **{name: getattr(args, name) for name in run_settings(SpeculativeConfig) if hasattr(args, name)}
        | {"draft_temperature": pair.draft_temperature if args.draft_temperature is None else args.draft_temperature}
    )
    kinds = option_kinds()
    given = {name: getattr(args, name) for name in kinds if getattr(args, name) is not None}
    for name in given:
        if kinds[name].name != pair.drafter:
            raise ValueError(
                f"{flag(name)} is an option of --draft {kinds[name].name}, and this run drafts with "
                f"{pair.drafter}: leave it out, or pick --draft {kinds[name].name}."
            )
    options = drafter_options(pair.drafter, given)
    return CliSettings(pair, sampling, speculative, options, pair_dtype(pair, args.dtype, pick_device()))
