"""Does a row's text depend on the rows beside it? Greedy texts of a set of prompts decoded at B = 1 and at B = 8, with
prompt lookup and with the target alone, and speculative against target-only, in one number format; with the speed of
each.

    python -m benchmarks.invariance --dtype bfloat16 --prompts benchmarks/prompts/house-fresh.jsonl"""

from __future__ import annotations

import time

from benchmarks.common import load, parser
from specdemo import NgramDrafter, NoDrafter, SamplingConfig, SpeculativeConfig, batch_generate
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


def main(argv: list[str] | None = None) -> dict:
    flags = parser(__doc__)
    flags.add_argument("--prompts", help="a prompts file (default: the bench's)")
    flags.add_argument("--max-new-tokens", type=int, default=64)
    args = flags.parse_args(argv)
    loaded = load(args)
    chosen = load_prompts(args.prompts) if args.prompts else PROMPTS
    prompts = [chat_prompt_ids(loaded, p.text)[0].tolist() for p in chosen]
    results = {}
    for name, drafter in (("speculative", NgramDrafter), ("target-only", NoDrafter)):
        for batch_size in (1, 8):
            results[name, batch_size] = texts(loaded, drafter, prompts, batch_size, args.max_new_tokens)

    def same(a: tuple, b: tuple) -> int:
        return sum(x == y for x, y in zip(results[a][0], results[b][0], strict=True))

    n = len(prompts)
    print(f"{loaded.description}, {n} prompts, {args.max_new_tokens} new tokens at most, greedy")
    print(f"speculative at B = 8 equal to B = 1: {same(('speculative', 8), ('speculative', 1))} of {n}")
    print(f"target-only at B = 8 equal to B = 1: {same(('target-only', 8), ('target-only', 1))} of {n}")
    print(f"speculative equal to target-only (B = 1): {same(('speculative', 1), ('target-only', 1))} of {n}")
    for (name, batch_size), (tokens, seconds) in results.items():
        print(f"{name:12s} B = {batch_size}: {sum(map(len, tokens)) / seconds:6.1f} tokens/s")
    return results


if __name__ == "__main__":
    main()
