"""Benchmark: our target-only and speculative loops against Hugging Face generate, interleaved in one process,
with the speedup explained per prompt (tokens per pass over round cost) and Leviathan's prediction beside it."""

# B = batch, K = num_draft_tokens, V = vocab_size

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict

import torch
from transformers import PreTrainedModel

from specdemo.bench.prompts import PROMPTS, BenchPrompt
from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.core.rounds import Round
from specdemo.core.stats import compare_runs, emitted_ids, run_stats
from specdemo.drafters.registry import DRAFTER_KINDS, is_model_free
from specdemo.engine.costs import measure_pass_seconds, measured
from specdemo.engine.decoding import autoregressive_generate, speculative_generate
from specdemo.engine.drafting import build_drafter
from specdemo.models.loading import LoadedModel, chat_prompt_ids
from specdemo.pairs import DEFAULT_PAIR, Pair

ACCOUNTING_TOLERANCE = 0.05  # tokens per pass / round cost must reproduce the wall-clock speedup this closely
TARGET_ONLY, SPECULATIVE, HF_GENERATE = "target-only (ours)", "speculative (ours)", "HF generate"
Method = Callable[[torch.Tensor], tuple[list[int], list[Round]]]  # prompt_ids [1, T] -> tokens, our rounds


def bench_methods(
    drafter_name: str,
    target: LoadedModel,
    draft: LoadedModel | None,
    speculative: SpeculativeConfig,
    options: object | None = None,  # the drafter kind's options; None: its defaults
) -> dict[str, Method]:
    """The four ways of decoding greedily that the table compares; all must produce the same tokens. The peer is
    Hugging Face's own speculative decoding with the same drafter: prompt lookup, or the draft model."""
    model, eos = target.model, target.eos_token_ids
    greedy = SamplingConfig()

    def ours_target_only(prompt_ids: torch.Tensor) -> tuple[list[int], list[Round]]:
        rounds = list(autoregressive_generate(model, prompt_ids, greedy, speculative.max_new_tokens, eos))
        return emitted_ids(rounds), rounds

    def ours_speculative(prompt_ids: torch.Tensor) -> tuple[list[int], list[Round]]:
        drafter = build_drafter(drafter_name, target, draft, options)  # fresh: no memory of earlier runs
        rounds = list(speculative_generate(model, drafter, prompt_ids, greedy, speculative, eos))
        return emitted_ids(rounds), rounds

    def hf_generate(prompt_ids: torch.Tensor, **extra: object) -> tuple[list[int], list[Round]]:
        with torch.inference_mode():
            output = model.generate(
                prompt_ids,
                attention_mask=torch.ones_like(prompt_ids),
                do_sample=False,
                max_new_tokens=speculative.max_new_tokens,
                pad_token_id=min(eos),
                **extra,
            )
        return output[0, prompt_ids.shape[1] :].tolist(), []

    if is_model_free(drafter_name):
        peer_name, peer = "HF prompt lookup", {"prompt_lookup_num_tokens": speculative.num_draft_tokens}
    else:
        peer_name = "HF assisted"
        peer = {
            "assistant_model": draft.model,
            "num_assistant_tokens": speculative.num_draft_tokens,
            "num_assistant_tokens_schedule": "constant",
        }
    return {
        TARGET_ONLY: ours_target_only,
        SPECULATIVE: ours_speculative,
        HF_GENERATE: hf_generate,
        peer_name: lambda prompt_ids: hf_generate(prompt_ids, **peer),
    }


def _timed(method: Method, prompt_ids: torch.Tensor) -> tuple[list[int], list[Round], float]:
    started = time.perf_counter()
    tokens, rounds = method(prompt_ids)
    return tokens, rounds, time.perf_counter() - started


