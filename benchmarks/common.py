"""What the benchmarks share: the flags that pick a model and its number format, and loading it."""

from __future__ import annotations

import argparse

import torch

from specdemo import OFFLINE_DEFAULT, LoadedModel, load_model


def parser(description: str) -> argparse.ArgumentParser:
    flags = argparse.ArgumentParser(description=description)
    flags.add_argument("--model", default=OFFLINE_DEFAULT, help="an offline name, a Hub id or a directory")
    flags.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    return flags


def load(args: argparse.Namespace) -> LoadedModel:
    return load_model(args.model, device=torch.device("cpu"), dtype=getattr(torch, args.dtype), allow_local=True)
