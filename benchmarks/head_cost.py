"""What a recurrent-head draft step costs against a target step, by sub-vocabulary size S: the median time of the
drafter's propose() for one row (K tokens, W = 1, greedy and sampled) per drafted token, over an engine round of the
target with one token after a 200-token context (the pass, the cache's bookkeeping, the probabilities and the rule).
Random head weights (the cost does not depend on them), in the target's format, as load_head gives them.

    PYTHONPATH=. .venv/bin/python benchmarks/head_cost.py --dtype bfloat16"""

from __future__ import annotations

import json
import statistics
import time

import torch
from common import load, parser

from specdemo.config import SamplingConfig
from specdemo.drafters.base import DraftRequest
from specdemo.drafters.recurrent import RecurrentDrafter, RecurrentHead
from specdemo.engine.costs import measure_round_seconds


def draft_step_seconds(drafter: RecurrentDrafter, sampling: SamplingConfig, depth: int, repeats: int) -> float:
    hidden = torch.randn(drafter.head.shape.hidden_size)
    generator = torch.Generator().manual_seed(0)
    times = []
    for repeat in range(repeats + 1):
        request = DraftRequest(repeat, [1, 2, 3], depth, 1, sampling, generator, hidden)
        started = time.perf_counter()
        drafter.propose([request])
        if repeat:
            times.append((time.perf_counter() - started) / depth)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    flags = parser(__doc__)
    flags.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768, 49152])
    flags.add_argument("--depth", type=int, default=4)
    flags.add_argument("--repeats", type=int, default=21)
    args = flags.parse_args(argv)
    target = load(args)
    vocab_size = target.vocab_size
    target_round = measure_round_seconds(target.model, (1,), 200, args.repeats, rows=(1,))[1][1]
    result: dict = {"dtype": args.dtype, "target_round_ms": round(1e3 * target_round, 2), "sizes": {}}
    for size in args.sizes:
        head = RecurrentHead(target.model, torch.arange(min(size, vocab_size))).to(target.model.dtype).eval()
        drafter = RecurrentDrafter(head, vocab_size)
        greedy = draft_step_seconds(drafter, SamplingConfig(), args.depth, args.repeats)
        sampled = draft_step_seconds(drafter, SamplingConfig(temperature=0.7), args.depth, args.repeats)
        result["sizes"][min(size, vocab_size)] = {
            "greedy_ms": round(1e3 * greedy, 3),
            "sampled_ms": round(1e3 * sampled, 3),
            "greedy_share": round(greedy / target_round, 4),
            "sampled_share": round(sampled / target_round, 4),
        }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