def run_bench(
    target: LoadedModel,
    draft: LoadedModel | None = None,
    speculative: SpeculativeConfig = SpeculativeConfig(),  # noqa: B008 (frozen, so a shared default is safe)
    repeats: int = 2,
    prompts: tuple[BenchPrompt, ...] = PROMPTS,
    log: Callable[[str], None] = lambda line: None,
    pair: Pair = DEFAULT_PAIR,
    options: object | None = None,  # the pair's drafter kind's options; None: its defaults
) -> dict:
    """Every method on every prompt, the order rotated each time so no method always runs first or warm."""
    methods = bench_methods(pair.drafter, target, draft, speculative, options)
    names = list(methods)
    warm_ids = chat_prompt_ids(target, "Hello!")
    for method in methods.values():
        method(warm_ids)  # first calls pay one-time initialisation
    log(table_header(names))
    rows = []
    for prompt_index, prompt in enumerate(prompts):
        prompt_ids = chat_prompt_ids(target, prompt.text)
        seconds: dict[str, list[float]] = {name: [] for name in names}
        outputs: dict[str, list[int]] = {}
        runs: dict[str, list[list[Round]]] = {TARGET_ONLY: [], SPECULATIVE: []}
        for repeat in range(repeats):
            shift = (prompt_index + repeat) % len(names)
            for name in names[shift:] + names[:shift]:
                outputs[name], rounds, elapsed = _timed(methods[name], prompt_ids)
                seconds[name].append(elapsed)
                if name in runs:
                    runs[name].append(rounds)
        row = bench_row(prompt, prompt_ids.shape[1], names, seconds, outputs, runs, speculative.num_draft_tokens)
        rows.append(row)
        log(format_row(row, names))
    return {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, {platform.processor() or 'cpu'}",
        "device": str(target.device),
        "dtype": str(target.model.dtype).removeprefix("torch."),
        "pair": pair.key,
        "model": target.name,
        "draft": draft.name if draft is not None else DRAFTER_KINDS[pair.drafter].label,
        "draft_temperature": speculative.draft_temperature,
        "torch": torch.__version__,
        "num_draft_tokens": speculative.num_draft_tokens,
        "max_new_tokens": speculative.max_new_tokens,
        "drafter_options": None if options is None else asdict(options),
        "repeats": repeats,
        # t(n)/t(1) as a cost-aware drafter measured it at load, to set beside the rows' verify_cost_by_k
        "planner_costs": None
        if (costs := measured(target.model)) is None
        else dict(zip(costs.sizes, costs.steps_at, strict=True)),
        "methods": names,
        "rows": rows,
        "summary": summarise(rows, names),
    }


def bench_row(
    prompt: BenchPrompt,
    num_prompt_tokens: int,
    names: list[str],
    seconds: dict[str, list[float]],
    outputs: dict[str, list[int]],
    runs: dict[str, list[list[Round]]],
    num_draft_tokens: int,
) -> dict:
    """One prompt's figures: speeds, the measured speedup, the accounting of the same runs and the prediction."""
    num_tokens = len(outputs[names[0]])
    comparisons = [
        compare_runs(spec, base, num_draft_tokens)
        for spec, base in zip(runs[SPECULATIVE], runs[TARGET_ONLY], strict=True)
    ]
    # Each method's own tokens: in bfloat16 (or at a near-tie) the outputs may differ, and then so do their lengths.
    speeds = {name: len(outputs[name]) / statistics.median(seconds[name]) for name in names}
    measured = speeds[SPECULATIVE] / speeds[TARGET_ONLY]
    accounted = statistics.median(c.tokens_per_pass / c.round_cost for c in comparisons)
    predicted = statistics.median(c.predicted_speedup for c in comparisons)
    stats = run_stats(runs[SPECULATIVE][0])  # greedy: every repeat decides the same rounds
    planned = stats.planned_speedup  # a cost-aware drafter's own expectation, from its plans
    return {
        "prompt": prompt.name,
        "grounded": prompt.grounded,
        "prompt_tokens": num_prompt_tokens,
        "new_tokens": num_tokens,
        "identical": all(output == outputs[names[0]] for output in outputs.values()),
        "differs": [name for name in names if outputs[name] != outputs[names[0]]],  # from our target-only text
        "same_text_as_peer": outputs[SPECULATIVE] == outputs[names[-1]],  # ours and the peer's speculative texts
        "new_tokens_by_method": {name: len(outputs[name]) for name in names},
        "tokens_per_second": speeds,
        "alpha": stats.alpha,
        "acceptance_rate": stats.acceptance_rate,
        "alpha_by_position": stats.alpha_by_position,
        "no_proposal_share": stats.no_proposal_share,
        "mean_tokens_per_round": stats.mean_tokens_per_round,
        "overhead_fraction": stats.overhead_fraction,
        "verify_cost_by_k": dict(comparisons[0].verify_cost_by_k),
        "best_num_draft_tokens": comparisons[0].best_num_draft_tokens,
        "measured_speedup": measured,
        "accounted_speedup": accounted,  # tokens per pass / round cost, from the same runs' rounds
        "accounting_error": accounted / measured - 1,
        "predicted_speedup": predicted,  # Leviathan's independence model with the measured α, k and costs
        "prediction_error": predicted / measured - 1,
        "planned_speedup": planned,
        "plan_error": None if planned is None else planned / measured - 1,
        "drafting_share": stats.draft_seconds / stats.wall_seconds,  # drafting's share of round time
    }


