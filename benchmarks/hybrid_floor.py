"""The hybrid against our target-only decoding where drafting does not pay: the planner is handed pass costs that grow
with every token a pass reads (t(n) = n t(1), --costs linear), so no draft is worth its tokens and every round should
be a plain step; or the costs measured on this machine (--costs measured). Greedy, each prompt decoded by both,
interleaved, --repeats times; the speed ratio per prompt is the ratio of the median times, and the texts must agree.

    python -m benchmarks.hybrid_floor --prompts benchmarks/prompts/head-fresh-6.jsonl --dtype-auto --costs linear
"""

from __future__ import annotations

import json
import statistics
import time
from functools import partial

import torch

from benchmarks.common import parser
from specdemo import load_model
from specdemo.bench.prompts import read_prompts_file
from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.core.planning import PassCosts
from specdemo.core.stats import emitted_ids, run_stats
from specdemo.drafters.head_file import cached_head, head_path
from specdemo.drafters.hybrid import HybridDrafter
from specdemo.drafters.recurrent import RecurrentDrafter
from specdemo.drafters.suffix import SuffixDrafter
from specdemo.engine.costs import pass_costs
from specdemo.engine.decoding import autoregressive_generate, speculative_generate
from specdemo.engine.drafting import prepare_drafter
from specdemo.models.loading import chat_prompt_ids

LINEAR = PassCosts.from_seconds({n: float(n) for n in (1, 2, 4, 8, 16, 32, 64)})


def main(argv: list[str] | None = None) -> dict:
    flags = parser(__doc__.split("\n\n")[0])
    flags.add_argument("--prompts", required=True)
    flags.add_argument("--costs", choices=["linear", "measured"], default="linear")
    flags.add_argument("--dtype-auto", action="store_true", help="load in the app's format for this machine")
    flags.add_argument("--max-new-tokens", type=int, default=128)
    flags.add_argument("--num-draft-tokens", type=int, default=16)
    flags.add_argument("--repeats", type=int, default=2)
    flags.add_argument("--grounded", action="store_true", help="the grounded prompts, not the open-ended ones")
    args = flags.parse_args(argv)
    dtype = None if args.dtype_auto else getattr(torch, args.dtype)
    target = load_model(args.model, device=torch.device("cpu"), dtype=dtype)
    prepare_drafter("hybrid", target, print)
    costs = (lambda n: LINEAR) if args.costs == "linear" else partial(pass_costs, target.model)
    head = cached_head(target.model, head_path(target.name))
    spec = SpeculativeConfig(num_draft_tokens=args.num_draft_tokens, max_new_tokens=args.max_new_tokens)
    prompts = [p for p in read_prompts_file(args.prompts).prompts if bool(p.grounded) == args.grounded]
    rows = []
    for prompt in prompts:
        ids = chat_prompt_ids(target, prompt.text)
        times: dict[str, list[float]] = {"target": [], "hybrid": []}
        texts, per_pass = {}, 0.0
        for _ in range(args.repeats):
            for name in times:
                started = time.perf_counter()
                if name == "target":
                    rounds = list(autoregressive_generate(target.model, ids, SamplingConfig(), args.max_new_tokens,
                                                          target.eos_token_ids))  # fmt: skip
                else:
                    drafter = HybridDrafter(
                        SuffixDrafter(costs), RecurrentDrafter(head, target.vocab_size), costs, target.vocab_size
                    )
                    rounds = list(speculative_generate(target.model, drafter, ids, SamplingConfig(), spec,
                                                       target.eos_token_ids))  # fmt: skip
                    per_pass = run_stats(rounds).mean_tokens_per_round
                times[name].append(time.perf_counter() - started)
                texts[name] = emitted_ids(rounds)
        row = dict(
            prompt=prompt.name,
            speed_ratio=round(statistics.median(times["target"]) / statistics.median(times["hybrid"]), 3),
            hybrid_tokens_per_pass=round(per_pass, 3),
            same_text=texts["target"] == texts["hybrid"],
            tokens=len(texts["target"]),
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
    summary = dict(
        costs=args.costs,
        dtype=str(target.model.dtype).removeprefix("torch."),
        prompts=len(rows),
        median_speed_ratio=statistics.median(r["speed_ratio"] for r in rows),
        min_speed_ratio=min(r["speed_ratio"] for r in rows),
        median_tokens_per_pass=statistics.median(r["hybrid_tokens_per_pass"] for r in rows),
        same_text=sum(r["same_text"] for r in rows),
    )
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
