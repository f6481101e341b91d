"""A race's estimated time per lane against the lane decoded alone: per prompt, the race (every lane a row of one
batch, each priced as it would run alone from the target's measured pass costs and its own drafting time) and each
lane alone (a one-row decoder, the same drafter kind, settings and seed), wall clock, in an order rotated each repeat;
medians of --repeats. A lane's estimate should be within 15% of its time alone, and alone it should write its race text.

    python -m benchmarks.race --prompts benchmarks/prompts/race-fresh.jsonl --output FILE.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import torch

from specdemo.bench.prompts import PROMPTS, BenchPrompt, load_prompts
from specdemo.config import RULES, SamplingConfig, SpeculativeConfig
from specdemo.core.race import TARGET_LANE, LaneFigures, RaceCosts, pass_seconds
from specdemo.core.rounds import Round
from specdemo.core.stats import emitted_ids
from specdemo.engine.decoding import autoregressive_generate, speculative_generate
from specdemo.engine.drafting import build_drafter, prepare_drafter
from specdemo.engine.race import check_lanes, race, race_costs
from specdemo.engine.setup import load_pair
from specdemo.models.loading import LoadedModel, prompt_token_ids
from specdemo.models.shared import ModelCache
from specdemo.pairs import DEFAULT_PAIR, custom_pair, find_pair, pair_dtype

TOLERANCE = 0.15  # an estimate within 15% of the lane's time alone is good enough to compare lanes by
RACE = "race"  # the method that runs every lane at once
DEFAULT_LANES = "target,ngram,suffix,recurrent,hybrid"
BFLOAT16_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile")  # a CPU's native bfloat16: AVX-512 BF16 and AMX


def flags() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", default=DEFAULT_PAIR.key, help="the pair whose target races (and draft model)")
    parser.add_argument("--model", help="a target in place of the pair's: an offline name, a Hub id or a directory")
    parser.add_argument("--lanes", default=DEFAULT_LANES, help="comma-separated lanes (the target lane is added)")
    parser.add_argument("--prompts", help="a prompts file (default: the bench's)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--rule", default="standard", choices=RULES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-draft-tokens", type=int, default=SpeculativeConfig.num_draft_tokens)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--output", help="where the JSON results go")
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = flags().parse_args(argv)
    pair = find_pair(args.pair)
    pair = custom_pair(args.model, pair.drafter, allow_local=True) if args.model else pair
    lanes = check_lanes(args.lanes, pair)
    sampling = SamplingConfig(temperature=args.temperature, rule=args.rule, seed=args.seed)
    speculative = SpeculativeConfig(
        num_draft_tokens=args.num_draft_tokens,
        max_new_tokens=args.max_new_tokens,
        draft_temperature=pair.draft_temperature,
    )
    prompts = load_prompts(args.prompts) if args.prompts else PROMPTS
    device = torch.device("cpu")
    dtype = pair_dtype(pair, args.dtype, device)
    target, draft = load_pair(pair, ModelCache(), print, device=device, allow_local=True, dtype=dtype)
    for lane in lanes:
        prepare_drafter(lane, target, print)  # a cost-aware kind's pass costs, outside every timed run
    methods = race_methods(lanes, target, draft, sampling, speculative)
    warm_ids = prompt_token_ids(target, "Hello!")
    for method in methods.values():
        method(warm_ids)  # first calls pay one-time initialisation
    machine_before = machine()
    rows = measure(methods, target, speculative, sampling, prompts, args.repeats)
    results = {
        **machine_before,
        "load_average_after": machine()["load_average"],
        "dtype": str(target.model.dtype).removeprefix("torch."),
        "pair": pair.key,
        "model": target.name,
        "lanes": lanes,
        "temperature": sampling.temperature,
        "rule": sampling.rule,
        "seed": sampling.seed,
        "num_draft_tokens": speculative.num_draft_tokens,
        "max_new_tokens": speculative.max_new_tokens,
        "repeats": args.repeats,
        "tolerance": TOLERANCE,
        "rows": rows,
        "worst": worst_by_lane(rows),
    }
    report(results, args.output)
    return results


Method = Callable[[list[int]], list]  # prompt ids -> the race's lanes, or one lane's rounds alone


def measure(
    methods: dict[str, Method],
    target: LoadedModel,
    speculative: SpeculativeConfig,
    sampling: SamplingConfig,
    prompts: Sequence[BenchPrompt],
    repeats: int,
) -> list[dict]:
    """Every prompt's lane rows, each prompt's printed as a markdown table's rows once measured."""
    print(TABLE_HEADER, flush=True)
    rows = []
    for index, prompt in enumerate(prompts):
        prompt_ids = prompt_token_ids(target, prompt.text)
        costs = race_costs(target, prompt_ids, speculative, sampling)  # measured here, not in a timed run
        timed = time_methods(methods, prompt_ids, costs, repeats, shift=index)
        rows.extend(lane_rows(prompt.name, bool(prompt.grounded), len(prompt_ids), timed, costs))
        print("\n".join(table_row(row) for row in rows if row["prompt"] == prompt.name), flush=True)
    return rows


def report(results: dict, output: str | None) -> None:
    """The worst estimate of each lane, printed; the results written as JSON to `output` if given."""
    worst = ", ".join(f"{lane} {share:.1%}" for lane, share in results["worst"].items())
    print(f"\nworst |estimated ÷ alone - 1| over the prompts: {worst}")
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(json.dumps(results, indent=2))
        print(f"Wrote {output}")


