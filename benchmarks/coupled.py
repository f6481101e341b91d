"""The coupled rule ("same text for any drafter") on the offline model, two questions:

`identity`: is coupled speculative text the coupled target-only text, token for token, over the whole grid: every
offline drafter kind (prompt lookup, suffix, recurrent, hybrid, and the model drafting for itself at draft temperature
1.5), K in {1, 4, 16}, W in {1, 3}, B in {1, 8}, eight rows (T 0.7 and 1.0, top-p 1 and 0.9, two seeds each)? Exits 1
if any row differs.

`long`: the same question over long texts, where bfloat16's rounding has room to show: eight rows of 96 tokens, one
per prompt of a set (T 0.7 to 1.3, top-k 20 and 50, top-p 0.9 and 0.95), seven drafter setups (kind, K, W, B), each
row against the target alone decoding it by itself. Prints each setup's identical rows and, for each row that
differs, the first differing token (with --explain, also the row decoded alone both ways and what the page says of
it). Reports; never fails (bfloat16 may differ, docs/how-it-works.md).

`chances`: the page's theory line against its measurement: the predicted chance that a tested position matches
(one of the candidates alive there is the target's token) and the share that did, for the model drafting for itself
and the recurrent head at W = 1 and 3, T = 1, K = --num-draft-tokens, over all tested positions and at each round's
first.

`cost`: tokens per target pass under each rule, sampled (no greedy), for the suffix, draft-model (the model drafting
for itself at 1.5), recurrent and hybrid pairs at T = 0.7 and 1.0: every prompt of the set with --seeds seeds, each
rule's runs in one batch with no cut (each row's tokens are those it gets alone), the rules interleaved pair by pair.
Prints per pair and T the two rules' tokens per pass, their ratio, and the spread of the ratio over the seeds.

    python -m benchmarks.coupled identity --dtype float32
    python -m benchmarks.coupled long --prompts benchmarks/prompts/same-text-fresh.jsonl --dtype bfloat16
    python -m benchmarks.coupled chances --prompts benchmarks/prompts/chances-fresh.jsonl --dtype float32 --seeds 4 \
        --num-draft-tokens 4
    python -m benchmarks.coupled cost --prompts benchmarks/prompts/coupled-fresh.jsonl --dtype float32
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import replace

import torch

from benchmarks.common import load, parser
from specdemo import LoadedModel
from specdemo.bench.prompts import read_prompts_file
from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.core.stats import emitted_ids
from specdemo.drafters import Drafter, ModelDrafter, NoDrafter
from specdemo.engine.decoding import autoregressive_generate, batch_generate, speculative_generate
from specdemo.engine.drafting import build_drafter
from specdemo.models.loading import chat_prompt_ids

SETTINGS = [(0.7, 1.0), (0.7, 0.9), (1.0, 1.0), (1.0, 0.9)]  # temperature, top-p
IDENTITY_TEXTS = ("The quick brown fox jumps over the lazy dog. The quick brown", "Name three rivers in Europe:")
SELF_DRAFT_TEMPERATURE = 1.5  # the self-drafting pair's


def drafter(kind: str, loaded: LoadedModel) -> Drafter:
    """A fresh drafter of an offline kind, or "self": the target drafting for itself at its pair's temperature."""
    if kind == "self":
        return ModelDrafter(loaded.model, None, loaded.vocab_size)
    return NoDrafter() if kind == "none" else build_drafter(kind, loaded)


def decode(
    loaded: LoadedModel,
    kind: str,
    prompts: Sequence[list[int]],
    rows: Sequence[SamplingConfig],
    spec: SpeculativeConfig,
    batch_size: int,
) -> tuple[list[list[int]], list[int]]:
    """Each row's tokens and its rounds (one target pass each), `batch_size` rows at a time, no cut."""
    if kind == "self":
        spec = replace(spec, draft_temperature=SELF_DRAFT_TEMPERATURE)
    texts: dict[int, list[int]] = {i: [] for i in range(len(rows))}
    rounds = dict.fromkeys(range(len(rows)), 0)
    every = [prompts[i % len(prompts)] for i in range(len(rows))]
    for index, round_ in batch_generate(
        loaded.model, drafter(kind, loaded), every, list(rows), spec, loaded.eos_token_ids, batch_size
    ):
        texts[index].extend(round_.emitted_token_ids)
        rounds[index] += 1
    return [texts[i] for i in range(len(rows))], [rounds[i] for i in range(len(rows))]


