"""Tokens per target pass of the recurrent head, its beams and the hybrid, beside the suffix drafter, on a prompts file:
greedy (each run decides the same rounds, so no timing is needed) and sampled at a temperature (seeded), with α per
draft position and the tokens each pass verifies (the tree, root included). Speeds come from `python -m specdemo bench`.
--head compares another head file (e.g. one from `train-drafter --quick --output F`) with the same runs.

    python -m benchmarks.recurrent --prompts benchmarks/prompts/head-fresh-6.jsonl --runs "head W=1" hybrid --seeds 1"""

from __future__ import annotations

import json
import statistics
from functools import partial
from pathlib import Path

from benchmarks.common import load, parser
from specdemo.bench.prompts import PROMPTS, read_prompts_file
from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.core.planning import PassCosts
from specdemo.core.stats import run_stats
from specdemo.drafters.head_file import cached_head, head_path, load_head
from specdemo.drafters.hybrid import HybridDrafter
from specdemo.drafters.recurrent import RecurrentDrafter
from specdemo.drafters.suffix import SuffixDrafter
from specdemo.engine.costs import pass_costs
from specdemo.engine.decoding import speculative_generate
from specdemo.engine.drafting import build_drafter, prepare_drafter
from specdemo.models.loading import chat_prompt_ids

RUNS = (  # (label, drafter kind, W)
    ("suffix", "suffix", 1),
    ("head W=1", "recurrent", 1),
    ("head W=2", "recurrent", 2),
    ("head W=3", "recurrent", 3),
    ("hybrid", "hybrid", 2),
    ("hybrid W=4", "hybrid", 4),  # the copy and three beams of the head: a tree a GPU verifies at the cost of one
)


# The planner's pass costs t(n) / t(1) on an NVIDIA H200 in bfloat16 (../shared/PLATFORM.md: the planner's rounds
# 1.01 up to 8 tokens, 1.04 at 12-16, 1.84 at 24): where verifying is nearly free and tokens per pass is speed.
H200_COSTS = PassCosts.from_seconds({1: 1.0, 2: 1.01, 4: 1.01, 8: 1.01, 12: 1.04, 16: 1.04, 24: 1.84})


def fresh_drafter(kind: str, target, head, costs_name: str):
    """A drafter with no memory of other prompts; the recurrent kinds with `head` where one is given, the hybrid
    planning with this machine's pass costs or the H200's."""
    if kind not in ("recurrent", "hybrid") or (head is None and costs_name == "measured"):
        return build_drafter(kind, target)
    recurrent = RecurrentDrafter(head or cached_head(target.model, head_path(target.name)), target.vocab_size)
    if kind == "recurrent":
        return recurrent
    costs = partial(pass_costs, target.model) if costs_name == "measured" else lambda n: H200_COSTS
    return HybridDrafter(SuffixDrafter(costs), recurrent, costs, target.vocab_size)


def one_run(target, kind: str, width: int, prompt_ids, sampling: SamplingConfig, args, head=None) -> dict:
    spec = SpeculativeConfig(
        num_draft_tokens=args.num_draft_tokens, max_new_tokens=args.max_new_tokens, num_candidates=width
    )
    drafter = fresh_drafter(kind, target, head, args.costs)
    rounds = list(speculative_generate(target.model, drafter, prompt_ids, sampling, spec, target.eos_token_ids))
    stats = run_stats(rounds)
    verified = [1 + sum(len(c.token_ids) for c in r.candidates) for r in rounds]
    return {
        "tokens_per_pass": stats.mean_tokens_per_round,
        "alpha_by_position": list(stats.alpha_by_position),
        "tested_by_position": list(stats.tested_by_position),
        "tree": statistics.mean(verified),
        "new_tokens": stats.num_generated,
    }