def summarise(rows: list[dict], names: list[str]) -> dict:
    """Median ratios over the grounded and the open-ended prompts."""
    target, spec, hf, peer = names

    def median_ratio(group: list[dict], top: str, bottom: str) -> float:
        return statistics.median(row["tokens_per_second"][top] / row["tokens_per_second"][bottom] for row in group)

    summary: dict = {}
    for label, group in (
        ("grounded", [r for r in rows if r["grounded"] is True]),
        ("open", [r for r in rows if r["grounded"] is False]),
        ("unlabelled", [r for r in rows if r["grounded"] is None]),  # a prompts file that does not say
    ):
        if not group:
            continue
        summary[label] = {
            f"{spec} / {target}": median_ratio(group, spec, target),
            f"{target} / {hf}": median_ratio(group, target, hf),
            f"{spec} / {peer}": median_ratio(group, spec, peer),
            f"{peer} / {hf}": median_ratio(group, peer, hf),
            "median α (accepted / tested)": statistics.median(row["alpha"] for row in group),
            "median acceptance rate (accepted / drafted)": statistics.median(row["acceptance_rate"] for row in group),
            "median prediction error": statistics.median(row["prediction_error"] for row in group),
            "largest accounting error": max((row["accounting_error"] for row in group), key=abs),
            "median overhead fraction": statistics.median(row["overhead_fraction"] for row in group),
            "largest drafting share of round time": max(row.get("drafting_share", 0.0) for row in group),
            # In bfloat16 the methods' texts can part at near-ties, and a different text copies better or worse.
            f"prompts where {spec} and {peer} wrote the same text": len(same := _same_text(group)),
            f"{spec} / {peer} on those prompts": median_ratio(same, spec, peer) if same else None,
        }
        if all(row.get("plan_error") is not None for row in group):
            summary[label]["median error of the drafter's own plans"] = statistics.median(
                row["plan_error"] for row in group
            )
    summary["all outputs identical"] = all(row["identical"] for row in rows)
    summary["accounting within 5% on every prompt"] = all(
        abs(row["accounting_error"]) <= ACCOUNTING_TOLERANCE for row in rows
    )
    return summary


def _same_text(rows: list[dict]) -> list[dict]:
    return [row for row in rows if row.get("same_text_as_peer", row["identical"])]


def format_row(row: dict, names: list[str]) -> str:
    speeds = "  ".join(f"{row['tokens_per_second'][name]:6.1f}" for name in names)
    return (
        f"{row['prompt'][:16]:16s} {_grounded_cell(row):3s} {row['new_tokens']:4d}  {speeds}  "
        f"{row['alpha']:5.2f}  {row['mean_tokens_per_round']:4.2f}  {row['measured_speedup']:5.2f}  "
        f"{row['accounted_speedup']:5.2f}  {row['predicted_speedup']:5.2f}  {'yes' if row['identical'] else 'NO'}"
    )