def identity(loaded: LoadedModel, max_new_tokens: int) -> dict:
    prompts = [loaded.tokenizer(text)["input_ids"] for text in IDENTITY_TEXTS]
    rows = [
        SamplingConfig(temperature=t, top_p=p, rule="coupled", seed=2 * i + j)
        for i, (t, p) in enumerate(SETTINGS)
        for j in range(2)
    ]
    base = SpeculativeConfig(max_new_tokens=max_new_tokens)
    alone, _ = decode(loaded, "none", prompts, rows, base, 1)
    differing = 0
    for kind in ("ngram", "suffix", "recurrent", "hybrid", "self"):
        for num_draft in (1, 4, 16):
            for width in (1, 3):
                for batch_size in (1, 8):
                    spec = replace(base, num_draft_tokens=num_draft, num_candidates=width)
                    got, _ = decode(loaded, kind, prompts, rows, spec, batch_size)
                    differ = [i for i, (a, b) in enumerate(zip(got, alone, strict=True)) if a != b]
                    differing += len(differ)
                    line = dict(kind=kind, K=num_draft, W=width, B=batch_size, rows=len(rows), differ=differ)
                    print(json.dumps(line), flush=True)
    result = {"rows_compared": 5 * 3 * 2 * 2 * len(rows), "rows_differing": differing, "passes": not differing}
    print(json.dumps(result))
    return result


LONG_ROWS = [  # temperature, top-k, top-p: plain, nucleus, top-k edges, hot rows; row i decodes prompt i
    (0.7, 0, 1.0),
    (0.7, 0, 0.9),
    (1.0, 0, 1.0),
    (1.0, 50, 1.0),
    (1.3, 50, 1.0),
    (1.0, 0, 0.95),
    (1.3, 0, 0.9),
    (1.0, 20, 0.9),
]
LONG_SETUPS = [  # drafter kind, K, W, B
    ("ngram", 4, 1, 1),
    ("suffix", 8, 1, 8),
    ("suffix", 16, 3, 1),
    ("self", 4, 3, 8),
    ("self", 16, 1, 1),
    ("recurrent", 4, 3, 8),
    ("hybrid", 8, 3, 8),
]


def explain(loaded: LoadedModel, kind: str, prompt: list[int], row: SamplingConfig, spec: SpeculativeConfig) -> str:
    """What the page says of one row decoded alone by `kind` and by the target alone: identical, or where and why the
    texts part (app/serving/divergence.py, both runs' passes replayed)."""
    from specdemo.app.serving.divergence import divergence_of  # the app's own explanation (imports Gradio)
    from specdemo.app.views.same_text import greedy_check

    if kind == "self":
        spec = replace(spec, draft_temperature=SELF_DRAFT_TEMPERATURE)
    prompt_ids, eos = torch.tensor([prompt]), loaded.eos_token_ids  # [1, T]
    rounds = list(speculative_generate(loaded.model, drafter(kind, loaded), prompt_ids, row, spec, eos))
    baseline = list(autoregressive_generate(loaded.model, prompt_ids, row, spec.max_new_tokens, eos))
    decode = loaded.tokenizer.decode
    found = divergence_of(loaded.model, prompt, rounds, baseline, row, decode, len(prompt) + spec.max_new_tokens)
    identical = emitted_ids(rounds) == emitted_ids(baseline)
    return greedy_check(identical, found, coupled_seed=row.seed)


def long(loaded: LoadedModel, prompts_file: str, max_new_tokens: int, explain_rows: bool = False) -> dict:
    """Eight rows, one per prompt of the set (chat template), each with its own sampling and seed, decoded by seven
    drafter setups and by the target alone one row at a time: which rows write the target-alone text."""
    prompts = [chat_prompt_ids(loaded, p.text)[0].tolist() for p in read_prompts_file(prompts_file).prompts]
    rows = [
        SamplingConfig(temperature=t, top_k=k, top_p=p, rule="coupled", seed=1001 + i)
        for i, (t, k, p) in enumerate(LONG_ROWS)
    ]
    base = SpeculativeConfig(max_new_tokens=max_new_tokens)
    alone, _ = decode(loaded, "none", prompts, rows, base, 1)
    identical = compared = 0
    for kind, num_draft, width, batch_size in LONG_SETUPS:
        spec = replace(base, num_draft_tokens=num_draft, num_candidates=width)
        got, _ = decode(loaded, kind, prompts, rows, spec, batch_size)
        differ = {}
        for i, (a, b) in enumerate(zip(got, alone, strict=True)):
            if a != b:
                first = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
                differ[i] = dict(token=first + 1, speculative=a[first : first + 1], alone=b[first : first + 1])
        identical += len(rows) - len(differ)
        compared += len(rows)
        if explain_rows:  # each differing row again, alone, and what the page says of it
            for i in differ:
                differ[i]["page"] = explain(loaded, kind, prompts[i], rows[i], spec)
        line = dict(kind=kind, K=num_draft, W=width, B=batch_size, rows=len(rows), identical=len(rows) - len(differ))
        print(json.dumps(line | dict(differ=differ)), flush=True)
    tokens = sum(map(len, alone))
    result = {"rows_compared": compared, "rows_identical": identical, "tokens_alone": tokens, "passes": True}
    print(json.dumps(result))
    return result


