"""Where a round's time outside the model goes: one row, greedy, a 128-token context, random drafts (every draft is
rejected), the median of 40 rounds per pass width, in milliseconds.

    PYTHONPATH=. .venv/bin/python benchmarks/phases.py --widths 1 17 1 17"""

from __future__ import annotations

import collections
import statistics
import sys
import time

import torch

import specdemo.engine.decoding as decoding
import specdemo.models.tree_cache as tree_cache
from specdemo import SamplingConfig, SpeculativeConfig
from specdemo.engine.costs import _RandomDrafter

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import load, parser


def main(argv: list[str] | None = None) -> dict[int, dict[str, float]]:
    flags = parser(__doc__)
    flags.add_argument("--widths", type=int, nargs="+", default=[1, 17], help="tokens a pass reads")
    flags.add_argument("--rounds", type=int, default=40)
    args = flags.parse_args(argv)
    model = load(args).model
    spent: dict[str, list[float]] = collections.defaultdict(list)
    timers = [
        (decoding, "_row_tensors"),
        (decoding, "_pad_and_verify"),
        (tree_cache.TreeLayout, "plan"),
        (tree_cache.RowCache, "begin"),
        (model, "forward"),
    ]
    originals = [(owner, name, getattr(owner, name)) for owner, name in timers]
    for owner, name, function in originals:
        setattr(owner, name, _timed(function, spent, name))
    results = {}
    try:
        for width in args.widths:
            results[width] = _phases(model, width, args.rounds, spent)
            line = ", ".join(f"{name} {ms:.2f}" for name, ms in results[width].items())
            print(f"width {width}: {line} (ms, medians)")
    finally:
        for owner, name, function in originals:
            setattr(owner, name, function)
    return results


def _timed(function, spent: dict[str, list[float]], name: str):
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        result = function(*args, **kwargs)
        spent[name].append(1e3 * (time.perf_counter() - started))
        return result

    return wrapper


def _phases(model, width: int, rounds: int, spent: dict[str, list[float]]) -> dict[str, float]:
    generator = torch.Generator().manual_seed(0)
    drafter = _RandomDrafter(generator, model.config.vocab_size)
    drafter.num_tokens = width - 1
    decoder = decoding.BatchDecoder(model, drafter, frozenset())
    prompt = torch.randint(model.config.vocab_size, (128,), generator=generator).tolist()
    decoder.add(0, prompt, SamplingConfig(), SpeculativeConfig(max_new_tokens=2048))
    for _ in range(5):
        decoder.step()
    spent.clear()
    round_ms = []
    for _ in range(rounds):
        started = time.perf_counter()
        decoder.step()
        round_ms.append(1e3 * (time.perf_counter() - started))
    median = {name: statistics.median(times) for name, times in spent.items() if times}
    return {"outside the model": statistics.median(round_ms) - median.pop("forward"), **median}


if __name__ == "__main__":
    main()
