"""How far drafting from the context can go: the greedy text HF's prompt lookup writes for each prompt, replayed under
several drafters. Greedy, a draft is accepted up to its first token off the text, so the passes each drafter needs
follow from the text alone; each pass is costed with forward times measured in the same run, plus each loop's time
outside the model. Then the suffix drafter's settings, changed one at a time, over every text.

    PYTHONPATH=. .venv/bin/python benchmarks/headroom.py                  # bfloat16, every prompt set here
    PYTHONPATH=. .venv/bin/python benchmarks/headroom.py --dtype float32"""

from __future__ import annotations

import glob
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import DynamicCache

import specdemo.drafters.suffix as suffix_module
from specdemo import SamplingConfig
from specdemo.bench.prompts import PROMPTS, load_prompts
from specdemo.core.planning import PassCosts
from specdemo.drafters import DraftRequest, SuffixDrafter
from specdemo.models.loading import chat_prompt_ids

sys.path.insert(0, str(Path(__file__).parent))
from common import load, parser

OUTSIDE_MS = {"ours": 2.5, "HF": 1.5}  # each loop's time outside the model per pass (benchmarks/overhead.py)
SETTINGS = {  # the suffix drafter's constants, changed one at a time
    "as shipped": {},
    "its priors unscaled by the row's history": {"ROW_PRIOR_WEIGHT": 1e12},
    "lower priors, unscaled": {"PRIOR_RATIOS": (0.2, 0.5, 0.7, 0.85, 0.9), "ROW_PRIOR_WEIGHT": 1e12},
    "prior weight 8": {"PRIOR_WEIGHT": 8.0},
    "longest match 4": {"MAX_MATCH": 4},
    "longest match 12": {"MAX_MATCH": 12},
    "candidates stop at reach 0.06": {"MIN_REACH": 0.06},
}
Draft = Callable[[list[int], list[int]], list[int]]  # (sequence, the text still to come) -> drafted tokens


def main(argv: list[str] | None = None) -> dict[str, tuple[int, float]]:
    flags = parser(__doc__)
    flags.add_argument(
        "--prompts", nargs="*", help="prompt files (default: benchmarks/prompts/*.jsonl and the bench's)"
    )
    flags.add_argument("--max-new-tokens", type=int, default=128)
    flags.add_argument("--num-draft-tokens", type=int, default=16)
    args = flags.parse_args(argv)
    target = load(args)
    files = (
        args.prompts if args.prompts is not None else sorted(glob.glob(str(Path(__file__).parent / "prompts/*.jsonl")))
    )
    prompts = {p.text: p for path in files for p in load_prompts(path)} | {p.text: p for p in PROMPTS}
    costs = PassCosts.from_seconds({n: forward_seconds(target.model, n) for n in (1, 2, 4, 8, 12, 17, 24, 32, 64)})
    texts = [(p.grounded, *hf_text(target, p.text, args)) for p in prompts.values()]
    grounded = [(prompt, output) for is_grounded, prompt, output in texts if is_grounded]
    results = compare_drafters(grounded, costs, args.num_draft_tokens)
    for name, (passes, ratio) in results.items():
        print(f"{name}: {passes} passes, {ratio:.3f}x HF prompt lookup's time (median)")
    print(f"{len(grounded)} grounded prompts, {sum(len(o) for _, o in grounded)} tokens, {args.dtype}")
    hf_seconds = {
        tuple(p): replay(prompt_lookup(args.num_draft_tokens), p, o, costs, OUTSIDE_MS["HF"])[1] for p, o in grounded
    }
    for setting, change in SETTINGS.items():
        print(f"{setting}: {replay_setting(change, texts, hf_seconds, costs, args.num_draft_tokens)}")
    return results


def forward_seconds(model, n: int, context: int = 128, repeats: int = 7) -> float:
    """A plain forward over n tokens after `context` cached ones, the median of `repeats`."""
    ids, times = torch.randint(model.config.vocab_size, (1, context + n)), []
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :context], past_key_values=cache)
        for _ in range(repeats):
            started = time.perf_counter()
            model(input_ids=ids[:, context:], past_key_values=cache, logits_to_keep=n)
            times.append(time.perf_counter() - started)
            cache.crop(-n)
    return statistics.median(times)


def hf_text(target, text: str, args) -> tuple[list[int], list[int]]:
    """The prompt's ids and the greedy text HF's prompt lookup writes for it."""
    ids = chat_prompt_ids(target, text)  # [1, T]
    with torch.inference_mode():
        out = target.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=args.max_new_tokens,
            prompt_lookup_num_tokens=args.num_draft_tokens,
            pad_token_id=0,
        )
    return ids[0].tolist(), out[0, ids.shape[1] :].tolist()


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def prompt_lookup(k: int) -> Draft:
    """HF's rule: the first earlier match of the last 2 tokens, else of the last 1."""

    def draft(sequence: list[int], future: list[int]) -> list[int]:
        for n in (2, 1):
            starts = [i for i in range(len(sequence) - n) if sequence[i : i + n] == sequence[-n:]]
            if starts:
                return sequence[starts[0] + n : starts[0] + n + k]
        return []

    return draft