def pooled_alpha(runs: list[dict]) -> list[float]:
    """α per position over runs, weighted by the tests each rests on."""
    depth = max(len(run["alpha_by_position"]) for run in runs)
    alpha = []
    for k in range(depth):
        tested = sum(run["tested_by_position"][k] for run in runs if len(run["tested_by_position"]) > k)
        accepted = sum(
            run["alpha_by_position"][k] * run["tested_by_position"][k]
            for run in runs
            if len(run["tested_by_position"]) > k
        )
        alpha.append(round(accepted / tested, 3) if tested else 0.0)
    return alpha


def main(argv: list[str] | None = None) -> dict:
    flags = parser(__doc__)
    flags.add_argument("--prompts", nargs="+", help="prompts files, pooled (default: the bench's own prompts)")
    flags.add_argument("--max-new-tokens", type=int, default=128)
    flags.add_argument("--num-draft-tokens", type=int, default=4)
    flags.add_argument("--temperature", type=float, default=0.7, help="the sampled runs' temperature")
    flags.add_argument("--seeds", type=int, default=2, help="sampled runs per prompt")
    flags.add_argument("--head", type=Path, help="a head file to measure instead of the shipped one")
    flags.add_argument(
        "--costs",
        choices=["measured", "h200"],
        default="measured",
        help="the hybrid's pass costs: this machine's, or an H200's (nearly flat: tokens per pass is speed there)",
    )
    flags.add_argument("--runs", nargs="+", choices=[label for label, _, _ in RUNS], help="some runs only")
    args = flags.parse_args(argv)
    target = load(args)
    head = load_head(target.model, args.head) if args.head else None
    runs = [run for run in RUNS if args.runs is None or run[0] in args.runs]
    for kind in ("suffix", "hybrid"):
        prepare_drafter(kind, target, lambda message: None)
    prompts = (
        [prompt for path in args.prompts for prompt in read_prompts_file(path).prompts] if args.prompts else PROMPTS
    )
    rows = []
    for prompt in prompts:
        prompt_ids = chat_prompt_ids(target, prompt.text)
        row = {"prompt": prompt.name, "grounded": prompt.grounded, "greedy": {}, "sampled": []}
        for label, kind, width in runs:
            row["greedy"][label] = one_run(target, kind, width, prompt_ids, SamplingConfig(), args, head)
        for seed in range(args.seeds):
            sampling = SamplingConfig(temperature=args.temperature, seed=seed)
            row["sampled"].append(one_run(target, "recurrent", 1, prompt_ids, sampling, args, head))
        rows.append(row)
        print(
            json.dumps({"prompt": prompt.name, **{k: round(v["tokens_per_pass"], 2) for k, v in row["greedy"].items()}})
        )
    summary = {}
    for group, grounded in (("open-ended", False), ("grounded", True)):
        chosen = [row for row in rows if row["grounded"] == grounded]
        if not chosen:
            continue
        summary[group] = {
            label: {
                "tokens_per_pass_median": round(
                    statistics.median(r["greedy"][label]["tokens_per_pass"] for r in chosen), 3
                ),
                "tokens_per_pass_mean": round(
                    statistics.mean(r["greedy"][label]["tokens_per_pass"] for r in chosen), 3
                ),
                "tree_mean": round(statistics.mean(r["greedy"][label]["tree"] for r in chosen), 2),
                "alpha_by_position": pooled_alpha([r["greedy"][label] for r in chosen]),
            }
            for label, _, _ in runs
        }
        sampled = [run for r in chosen for run in r["sampled"]]
        if not sampled:
            continue
        summary[group][f"head W=1, T={args.temperature:g}"] = {
            "tokens_per_pass_median": round(statistics.median(run["tokens_per_pass"] for run in sampled), 3),
            "alpha_by_position": pooled_alpha(sampled),
        }
    result = {"dtype": args.dtype, "head": str(args.head or "shipped"), "summary": summary, "rows": rows}
    result["max_new_tokens"] = args.max_new_tokens
    print(json.dumps({"summary": summary}, indent=1))
    return result


if __name__ == "__main__":
    main()