def chances(loaded: LoadedModel, prompts_file: str, seeds: int, max_new_tokens: int, num_draft: int) -> dict:
    """The page's theory line beside its measurement: for the model drafting for itself and the recurrent head at
    W = 1 and 3, T = 1, the mean predicted chance that a tested position matches (bounds) and the share that matched,
    over all tested positions and at each round's first, with the standard error the prediction implies."""
    from specdemo.app.views.summary import coupled_chances  # the page's own means

    prompts = [chat_prompt_ids(loaded, p.text)[0].tolist() for p in read_prompts_file(prompts_file).prompts]
    rows = [SamplingConfig(temperature=1.0, rule="coupled", seed=s) for s in range(seeds) for _ in prompts]
    lines = []
    for kind in ("self", "recurrent"):
        for width in (1, 3):
            spec = SpeculativeConfig(num_draft_tokens=num_draft, num_candidates=width, max_new_tokens=max_new_tokens)
            spec = replace(spec, draft_temperature=SELF_DRAFT_TEMPERATURE) if kind == "self" else spec
            every = [prompts[i % len(prompts)] for i in range(len(rows))]
            decoded = batch_generate(loaded.model, drafter(kind, loaded), every, rows, spec, loaded.eos_token_ids, 8)
            rounds = [r for _, r in decoded]
            firsts = [r.coupled[0] for r in rounds if r.coupled and r.coupled[0].draft_id is not None]
            line = dict(kind=kind, W=width, K=num_draft, rows=len(rows))
            for name, tested in (
                ("all", [c for r in rounds for c in r.coupled if c.draft_id is not None]),
                ("first", firsts),
            ):
                low, high = (
                    statistics.mean(getattr(c, f) for c in tested) for f in ("coupled_chance", "coupled_chance_high")
                )
                matched = statistics.mean(c.draft_id == c.target_id for c in tested)
                error = sum(c.coupled_chance * (1 - c.coupled_chance) for c in tested) ** 0.5 / len(tested)
                line[name] = dict(
                    tested=len(tested),
                    predicted=[round(low, 3), round(high, 3)],
                    measured=round(matched, 3),
                    standard_error=round(error, 3),
                )
            line["page"] = coupled_chances(rounds) is not None
            print(json.dumps(line), flush=True)
            lines.append(line)
    return {"pairs": lines, "passes": True}


def cost(loaded: LoadedModel, prompts_file: str, seeds: int, max_new_tokens: int, num_draft: int) -> dict:
    prompts = [chat_prompt_ids(loaded, p.text)[0].tolist() for p in read_prompts_file(prompts_file).prompts]
    every = [p for p in prompts for _ in range(seeds)]
    spec = SpeculativeConfig(num_draft_tokens=num_draft, max_new_tokens=max_new_tokens)
    lines = []
    for kind in ("suffix", "self", "recurrent", "hybrid"):
        for temperature in (0.7, 1.0):
            per_pass: dict[str, list[float]] = {}
            for rule in ("standard", "coupled"):
                rows = [SamplingConfig(temperature=temperature, rule=rule, seed=i % seeds) for i in range(len(every))]
                texts, rounds = decode(loaded, kind, every, rows, spec, len(every))
                per_pass[rule] = [len(t) / r for t, r in zip(texts, rounds, strict=True)]
            standard, coupled = (statistics.mean(per_pass[r]) for r in ("standard", "coupled"))
            by_seed = [  # the ratio of the means over each seed's rows
                statistics.mean(per_pass["coupled"][s::seeds]) / statistics.mean(per_pass["standard"][s::seeds])
                for s in range(seeds)
            ]
            line = dict(
                pair=kind,
                temperature=temperature,
                rows=len(every),
                standard_tokens_per_pass=round(standard, 3),
                coupled_tokens_per_pass=round(coupled, 3),
                coupled_over_standard=round(coupled / standard, 3),
                ratio_by_seed=[round(r, 3) for r in by_seed],
            )
            print(json.dumps(line), flush=True)
            lines.append(line)
    return {"pairs": lines, "passes": True}


def main(argv: list[str] | None = None) -> dict:
    flags = parser(__doc__.split("\n\n")[0])
    flags.add_argument("question", choices=["identity", "long", "chances", "cost"])
    flags.add_argument("--prompts", default="benchmarks/prompts/coupled-fresh.jsonl")
    flags.add_argument("--seeds", type=int, default=3)
    flags.add_argument("--max-new-tokens", type=int, default=None, help="default: 16 (identity), 64 (cost)")
    flags.add_argument("--num-draft-tokens", type=int, default=8)
    flags.add_argument("--explain", action="store_true", help="long: each differing row alone, and the page's words")
    args = flags.parse_args(argv)
    loaded = load(args)
    if args.max_new_tokens is None:
        args.max_new_tokens = {"identity": 16, "long": 96}.get(args.question, 64)
    if args.question == "identity":
        return identity(loaded, args.max_new_tokens)
    if args.question == "long":
        return long(loaded, args.prompts, args.max_new_tokens, args.explain)
    if args.question == "chances":
        return chances(loaded, args.prompts, args.seeds, args.max_new_tokens, args.num_draft_tokens)
    return cost(loaded, args.prompts, args.seeds, args.max_new_tokens, args.num_draft_tokens)


if __name__ == "__main__":
    sys.exit(0 if main()["passes"] else 1)