def copy_by(order: str, k: int) -> Draft:
    """The longest earlier match (up to 8 tokens), its continuation picked by `order`."""
    state: dict = {"cursor": 0, "last": None}

    def draft(sequence: list[int], future: list[int]) -> list[int]:
        if state["last"]:  # where the last draft's copy ended: its start plus the tokens accepted
            start, length, tokens = state["last"]
            accepted = common_prefix(tokens, sequence[length:])
            state["cursor"] = start + accepted if accepted else state["cursor"]
        for n in range(min(8, len(sequence) - 1), 0, -1):
            starts = [i + n for i in range(len(sequence) - n) if sequence[i : i + n] == sequence[-n:]]
            if starts:
                after = [s for s in starts if s >= state["cursor"]]
                start = {"first": starts[0], "latest": starts[-1], "after the last copy": (after or starts)[0]}[order]
                state["last"] = (start, len(sequence), sequence[start : start + k])
                return state["last"][2]
        state["last"] = None
        return []

    return draft


def suffix(costs: PassCosts, k: int, plans: list | None = None) -> Draft:
    """Our suffix drafter (a fresh one: no earlier outputs); its plans are appended to `plans`."""
    drafter, generator = SuffixDrafter(costs, 0), torch.Generator()

    def draft(sequence: list[int], future: list[int]) -> list[int]:
        proposed = drafter.propose([DraftRequest(0, sequence, k, 1, SamplingConfig(), generator)])[0]
        if plans is not None:
            plans.append(proposed.plan)
        return (proposed.token_ids or [[]])[0]

    return draft


def best_copy(k: int) -> Draft:
    """The longest start of what the model wrote next that occurs earlier: no drafter that copies does better."""

    def draft(sequence: list[int], future: list[int]) -> list[int]:
        for n in range(min(k, len(future)), 0, -1):
            if any(sequence[i : i + n] == future[:n] for i in range(len(sequence) - n + 1)):
                return future[:n]
        return []

    return draft


def replay(draft: Draft, prompt: list[int], output: list[int], costs: PassCosts, outside_ms: float):
    """(passes, seconds, tokens per step as the plans count them) of decoding `output` greedily with `draft`."""
    position, passes, seconds, steps = 0, 0, 0.0, 0.0
    while position < len(output):
        tokens = draft(prompt + output[:position], output[position:])
        accepted = common_prefix(tokens, output[position:])
        read = len(prompt) if position == 0 else 1  # the first pass reads the prompt
        seconds += costs.steps(read + len(tokens)) * costs.step_seconds + outside_ms / 1e3
        steps += costs.steps(1 + len(tokens))  # what a plan costs a round: the prompt is no plan's choice
        position, passes = position + accepted + 1, passes + 1
    return passes, seconds, position / steps


def compare_drafters(rows: list, costs: PassCosts, k: int) -> dict[str, tuple[int, float]]:
    """Each drafter's passes over the grounded texts, and its time over HF prompt lookup's (median over prompts)."""
    drafters = {
        "HF prompt lookup": (lambda: prompt_lookup(k), "HF"),
        "our suffix drafter": (lambda: suffix(costs, k), "ours"),
        "the same, at HF's time outside the model": (lambda: suffix(costs, k), "HF"),
        **{
            f"copy the {o} match": (lambda o=o: copy_by(o, k), "ours")
            for o in ("first", "latest", "after the last copy")
        },
        "copy the best match (knows the text)": (lambda: best_copy(k), "ours"),
    }
    runs = {
        name: [replay(make(), *row, costs, OUTSIDE_MS[loop]) for row in rows] for name, (make, loop) in drafters.items()
    }
    hf = runs["HF prompt lookup"]
    return {
        name: (sum(r[0] for r in result), statistics.median(h[1] / r[1] for r, h in zip(result, hf, strict=True)))
        for name, result in runs.items()
    }


def replay_setting(change: dict, texts: list, hf_seconds: dict, costs: PassCosts, k: int) -> str:
    """The plans' median error (grounded, open-ended) and the speed over HF prompt lookup with `change` made."""
    shipped = {name: getattr(suffix_module, name) for name in change}
    for name, value in change.items():
        setattr(suffix_module, name, value)
    errors, ratios = {True: [], False: [], None: []}, []
    try:
        for grounded, prompt, output in texts:
            plans: list = []
            _, seconds, per_step = replay(suffix(costs, k, plans), prompt, output, costs, OUTSIDE_MS["ours"])
            planned = [p for p in plans if p is not None]
            if planned:
                errors[grounded].append(
                    sum(p.expected_tokens for p in planned) / sum(p.expected_steps for p in planned) / per_step - 1
                )
            if grounded:
                ratios.append(hf_seconds[tuple(prompt)] / seconds)
    finally:
        for name, value in shipped.items():
            setattr(suffix_module, name, value)
    median = lambda values: f"{statistics.median(values):+.1%}" if values else "–"  # noqa: E731
    speed = f"{statistics.median(ratios):.3f}x" if ratios else "–"
    return f"the plans' median error {median(errors[True])} grounded, {median(errors[False])} open-ended; {speed} HF"


if __name__ == "__main__":
    main()