def race_methods(
    lanes: list[str],
    target: LoadedModel,
    draft: LoadedModel | None,
    sampling: SamplingConfig,
    speculative: SpeculativeConfig,
) -> dict[str, Method]:
    """The race, then each lane alone: a fresh drafter of the lane's kind (or the draft model) in a one-row decoder,
    or target-only decoding for the target lane, each with the race's settings and seed."""

    def run_race(prompt_ids: list[int]) -> list:
        runs = []
        for runs in race(target, draft, lanes, prompt_ids, sampling, speculative):  # noqa: B007 (the last is kept)
            pass
        return runs

    def alone(lane: str, prompt_ids: list[int]) -> list[Round]:
        ids = torch.tensor([prompt_ids], device=target.device)  # [1, T]
        if lane == TARGET_LANE:
            rounds = autoregressive_generate(
                target.model, ids, sampling, speculative.max_new_tokens, target.eos_token_ids
            )
        else:
            drafter = build_drafter(lane, target, draft)  # what the race builds for the lane: kind defaults
            rounds = speculative_generate(target.model, drafter, ids, sampling, speculative, target.eos_token_ids)
        return list(rounds)

    return {RACE: run_race, **{lane: partial(alone, lane) for lane in lanes}}


def time_methods(
    methods: dict[str, Method], prompt_ids: list[int], costs: RaceCosts, repeats: int, shift: int
) -> dict[str, dict]:
    """Every method once a repeat, one at a time, the order rotated each repeat so none always runs first or warm; per
    lane: its figures in each race, its seconds and rounds alone in each repeat."""
    names = list(methods)
    lanes: dict[str, dict] = {name: {"figures": [], "alone_seconds": [], "alone_rounds": []} for name in names[1:]}
    race_seconds = []
    for repeat in range(repeats):
        start = (shift + repeat) % len(names)
        for name in names[start:] + names[:start]:
            started = time.perf_counter()
            outcome = methods[name](prompt_ids)
            seconds = time.perf_counter() - started
            if name == RACE:
                race_seconds.append(seconds)
                for run in outcome:
                    lanes[run.name]["figures"].append(run.figures(costs))
            else:
                lanes[name]["alone_seconds"].append(seconds)
                lanes[name]["alone_rounds"].append(outcome)
    return {lane: {**timed, "race_seconds": race_seconds} for lane, timed in lanes.items()}


def lane_rows(prompt: str, grounded: bool, prompt_tokens: int, timed: dict[str, dict], costs: RaceCosts) -> list[dict]:
    """One row a lane: the medians of its estimated and its alone seconds, their ratio, and whether each repeat alone
    wrote the tokens it wrote in the race of the same repeat; beside them, the first round (the prompt's read) priced
    and as timed alone, where an estimate is most likely to part from the clock."""
    rows = []
    for lane, figures_and_times in timed.items():
        figures: list[LaneFigures] = figures_and_times["figures"]
        estimated = statistics.median(f.estimated_seconds for f in figures)
        alone = statistics.median(figures_and_times["alone_seconds"])
        ratio = estimated / alone
        alone_rounds: list[list[Round]] = figures_and_times["alone_rounds"]
        rows.append(
            {
                "prompt": prompt,
                "grounded": grounded,
                "prompt_tokens": prompt_tokens,
                "lane": lane,
                "new_tokens": len(figures[0].token_ids),
                "passes": figures[0].passes,
                "alone_passes": len(alone_rounds[0]),
                "step_seconds": round(costs.passes.step_seconds, 5),  # the measured one-token pass it prices from
                "first_pass_seconds": round(costs.first_seconds, 4),  # the measured pass reading the prompt alone
                "first_round_estimated_seconds": round(pass_seconds(alone_rounds[0][:1], costs), 4),
                "first_round_alone_seconds": round(statistics.median(r[0].wall_seconds for r in alone_rounds), 4),
                "estimated_seconds": round(estimated, 4),
                "pass_seconds": round(statistics.median(f.pass_seconds for f in figures), 4),
                "drafting_seconds": round(statistics.median(f.drafting_seconds for f in figures), 4),
                "alone_seconds": round(alone, 4),
                "ratio": round(ratio, 4),
                "within_tolerance": abs(ratio - 1) <= TOLERANCE,
                "same_text": all(
                    f.token_ids == emitted_ids(rounds) for f, rounds in zip(figures, alone_rounds, strict=True)
                ),
                "race_seconds": round(statistics.median(figures_and_times["race_seconds"]), 4),
                "error": next((f.error for f in figures if f.error), None),
            }
        )
    return rows


def worst_by_lane(rows: list[dict]) -> dict[str, float]:
    """Each lane's largest |estimated ÷ alone - 1| over the prompts."""
    worst: dict[str, float] = {}
    for row in rows:
        worst[row["lane"]] = max(worst.get(row["lane"], 0.0), round(abs(row["ratio"] - 1), 4))
    return worst


TABLE_HEADER = "| prompt | lane | estimated s | alone s | ratio | same text |\n|---|---|---|---|---|---|"


def table_row(row: dict) -> str:
    mark = "" if row["within_tolerance"] else " *"
    same = "yes" if row["same_text"] else "no"
    return (
        f"| {row['prompt']} | {row['lane']} | {row['estimated_seconds']:.2f} | {row['alone_seconds']:.2f} | "
        f"{row['ratio']:.3f}{mark} | {same} |"
    )


def machine() -> dict:
    """The CPU (lscpu's model name and its native bfloat16 flags), torch's threads and version, the host's load and the
    date."""
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout if shutil.which("lscpu") else ""
    fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    cpu_flags = set(fields.get("Flags", "").split())
    return {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": fields.get("Model name", platform.processor() or platform.machine()).strip(),
        "bfloat16_flags": [flag for flag in BFLOAT16_FLAGS if flag in cpu_flags],
        "torch_threads": torch.get_num_threads(),
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,  # over a minute: 0 on an idle host
        "torch": torch.__version__,
    }


if __name__ == "__main__":
    main()
