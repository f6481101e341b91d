"""`python -m specdemo generate`: decode one prompt and show every round, or a prompts file as a batch (one JSON object
per prompt)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from functools import partial

from specdemo.app.views.render import ansi_text, token_spans
from specdemo.bench.prompts import MAX_PROMPTS_FILE_LINES, read_prompts_file
from specdemo.cli.settings import CliSettings, add_pair_flags, add_run_flags, read_settings
from specdemo.config import MAX_BATCH_SIZE, check_batch_size, check_prompt, check_prompt_fits, check_row_seeds
from specdemo.core.rounds import Round
from specdemo.core.stats import round_record, run_stats
from specdemo.drafters.base import NoDrafter
from specdemo.engine.decoding import batch_generate
from specdemo.engine.setup import load_pair, make_drafter
from specdemo.models.loading import LoadedModel, model_dtype_reason, prompt_token_ids
from specdemo.models.shared import ModelCache


def add_parser(commands: argparse._SubParsersAction, progress) -> None:
    generate = commands.add_parser("generate", help="decode one prompt and show every round")
    source = generate.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt")
    source.add_argument(
        "--prompts-file",
        metavar="FILE",
        help=f'JSON lines with "text" (and optionally "name", "grounded"), or plain text, one prompt per line (at '
        f"most {MAX_PROMPTS_FILE_LINES}); decoded as a batch, one JSON object printed per prompt",
    )
    generate.add_argument("--batch-size", type=int, default=8, help=f"rows decoded together, 1..{MAX_BATCH_SIZE}")
    add_pair_flags(generate)
    add_run_flags(generate)
    generate.add_argument("--baseline", action="store_true", help="decode with the target alone")
    generate.add_argument("--no-chat", action="store_true", help="use the prompt as raw text, no chat template")
    generate.add_argument("--json", action="store_true", help="print one JSON object instead of coloured text")
    generate.set_defaults(run=partial(generate_command, progress=progress))


def generate_command(args: argparse.Namespace, progress) -> int:
    settings = read_settings(args)
    if args.prompts_file:
        check_batch_size(args.batch_size)
        prompts_file = read_prompts_file(args.prompts_file)  # checked before any model loads
        rows = f"the {len(prompts_file.prompts)} prompts in '{args.prompts_file}'"
        check_row_seeds(settings.sampling.seed, len(prompts_file.prompts), rows)
        progress(f"Read {len(prompts_file.prompts)} prompts from {args.prompts_file} ({prompts_file.format}).")
        return generate_batch(args, settings, [prompt.text for prompt in prompts_file.prompts], progress)
    check_prompt(args.prompt)
    return generate_batch(args, settings, [args.prompt], progress, one=True)


def generate_batch(
    args: argparse.Namespace, settings: CliSettings, texts: list[str], progress, one: bool = False
) -> int:
    """Decode the prompts in batches of --batch-size (a finished row's place goes to the next prompt), row i with
    seed + i; one prompt is a batch of one. Prints one JSON object per prompt in file order, or (one prompt without
    --json) the run in colour."""
    target, draft = load_pair(settings.pair, ModelCache(), progress, allow_local=True, dtype=settings.dtype)
    prompts = [prompt_token_ids(target, text, chat=not args.no_chat) for text in texts]
    for number, prompt in enumerate(prompts, start=1):  # every prompt fits before anything runs
        try:
            check_prompt_fits(len(prompt), settings.speculative.max_new_tokens, target.context_length)
        except ValueError as error:
            raise ValueError(f"Prompt {number}: {error}" if not one else str(error)) from None
    drafter = NoDrafter() if args.baseline else make_drafter(settings.pair, target, draft, settings.drafter_options)
    samplings = [replace(settings.sampling, seed=settings.sampling.seed + i) for i in range(len(prompts))]
    rounds: list[list[Round]] = [[] for _ in prompts]
    started = time.perf_counter()
    batch_size = 1 if one else args.batch_size
    rows = batch_generate(
        target.model, drafter, prompts, samplings, settings.speculative, target.eos_token_ids, batch_size
    )
    for index, round_ in rows:
        rounds[index].append(round_)
    wall_seconds = time.perf_counter() - started
    draft_name = None if args.baseline else settings.pair.drafter
    reason = model_dtype_reason(args.dtype, target.device, settings.pair.model_names)
    if one and not args.json:
        print_run(target, rounds[0], reason)
        return 0
    for index, (text, prompt, row_rounds) in enumerate(zip(texts, prompts, rounds, strict=True)):
        record = run_record(settings.pair.key, target, draft_name, prompt, row_rounds, reason)
        if one:
            record["stats"]["wall_seconds"] = wall_seconds
        else:
            record = {"index": index, "prompt": text, "batch_size": args.batch_size, **record}
        print(json.dumps(record))
    if not one:
        print(f"{len(prompts)} prompts in {wall_seconds:.1f} s", file=sys.stderr)
    return 0


def print_run(target: LoadedModel, rounds: list[Round], dtype_reason: str) -> None:
    """The run in colour on stdout, its figures on stderr."""
    stats = run_stats(rounds)
    print(ansi_text(token_spans(rounds, partial(target.tokenizer.decode, skip_special_tokens=False))))
    print(
        f"\n{target.name} on {target.device.type}, {dtype_reason}: "
        f"{stats.num_generated} tokens in {stats.num_target_forwards} target passes, "
        f"{stats.tokens_per_second:.1f} tokens/s, α {stats.alpha:.2f} (accepted / tested), acceptance rate "
        f"{stats.acceptance_rate:.2f} (accepted / drafted), {stats.mean_tokens_per_round:.2f} tokens per pass",
        file=sys.stderr,
    )


def run_record(
    pair_key: str,
    target: LoadedModel,
    draft: str | None,
    prompt_ids: list[int],
    rounds: list[Round],
    dtype_reason: str,
) -> dict:
    """One run as the JSON object `generate --json` prints (one per prompt with --prompts-file); `dtype_reason` says
    which format --dtype resolved to, and why."""
    generated = [token for round_ in rounds for token in round_.emitted_token_ids]
    stats = run_stats(rounds)
    return {
        "pair": pair_key,
        "target": target.name,
        "draft": draft,
        "device": str(target.device),
        "dtype": str(target.model.dtype).removeprefix("torch."),
        "dtype_reason": dtype_reason,
        "prompt_token_ids": prompt_ids,
        "generated_token_ids": generated,
        "text": target.tokenizer.decode(generated, skip_special_tokens=True),
        "rounds": [round_record(round_) for round_ in rounds],
        "stats": {**stats.as_dict(), "engine_seconds": stats.wall_seconds},
    }
