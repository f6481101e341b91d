"""Command line: `python -m specdemo generate|bench ...`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

from specdemo.app.render import ansi_text, token_spans
from specdemo.bench.batch import batch_table, run_batch_bench
from specdemo.bench.prompts import MAX_PROMPTS_FILE_LINES, PROMPTS, load_prompt_lines, load_prompts
from specdemo.bench.single import bench_app, bench_pass_costs, markdown_table, run_bench
from specdemo.config import (
    DEFAULT_SUFFIX_CACHE_TOKENS,
    MAX_BATCH_SIZE,
    MAX_NUM_CANDIDATES,
    MAX_SUFFIX_CACHE_TOKENS,
    SamplingConfig,
    SpeculativeConfig,
    check_batch_size,
    check_prompt,
    check_prompt_fits,
)
from specdemo.core.planning import PassCosts
from specdemo.core.rounds import Round
from specdemo.core.stats import round_record, run_stats
from specdemo.drafters.base import NoDrafter
from specdemo.drafters.registry import drafter_names
from specdemo.engine.costs import MEASURED_SIZES, batch_costs, measure_pass_seconds
from specdemo.engine.decoding import autoregressive_generate, batch_generate, speculative_generate
from specdemo.engine.scheduler import MAX_BATCH_ROWS
from specdemo.models.loading import (
    DTYPE_CHOICES,
    OFFLINE_DEFAULT,
    LoadedModel,
    chat_prompt_ids,
    dtype_reason,
    pick_device,
    resolve_dtype,
)
from specdemo.models.shared import ModelCache
from specdemo.pairs import (
    DEFAULT_PAIR,
    NGRAM,
    PAIRS,
    Pair,
    custom_pair,
    find_pair,
    load_pair,
    make_drafter,
    pairs_table,
)

PLANNER_SIZES = tuple(size for size in MEASURED_SIZES if size <= 24)  # what the suffix pair measures at load
EXIT_BAD_INPUT = 2  # as argparse uses for bad arguments
EXIT_RUN_FAILED = 1  # the settings were fine but the run failed (a model error, out of memory...)


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m specdemo", description="Speculative decoding, made visible.")
    commands = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)  # options of both generate and bench
    common.add_argument("--debug", action="store_true", help="show the Python traceback when a run fails")
    common.add_argument(
        "--suffix-cache-tokens",
        type=int,
        default=DEFAULT_SUFFIX_CACHE_TOKENS,
        help=f"earlier outputs a suffix drafter remembers, 0..{MAX_SUFFIX_CACHE_TOKENS:,} tokens",
    )
    common.add_argument(  # no argparse choices: an unknown format gets resolve_dtype's sentence
        "--dtype",
        default="auto",
        metavar="{" + ",".join(DTYPE_CHOICES) + "}",
        help="weights and activations (probabilities stay float32); auto (the default): bfloat16 on CUDA and on CPUs "
        "with AMX or AVX-512 BF16, float32 elsewhere",
    )

    generate = commands.add_parser("generate", parents=[common], help="decode one prompt and show every round")
    source = generate.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt")
    source.add_argument(
        "--prompts-file",
        metavar="FILE",
        help=f"one prompt per line (at most {MAX_PROMPTS_FILE_LINES}), decoded as a "
        "batch; prints one JSON object per prompt",
    )
    generate.add_argument("--batch-size", type=int, default=8, help=f"rows decoded together, 1..{MAX_BATCH_SIZE}")
    generate.add_argument(
        "--num-candidates", type=int, default=1, help=f"W: candidate drafts per round, 1..{MAX_NUM_CANDIDATES}"
    )
    generate.add_argument("--pair", help="a pair from `python -m specdemo pairs` (instead of --target/--draft)")
    generate.add_argument("--target", default=OFFLINE_DEFAULT, help="model name, Hub id or directory")
    generate.add_argument(
        "--draft", default=NGRAM, help=f"{drafter_names()} (no model), or a draft model name/Hub id/dir"
    )
    generate.add_argument("--draft-temperature", type=float, help="a draft model's own temperature (default: target's)")
    generate.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    generate.add_argument("--top-k", type=int, default=0, help="0 = off")
    generate.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    generate.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off")
    generate.add_argument("--num-draft-tokens", type=int, default=SpeculativeConfig.num_draft_tokens)
    generate.add_argument("--max-new-tokens", type=int, default=SpeculativeConfig.max_new_tokens)
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument("--baseline", action="store_true", help="decode with the target alone")
    generate.add_argument("--no-chat", action="store_true", help="use the prompt as raw text, no chat template")
    generate.add_argument("--json", action="store_true", help="print one JSON object instead of coloured text")

    commands.add_parser("pairs", help="list the draft/target pairs")

    bench = commands.add_parser("bench", parents=[common], help="benchmark against Hugging Face generate, interleaved")
    bench.add_argument("--pair", default=DEFAULT_PAIR.key, help="a pair from `python -m specdemo pairs`")
    bench.add_argument(
        "--prompts", metavar="FILE", help='your own prompts: JSON lines with "name", "grounded" and "text"'
    )
    bench.add_argument("--num-draft-tokens", type=int, default=SpeculativeConfig.num_draft_tokens)
    bench.add_argument("--max-new-tokens", type=int, default=SpeculativeConfig.max_new_tokens)
    bench.add_argument(
        "--min-ngram-size",
        type=int,
        default=SpeculativeConfig.min_ngram_size,
        help="shortest match prompt lookup drafts from (1 shows why the default is 2)",
    )
    bench.add_argument("--draft-temperature", type=float, help="a draft model's own temperature (default: the pair's)")
    bench.add_argument("--repeats", type=int, default=2, help="timed runs of each method per prompt (median)")
    bench.add_argument("--output", default="bench-results/bench.json", help="where the JSON results go")
    bench.add_argument("--markdown", metavar="JSON", help="print the table of an earlier run's JSON and exit")
    bench.add_argument("--app", action="store_true", help="measure the app's streaming overhead instead")
    bench.add_argument(
        "--pass-costs", action="store_true", help="measure t(k)/t(1), a k-token forward pass over a one-token one"
    )
    bench.add_argument("--batch-sizes", metavar="B,B,...", help="batched bench instead, e.g. 1,2,4,8")
    bench.add_argument("--num-candidates", default="1", metavar="W,W,...", help="with --batch-sizes, e.g. 1,2,4")
    return parser


def cli_pair(args: argparse.Namespace) -> Pair:
    if args.pair:
        if args.target != OFFLINE_DEFAULT or args.draft != NGRAM:
            raise ValueError("Give either --pair or --target/--draft, not both.")
        return find_pair(args.pair)
    registered = [pair for pair in PAIRS if (pair.target, pair.drafter) == (args.target, args.draft)]
    if registered:
        return registered[0]
    return custom_pair(args.target, args.draft, allow_local=True)  # the command line may name directories


def cli_dtype(args: argparse.Namespace) -> torch.dtype:
    """--dtype on the device the models load on; a ValueError for an unknown or unsupported format."""
    return resolve_dtype(args.dtype, pick_device())


def generate_command(args: argparse.Namespace) -> int:
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p, args.repetition_penalty, args.seed)
    pair = cli_pair(args)
    speculative = SpeculativeConfig(
        num_draft_tokens=args.num_draft_tokens,
        max_new_tokens=args.max_new_tokens,
        draft_temperature=pair.draft_temperature if args.draft_temperature is None else args.draft_temperature,
        num_candidates=args.num_candidates,
        suffix_cache_tokens=args.suffix_cache_tokens,
    )
    if args.prompts_file:
        check_batch_size(args.batch_size)
        return generate_batch(args, pair, sampling, speculative, load_prompt_lines(args.prompts_file))
    check_prompt(args.prompt)
    target, draft = load_pair(pair, ModelCache(), _progress, allow_local=True, dtype=cli_dtype(args))
    prompt_ids = chat_prompt_ids(target, args.prompt, chat=not args.no_chat)  # [1, T]
    check_prompt_fits(prompt_ids.shape[1], speculative.max_new_tokens, target.context_length)
    started = time.perf_counter()
    if args.baseline:
        rounds = list(
            autoregressive_generate(
                target.model, prompt_ids, sampling, speculative.max_new_tokens, target.eos_token_ids
            )
        )
    else:
        drafter = make_drafter(pair, target, draft, speculative)
        rounds = list(
            speculative_generate(target.model, drafter, prompt_ids, sampling, speculative, target.eos_token_ids)
        )
    wall_seconds = time.perf_counter() - started
    stats = run_stats(rounds)
    if args.json:
        draft_name = None if args.baseline else pair.drafter
        record = run_record(pair, target, draft_name, prompt_ids[0].tolist(), rounds, args.dtype)
        record["stats"]["wall_seconds"] = wall_seconds
        print(json.dumps(record))
        return 0
    decode = partial(target.tokenizer.decode, skip_special_tokens=False)
    print(ansi_text(token_spans(rounds, decode)))
    print(
        f"\n{target.name} on {target.device.type}, {dtype_reason(args.dtype, target.device)}: "
        f"{stats.num_generated} tokens in {stats.num_target_forwards} target passes, "
        f"{stats.tokens_per_second:.1f} tokens/s, α {stats.alpha:.2f} (accepted / tested), acceptance rate "
        f"{stats.acceptance_rate:.2f} (accepted / drafted), {stats.mean_tokens_per_round:.2f} tokens per pass",
        file=sys.stderr,
    )
    return 0


def run_record(
    pair: Pair, target: LoadedModel, draft: str | None, prompt_ids: list[int], rounds: list[Round], dtype: str
) -> dict:
    """One run as the JSON object `generate --json` prints (one per prompt with --prompts-file); `dtype` is --dtype,
    whose resolution the record explains."""
    generated = [token for round_ in rounds for token in round_.emitted_token_ids]
    stats = run_stats(rounds)
    return {
        "pair": pair.key,
        "target": target.name,
        "draft": draft,
        "device": str(target.device),
        "dtype": str(target.model.dtype).removeprefix("torch."),
        "dtype_reason": dtype_reason(dtype, target.device),
        "prompt_token_ids": prompt_ids,
        "generated_token_ids": generated,
        "text": target.tokenizer.decode(generated, skip_special_tokens=True),
        "rounds": [round_record(round_) for round_ in rounds],
        "stats": {**stats.as_dict(), "engine_seconds": stats.wall_seconds},
    }


def generate_batch(
    args: argparse.Namespace, pair: Pair, sampling: SamplingConfig, speculative: SpeculativeConfig, texts: list[str]
) -> int:
    """Decode a file's prompts in batches of --batch-size (a finished row's place goes to the next prompt) and print
    one JSON object per prompt, in file order; row i samples with seed + i."""
    target, draft = load_pair(pair, ModelCache(), _progress, allow_local=True, dtype=cli_dtype(args))
    prompts = [chat_prompt_ids(target, text, chat=not args.no_chat)[0].tolist() for text in texts]
    for prompt in prompts:  # every line fits before anything runs
        check_prompt_fits(len(prompt), speculative.max_new_tokens, target.context_length)
    drafter = NoDrafter() if args.baseline else make_drafter(pair, target, draft, speculative)
    samplings = [replace(sampling, seed=sampling.seed + i) for i in range(len(prompts))]
    rounds: list[list[Round]] = [[] for _ in prompts]
    started = time.perf_counter()
    for index, round_ in batch_generate(
        target.model, drafter, prompts, samplings, speculative, target.eos_token_ids, args.batch_size
    ):
        rounds[index].append(round_)
    wall_seconds = time.perf_counter() - started
    for index, (text, prompt, row_rounds) in enumerate(zip(texts, prompts, rounds, strict=True)):
        print(
            json.dumps(
                {
                    "index": index,
                    "prompt": text,
                    "batch_size": args.batch_size,
                    **run_record(pair, target, None if args.baseline else pair.drafter, prompt, row_rounds, args.dtype),
                }
            )
        )
    print(f"{len(prompts)} prompts in {wall_seconds:.1f} s", file=sys.stderr)
    return 0


def bench_command(args: argparse.Namespace) -> int:
    if args.markdown:
        print(markdown_table(json.loads(Path(args.markdown).read_text())))
        return 0
    if args.app:
        for row in bench_app(max_new_tokens=args.max_new_tokens):
            print(json.dumps(row))
        return 0
    if args.pass_costs:
        target, _ = load_pair(find_pair(args.pair), ModelCache(), _progress, allow_local=True, dtype=cli_dtype(args))
        costs = bench_pass_costs(target.model)
        started = time.perf_counter()  # what a cost-aware drafter measures at load: engine rounds up to n = 24
        planner = PassCosts.from_seconds(measure_pass_seconds(target.model, PLANNER_SIZES))
        planner_seconds, started = time.perf_counter() - started, time.perf_counter()
        shared = batch_costs(target.model, MAX_BATCH_ROWS)  # rows of widths 1..17, one row and a full batch
        print(
            json.dumps(
                {
                    "model": target.description,
                    "context_tokens": 200,
                    "cost_over_one_token": costs,
                    "planner_rounds": dict(zip(planner.sizes, planner.steps_at, strict=True)),
                    "planner_seconds_to_measure": planner_seconds,
                    "shared_rounds": {  # what the app's shared batches cut drafts by, measured as at load
                        1: dict(zip(shared.widths, shared.one_row, strict=True)),
                        shared.full_rows: dict(zip(shared.widths, shared.full, strict=True)),
                    },
                    "shared_seconds_to_measure": time.perf_counter() - started,
                }
            )
        )
        return 0
    if args.repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {args.repeats}.")
    prompts = load_prompts(args.prompts) if args.prompts else PROMPTS  # checked before any model loads
    if args.batch_sizes:
        return batch_bench_command(args, prompts)
    pair = find_pair(args.pair)
    speculative = SpeculativeConfig(
        num_draft_tokens=args.num_draft_tokens,
        max_new_tokens=args.max_new_tokens,
        min_ngram_size=args.min_ngram_size,
        draft_temperature=pair.draft_temperature if args.draft_temperature is None else args.draft_temperature,
        suffix_cache_tokens=args.suffix_cache_tokens,
    )
    target, draft = load_pair(pair, ModelCache(), _progress, allow_local=True, dtype=cli_dtype(args))
    for prompt in prompts:
        prompt_ids = chat_prompt_ids(target, prompt.text)  # [1, T]
        check_prompt_fits(prompt_ids.shape[1], speculative.max_new_tokens, target.context_length)
    log = partial(print, flush=True)
    results = run_bench(target, draft, speculative, args.repeats, prompts, log=log, pair=pair)
    results["dtype_reason"] = dtype_reason(args.dtype, target.device)
    print(markdown_table(results))
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=2))
    print(f"Wrote {output}")
    return 0


def _int_list(name: str, text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"{name} must be whole numbers separated by commas, e.g. 1,2,4; got {text!r}.") from None


def batch_bench_command(args: argparse.Namespace, prompts: tuple) -> int:
    batch_sizes, candidates = (
        _int_list("--batch-sizes", args.batch_sizes),
        _int_list("--num-candidates", args.num_candidates),
    )
    for batch_size in batch_sizes:
        check_batch_size(batch_size)
    pair = find_pair(args.pair)
    speculative = SpeculativeConfig(
        num_draft_tokens=args.num_draft_tokens,
        max_new_tokens=args.max_new_tokens,
        min_ngram_size=args.min_ngram_size,
        draft_temperature=pair.draft_temperature if args.draft_temperature is None else args.draft_temperature,
        suffix_cache_tokens=args.suffix_cache_tokens,
    )
    for w in candidates:
        replace(speculative, num_candidates=w)  # refuses W outside its limits before any model loads
    target, draft = load_pair(pair, ModelCache(), _progress, allow_local=True, dtype=cli_dtype(args))
    results = run_batch_bench(
        target, draft, speculative, prompts, batch_sizes, candidates, args.repeats, _progress, pair
    )
    results.update(
        date=time.strftime("%Y-%m-%d"),
        pair=pair.key,
        model=target.description,
        max_new_tokens=speculative.max_new_tokens,
    )
    print(batch_table(results["rows"], results["methods"]))
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=2))
    print(f"Wrote {output}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "pairs":
        print(pairs_table())
        return 0
    command = generate_command if args.command == "generate" else bench_command
    try:
        return command(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as error:  # a model error, out of memory...: one sentence, the traceback only on request
        if args.debug:
            raise
        detail = str(error).strip().splitlines()[0][:200] if str(error).strip() else "no message"
        print(
            f"error: the run failed ({error.__class__.__name__}: {detail}); run it again with --debug for the "
            "traceback.",
            file=sys.stderr,
        )
        return EXIT_RUN_FAILED
