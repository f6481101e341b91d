"""`python -m specdemo race`: one prompt decoded by the target alone and several drafters at once, as rows of one batch,
with a table of each lane's tokens, target passes, estimated time alone and speedup, and whether their texts agree."""

from __future__ import annotations

import argparse
import copy
import json
import time
from functools import partial

from specdemo.cli.settings import add_pair_flags, add_run_flags, flag, read_settings
from specdemo.config import check_prompt, check_prompt_fits
from specdemo.core.race import LaneFigures, agreement, lane_record, speedup
from specdemo.drafters.registry import drafter_options, option_kinds
from specdemo.engine.race import MAX_LANES, check_lanes, race, race_costs
from specdemo.engine.setup import load_pair
from specdemo.models.loading import model_dtype_reason, prompt_token_ids
from specdemo.models.shared import ModelCache

DEFAULT_LANES = "ngram,suffix,recurrent,hybrid"
HOW_ESTIMATED = (
    "Each lane's time is estimated as it would run alone: its target passes, each priced at this device's measured "
    "cost for the tokens it read, plus its own drafting time. The lanes shared the passes, so the wall clock is the "
    "batch's."
)


def add_parser(commands: argparse._SubParsersAction, progress) -> None:
    race_parser = commands.add_parser("race", help="race drafters on one prompt, as rows of one batch")
    race_parser.add_argument("--prompt", required=True)
    race_parser.add_argument(
        "--lanes",
        default=DEFAULT_LANES,
        help=f"drafters to race against the target alone, comma-separated (at most {MAX_LANES - 1}): ngram, suffix, "
        f"recurrent, hybrid, or draft (the pair's draft model); default {DEFAULT_LANES}",
    )
    add_pair_flags(race_parser)
    add_run_flags(race_parser, num_candidates=True)
    race_parser.add_argument("--no-chat", action="store_true", help="use the prompt as raw text, no chat template")
    race_parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    race_parser.set_defaults(run=partial(race_command, progress=progress))


def race_command(args: argparse.Namespace, progress) -> int:
    check_prompt(args.prompt)
    kinds = option_kinds()
    given = {name: getattr(args, name) for name in kinds if getattr(args, name) is not None}
    common = copy.copy(args)
    for name in given:  # a kind's options go to that kind's lane, whatever the pair's drafter
        setattr(common, name, None)
    settings = read_settings(common)
    lanes = check_lanes(args.lanes, settings.pair)  # before any model loads
    for name in given:
        if kinds[name].name not in lanes:
            raise ValueError(
                f"{flag(name)} is an option of the {kinds[name].name} lane, which is not racing: leave it out, or "
                f"add {kinds[name].name} to --lanes."
            )
    options = {lane: drafter_options(lane, given) for lane in lanes}
    target, draft = load_pair(settings.pair, ModelCache(), progress, allow_local=True, dtype=settings.dtype)
    prompt_ids = prompt_token_ids(target, args.prompt, chat=not args.no_chat)
    check_prompt_fits(len(prompt_ids), settings.speculative.max_new_tokens, target.context_length)
    costs = race_costs(target, prompt_ids, settings.speculative, settings.sampling)
    started = time.perf_counter()
    for runs in race(target, draft, lanes, prompt_ids, settings.sampling, settings.speculative, options):
        progress(f"pass {max(len(run.rounds) for run in runs)}: " + ", ".join(
            f"{run.name} {sum(len(r.emitted_token_ids) for r in run.rounds)}" for run in runs
        ))  # fmt: skip
    wall_seconds = time.perf_counter() - started
    figures = [run.figures(costs) for run in runs]
    same_text_expected = settings.sampling.is_greedy or settings.sampling.is_coupled
    sentence = agreement(figures, same_text_expected)
    reason = model_dtype_reason(args.dtype, target.device, settings.pair.model_names)
    if args.json:
        decode = partial(target.tokenizer.decode, skip_special_tokens=True)
        lanes_json = [lane_record(lane, figures[0], decode(lane.token_ids)) for lane in figures]
        print(json.dumps({"pair": settings.pair.key, "dtype_reason": reason, "lanes": lanes_json,
                          "agreement": sentence, "wall_seconds": wall_seconds}))  # fmt: skip
        return 0
    print(race_table(figures))
    print(f"\n{sentence}\n{HOW_ESTIMATED}")
    print(f"{target.name} on {target.device.type}, {reason}; the race took {wall_seconds:.1f} s in all.")
    text = target.tokenizer.decode(figures[0].token_ids, skip_special_tokens=True)
    print(f"\nThe target lane's text:\n{text}")
    return 0


def race_table(lanes: list[LaneFigures]) -> str:
    """A fixed-width table, one line per lane, the target lane first."""
    header = ("lane", "tokens", "passes", "tok/pass", "est. s", "drafting s", "speedup")
    lines = ["{:<10} {:>6} {:>6} {:>8} {:>7} {:>10} {:>7}".format(*header)]
    for lane in lanes:
        ratio = speedup(lane, lanes[0])
        shown = "-" if ratio is None else f"{ratio:.2f}x"
        lines.append(
            f"{lane.name:<10} {len(lane.token_ids):>6} {lane.passes:>6} {lane.tokens_per_pass:>8.2f} "
            f"{lane.estimated_seconds:>7.2f} {lane.drafting_seconds:>10.3f} {shown:>7}"
        )
        if lane.error:
            lines.append(f"  {lane.name} stopped: {lane.error}")
    return "\n".join(lines)
