"""`python -m specdemo bench`: our loops against Hugging Face generate, interleaved in one process; batched with
--batch-sizes; the pass costs with --pass-costs; the app's streaming with --app."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

from specdemo.bench.app import bench_app
from specdemo.bench.batch import batch_table, run_batch_bench
from specdemo.bench.prompts import PROMPTS, BenchPrompt, read_prompts_file
from specdemo.bench.single import bench_pass_costs, markdown_table, run_bench
from specdemo.cli.settings import CliSettings, add_pair_flags, add_run_flags, read_settings
from specdemo.config import check_batch_size, check_prompt_fits
from specdemo.core.planning import PassCosts
from specdemo.engine.costs import MEASURED_SIZES, batch_costs, measure_pass_seconds
from specdemo.engine.scheduler import MAX_BATCH_ROWS
from specdemo.engine.setup import load_pair
from specdemo.models.loading import model_dtype_reason, prompt_token_ids
from specdemo.models.packed import float32_product_seconds, is_packed
from specdemo.models.shared import ModelCache

PLANNER_SIZES = tuple(size for size in MEASURED_SIZES if size <= 24)  # what the suffix pair measures at load


def add_parser(commands: argparse._SubParsersAction, progress) -> None:
    bench = commands.add_parser("bench", help="benchmark against Hugging Face generate, interleaved")
    add_pair_flags(bench)
    bench.add_argument(
        "--prompts",
        metavar="FILE",
        help='your own prompts: JSON lines with "text", "name" and "grounded", or plain text',
    )
    add_run_flags(bench, num_candidates=False)
    bench.add_argument("--repeats", type=int, default=2, help="timed runs of each method per prompt (median)")
    bench.add_argument("--output", default="bench-results/bench.json", help="where the JSON results go")
    bench.add_argument("--markdown", metavar="JSON", help="print the table of an earlier run's JSON and exit")
    bench.add_argument("--app", action="store_true", help="measure the app's streaming overhead instead")
    bench.add_argument(
        "--pass-costs", action="store_true", help="measure t(k)/t(1), a k-token engine round over a one-token one"
    )
    bench.add_argument("--batch-sizes", metavar="B,B,...", help="batched bench instead, e.g. 1,2,4,8")
    bench.add_argument(
        "--num-candidates", dest="candidate_widths", default="1", metavar="W,W,...", help="with --batch-sizes: 1,2,4"
    )
    bench.set_defaults(run=partial(bench_command, progress=progress))


def bench_command(args: argparse.Namespace, progress) -> int:
    if args.markdown:
        print(markdown_table(json.loads(Path(args.markdown).read_text())))
        return 0
    if args.app:
        for row in bench_app(max_new_tokens=args.max_new_tokens):
            print(json.dumps(row))
        return 0
    settings = read_settings(args)  # every setting checked before any model loads
    if args.pass_costs:
        return pass_costs_command(settings, progress)
    if args.repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {args.repeats}.")
    prompts = PROMPTS
    if args.prompts:
        prompts_file = read_prompts_file(args.prompts)
        progress(f"Read {len(prompts_file.prompts)} prompts from {args.prompts} ({prompts_file.format}).")
        prompts = prompts_file.prompts
    if args.batch_sizes:
        return batch_bench_command(args, settings, prompts, progress)
    target, draft = load_pair(settings.pair, ModelCache(), progress, allow_local=True, dtype=settings.dtype)
    for prompt in prompts:
        prompt_length = len(prompt_token_ids(target, prompt.text))
        check_prompt_fits(prompt_length, settings.speculative.max_new_tokens, target.context_length)
    log = partial(print, flush=True)
    results = run_bench(
        target, draft, settings.speculative, args.repeats, prompts, log, settings.pair, settings.drafter_options
    )
    results["dtype_reason"] = model_dtype_reason(args.dtype, target.device, settings.pair.model_names)
    print(markdown_table(results))
    write(args.output, results)
    return 0


def pass_costs_command(settings: CliSettings, progress) -> int:
    target, _ = load_pair(settings.pair, ModelCache(), progress, allow_local=True, dtype=settings.dtype)
    costs = bench_pass_costs(target.model)
    started = time.perf_counter()  # what a cost-aware drafter measures at load: engine rounds up to n = 24
    planner = PassCosts.from_seconds(measure_pass_seconds(target.model, PLANNER_SIZES))
    planner_seconds, started = time.perf_counter() - started, time.perf_counter()
    shared = batch_costs(target.model, MAX_BATCH_ROWS)  # rows of widths 1..17, one row and a full batch
    record = {
        "model": target.description,
        "context_tokens": 200,
        "packed_linears": is_packed(target.model),  # models/packed.py: bfloat16, and float32 where it pays here
        "cost_over_one_token": costs,
        "planner_rounds": dict(zip(planner.sizes, planner.steps_at, strict=True)),
        "planner_seconds_to_measure": planner_seconds,
        "shared_rounds": {  # what the app's shared batches cut drafts by, measured as at load
            1: dict(zip(shared.widths, shared.one_row, strict=True)),
            shared.full_rows: dict(zip(shared.widths, shared.full, strict=True)),
        },
        "shared_seconds_to_measure": time.perf_counter() - started,
    }
    if target.model.dtype == torch.float32 and target.device.type == "cpu":  # what float32_packing_pays decides on
        record["float32_product_ms"] = {
            rows: {"stock": 1e3 * stock, "packed": 1e3 * packed}
            for rows, (stock, packed) in float32_product_seconds().items()
        }
    print(json.dumps(record))
    return 0


def _int_list(name: str, text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"{name} must be whole numbers separated by commas, e.g. 1,2,4; got {text!r}.") from None


def batch_bench_command(
    args: argparse.Namespace, settings: CliSettings, prompts: tuple[BenchPrompt, ...], progress
) -> int:
    batch_sizes = _int_list("--batch-sizes", args.batch_sizes)
    candidates = _int_list("--num-candidates", args.candidate_widths)
    for batch_size in batch_sizes:
        check_batch_size(batch_size)
    for w in candidates:
        replace(settings.speculative, num_candidates=w)  # refuses W outside its limits before any model loads
    target, draft = load_pair(settings.pair, ModelCache(), progress, allow_local=True, dtype=settings.dtype)
    results = run_batch_bench(
        target, draft, settings.speculative, prompts, batch_sizes, candidates, args.repeats, progress, settings.pair
    )
    results.update(
        date=time.strftime("%Y-%m-%d"),
        pair=settings.pair.key,
        model=target.description,
        max_new_tokens=settings.speculative.max_new_tokens,
    )
    print(batch_table(results["rows"], results["methods"]))
    write(args.output, results)
    return 0


def write(path: str, results: dict) -> None:
    output = Path(path)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=2))
    print(f"Wrote {output}")
