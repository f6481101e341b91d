"""Why one static batch gains little from drafting: the prompts as one batch of eight rows through BatchDecoder, once
with nothing drafted and once with prompt lookup cut for shared passes, twice each.

    PYTHONPATH=. .venv/bin/python benchmarks/static.py --prompts benchmarks/prompts/fresh.jsonl"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from specdemo import NoDrafter, SamplingConfig, SpeculativeConfig, build_drafter
from specdemo.bench.prompts import PROMPTS, load_prompts
from specdemo.engine.costs import batch_costs
from specdemo.engine.decoding import BatchDecoder
from specdemo.models.loading import chat_prompt_ids

sys.path.insert(0, str(Path(__file__).parent))
from common import load, parser


def main(argv: list[str] | None = None) -> list[dict]:
    flags = parser(__doc__)
    flags.add_argument("--prompts", help="a prompts file (default: the bench's)")
    flags.add_argument("--rows", type=int, default=8)
    flags.add_argument("--max-new-tokens", type=int, default=128)
    flags.add_argument("--repeats", type=int, default=2)
    args = flags.parse_args(argv)
    target = load(args)
    texts = [p.text for p in (load_prompts(args.prompts) if args.prompts else PROMPTS)]
    prompts = [chat_prompt_ids(target, texts[i % len(texts)])[0].tolist() for i in range(args.rows)]
    spec, costs = SpeculativeConfig(max_new_tokens=args.max_new_tokens), batch_costs(target.model, args.rows)
    results = []
    for _ in range(args.repeats):
        alone = one_batch(target, prompts, spec, NoDrafter(), None)
        drafted = one_batch(target, prompts, spec, build_drafter("ngram", target), costs)
        results.append({"target-only": alone, "drafting": drafted})
        print(
            f"target-only: {alone['rounds']} rounds, {alone['tokens_per_second']:.1f} tokens/s, full rounds "
            f"{alone['full_round_ms']:.1f} ms; drafting: {drafted['rounds']} rounds, "
            f"{drafted['tokens_per_second']:.1f} tokens/s, full rounds {drafted['full_round_ms']:.1f} ms "
            f"({drafted['tokens_per_second'] / alone['tokens_per_second']:.2f}x)"
        )
    return results


def one_batch(target, prompts: list[list[int]], spec, drafter, costs) -> dict:
    """The rows as one static batch: its rounds, tokens/s, and the median round while every row decodes."""
    decoder, log = BatchDecoder(target.model, drafter, target.eos_token_ids, costs=costs), []
    for i, prompt in enumerate(prompts):
        decoder.add(i, prompt, SamplingConfig(), spec)
    started = time.perf_counter()
    while decoder.rows:
        round_started = time.perf_counter()
        rounds = [r for _, r in decoder.step()]
        log.append((len(rounds), time.perf_counter() - round_started, sum(len(r.emitted_token_ids) for r in rounds)))
    seconds = time.perf_counter() - started
    full = [1e3 * s for rows, s, _ in log if rows == len(prompts)] or [0.0]
    return {
        "rounds": len(log),
        "tokens_per_second": sum(t for *_, t in log) / seconds,
        "full_round_ms": statistics.median(full),
    }


if __name__ == "__main__":
    main()
