"""What the analysis scripts share: the flags that pick a model and its number format, and loading it."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from specdemo import OFFLINE_DEFAULT, LoadedModel, load_model


def parser(description: str) -> argparse.ArgumentParser:
    flags = argparse.ArgumentParser(description=description)
    flags.add_argument("--model", default=OFFLINE_DEFAULT, help="an offline name, a Hub id or a directory")
    flags.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    return flags


def load(args: argparse.Namespace) -> LoadedModel:
    return load_model(args.model, device=torch.device("cpu"), dtype=getattr(torch, args.dtype), allow_local=True)


def chunks(directory: Path, span: str) -> list[Path]:
    """train-drafter's text chunks FIRST-LAST of a cache directory."""
    first, last = map(int, span.split("-"))
    return [directory / f"texts-{index:04d}.pt" for index in range(first, last + 1)]
