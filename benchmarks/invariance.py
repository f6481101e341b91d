"""Does a row's text depend on the rows beside it? Greedy texts of a set of prompts decoded at B = 1 and at B = 8, with
prompt lookup and with the target alone, and speculative against target-only, in one number format; with the time
each took. Usage: python benchmarks/invariance.py [bfloat16|float32] [PROMPTS_FILE] [MAX_NEW_TOKENS]"""

from __future__ import annotations

import sys
import time

import torch

from specdemo import NgramDrafter, NoDrafter, SamplingConfig, SpeculativeConfig, batch_generate, load_model
from specdemo.bench.prompts import PROMPTS, load_prompts
from specdemo.models.loading import chat_prompt_ids


def texts(loaded, drafter_class, prompts: list[list[int]], batch_size: int, max_new_tokens: int) -> tuple[list, float]:
    """Every prompt's greedy tokens, decoded batch_size rows at a time, and the seconds it took."""
    out: dict[int, list[int]] = {}
    spec = SpeculativeConfig(max_new_tokens=max_new_tokens)
    greedy = [SamplingConfig()] * len(prompts)
    started = time.perf_counter()
    for index, round_ in batch_generate(
        loaded.model, drafter_class(), prompts, greedy, spec, loaded.eos_token_ids, batch_size
    ):
        out.setdefault(index, []).extend(round_.emitted_token_ids)
    return [out[i] for i in range(len(prompts))], time.perf_counter() - started


def main(dtype: str = "bfloat16", prompts_file: str | None = None, max_new_tokens: int = 64) -> None:
    loaded = load_model("smollm2-135m-instruct", dtype=getattr(torch, dtype))
    chosen = load_prompts(prompts_file) if prompts_file else PROMPTS
    prompts = [chat_prompt_ids(loaded, p.text)[0].tolist() for p in chosen]
    results = {}
    for name, drafter in (("speculative", NgramDrafter), ("target-only", NoDrafter)):
        for batch_size in (1, 8):
            results[name, batch_size] = texts(loaded, drafter, prompts, batch_size, max_new_tokens)
    same = lambda a, b: sum(x == y for x, y in zip(results[a][0], results[b][0], strict=True))  # noqa: E731
    n = len(prompts)
    print(f"{loaded.description}, {n} prompts, {max_new_tokens} new tokens at most, greedy")
    print(f"speculative at B = 8 equal to B = 1: {same(('speculative', 8), ('speculative', 1))} of {n}")
    print(f"target-only at B = 8 equal to B = 1: {same(('target-only', 8), ('target-only', 1))} of {n}")
    print(f"speculative equal to target-only (B = 1): {same(('speculative', 1), ('target-only', 1))} of {n}")
    for (name, batch_size), (tokens, seconds) in results.items():
        print(f"{name:12s} B = {batch_size}: {sum(map(len, tokens)) / seconds:6.1f} tokens/s")


if __name__ == "__main__":
    main(*sys.argv[1:2], *sys.argv[2:3], *map(int, sys.argv[3:4]))