def table_header(names: list[str]) -> str:
    return (
        f"{'prompt':16s} {'grd':3s} {'new':>4s}  "
        + "  ".join(f"{name[:6]:>6s}" for name in names)
        + "      α  tok/p  meas.  acct.  pred.  same"
    )


def bench_pass_costs(
    model: PreTrainedModel, context_tokens: int = 200, sizes: tuple[int, ...] = (1, 2, 4, 6, 8), repeats: int = 10
) -> dict[int, float]:
    """t(k) / t(1): one engine round whose target pass reads k tokens after a context_tokens prompt, against one
    token (costs.measure_pass_seconds, which the suffix drafter's cost-aware draft length uses too)."""
    seconds = measure_pass_seconds(model, sizes, context_tokens, repeats)
    return {size: seconds[size] / seconds[sizes[0]] for size in sizes}


def markdown_table(results: dict) -> str:
    """The tables of BENCHMARKS.md, from bench JSON: per prompt, tokens/s, α, the speedup measured, accounted and
    predicted; then the median ratios."""
    names = results["methods"]
    lines = [
        f"Measured {results['date']} on {results['machine']} ({results['device']}, {results.get('dtype', 'float32')}), "
        f"pair {results.get('pair')}: "
        f"{results['model']} drafted by {results.get('draft', 'prompt lookup')}, greedy, "
        f"{results['max_new_tokens']} new tokens at most, K = {results['num_draft_tokens']}, "
        f"median of {results['repeats']} interleaved runs, torch {results['torch']}.",
        "",
        "| prompt | grounded | new tokens | "
        + " | ".join(f"{name} tok/s" for name in names)
        + " | α | acceptance rate | tokens/pass | speedup measured | tokens/pass ÷ round cost | Leviathan predicts |"
        " identical |",
        "|---" * (len(names) + 10) + "|",
    ]
    for row in results["rows"]:
        speeds = " | ".join(f"{row['tokens_per_second'][name]:.1f}" for name in names)
        lines.append(
            f"| {row['prompt']} | {_grounded_cell(row)} | {row['new_tokens']} | {speeds} | "
            f"{row['alpha']:.2f} | {row['acceptance_rate']:.2f} | {row['mean_tokens_per_round']:.2f} | "
            f"{row['measured_speedup']:.2f}× | {row['accounted_speedup']:.2f}× ({row['accounting_error']:+.1%}) | "
            f"{row['predicted_speedup']:.2f}× ({row['prediction_error']:+.0%})"
            + (
                f"; the plans {row['planned_speedup']:.2f}× ({row['plan_error']:+.0%})"
                if row.get("planned_speedup")
                else ""
            )
            + f" | {_identical_cell(row)} |"
        )
    summary = results["summary"]
    groups = [(name, summary[key]) for key, name in GROUPS.items() if key in summary]
    lines += ["", "| median | " + " | ".join(name for name, _ in groups) + " |", "|---" * (len(groups) + 1) + "|"]
    for key in groups[0][1]:
        lines.append(f"| {key} | " + " | ".join(_summary_cell(group.get(key)) for _, group in groups) + " |")
    lines += [
        "",
        f"All outputs identical: {'yes' if summary['all outputs identical'] else 'NO'}. "
        f"Accounting within 5% on every prompt: {'yes' if summary['accounting within 5% on every prompt'] else 'NO'}.",
    ]
    return "\n".join(lines)


GROUPS = {"grounded": "grounded prompts", "open": "open-ended prompts", "unlabelled": "prompts not labelled"}


def _grounded_cell(row: dict) -> str:
    return {True: "yes", False: "no", None: "–"}[row["grounded"]]


def _identical_cell(row: dict) -> str:
    """yes, or which methods' texts differ from our target-only text, with their lengths."""
    if row["identical"]:
        return "yes"
    differs = row.get("differs", [])
    lengths = row.get("new_tokens_by_method", {})
    return "NO" + ": " * bool(differs) + ", ".join(f"{name} ({lengths.get(name, '?')} tokens)" for name in differs)


def _summary_cell(value: float | int | None) -> str:
    if value is None:
        return "–"
    return str(value) if isinstance(value, int) else f"{value:.2f}"
