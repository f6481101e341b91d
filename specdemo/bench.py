"""Benchmark: our target-only and speculative loops against Hugging Face generate, interleaved in one process."""

# B = batch, K = num_draft_tokens, V = vocab_size

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.decoding import autoregressive_generate, speculative_generate
from specdemo.models import LoadedModel, chat_prompt_ids
from specdemo.pairs import DEFAULT_PAIR, make_drafter
from specdemo.rejection import reference_rejection_sample, rejection_sample
from specdemo.stats import run_stats


@dataclass(frozen=True)
class BenchPrompt:
    name: str
    grounded: bool  # True: the answer draws on text in the prompt (where prompt lookup should pay off)
    text: str


_CODE = """def moving_average(values, window):
    result = []
    for i in range(len(values) - window + 1):
        chunk = values[i:i + window]
        result.append(sum(chunk) / window)
    return result
"""
_MEETING = (
    "The quarterly planning meeting is moved from Tuesday, March 4 to Thursday, March 6 at 10:00 in room 2.14. "
    "Anna Berg will present the budget review, Tom Lee will cover the hiring plan, and Maria Lopez will report "
    "on the customer survey. Please send your slides to Anna by Wednesday, March 5 at noon."
)
_RECIPE = (
    "Preheat the oven to 200 degrees. Cut four potatoes into thin slices. Mix the slices with two spoons of "
    "olive oil, a pinch of salt and some rosemary. Spread them on a baking tray and bake for 35 minutes, "
    "turning them once after 20 minutes."
)

PROMPTS: tuple[BenchPrompt, ...] = (
    BenchPrompt(
        "code-type-hints", True, f"Add type hints to this Python function and return the whole function:\n\n{_CODE}"
    ),
    BenchPrompt(
        "code-rename",
        True,
        f"Rename the variable `chunk` to `window_values` in this code and show the full code:\n\n{_CODE}",
    ),
    BenchPrompt(
        "fix-spelling",
        True,
        "Correct the spelling mistakes in this text and return the corrected text:\n\n"
        "The quartely planing meeting is moved from Tuesday to Thursday. Anna will presnt the budget review "
        "and Tom will cover the hirring plan. Please send your slides to Anna by Wendesday at noon.",
    ),
    BenchPrompt(
        "extract-people", True, f"List every person mentioned in this text, with what they will do:\n\n{_MEETING}"
    ),
    BenchPrompt("summarise", True, f"Summarise this message in two sentences:\n\n{_MEETING}"),
    BenchPrompt("recipe-steps", True, f"Rewrite this recipe as a numbered list of steps:\n\n{_RECIPE}"),
    BenchPrompt("story", False, "Write a short story about a lighthouse keeper who finds a message in a bottle."),
    BenchPrompt("explain", False, "Explain why the sky is blue to a ten-year-old."),
    BenchPrompt("poem", False, "Write a poem about autumn in a big city."),
)


Method = Callable[[torch.Tensor], list[int]]  # prompt_ids [1, T] -> generated token ids


def bench_methods(loaded: LoadedModel, speculative: SpeculativeConfig) -> dict[str, Method]:
    """The four ways of decoding greedily that the table compares; all must produce the same tokens."""
    model, eos = loaded.model, loaded.eos_token_ids
    greedy = SamplingConfig()
    num_draft_tokens, max_new_tokens = speculative.num_draft_tokens, speculative.max_new_tokens

    def ours_target_only(prompt_ids: torch.Tensor) -> list[int]:
        rounds = autoregressive_generate(model, prompt_ids, greedy, max_new_tokens, eos)
        return [token for round_ in rounds for token in round_.emitted_token_ids]

    def ours_speculative(prompt_ids: torch.Tensor) -> list[int]:
        drafter = make_drafter(loaded, None, greedy, speculative)
        rounds = speculative_generate(model, drafter, prompt_ids, greedy, speculative, eos)
        return [token for round_ in rounds for token in round_.emitted_token_ids]

    def hf_generate(prompt_ids: torch.Tensor, **extra: int) -> list[int]:
        with torch.inference_mode():
            output = model.generate(
                prompt_ids,
                attention_mask=torch.ones_like(prompt_ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=min(eos),
                **extra,
            )
        return output[0, prompt_ids.shape[1] :].tolist()

    return {
        "target-only (ours)": ours_target_only,
        "speculative n-gram (ours)": ours_speculative,
        "HF generate": hf_generate,
        "HF prompt lookup": lambda prompt_ids: hf_generate(prompt_ids, prompt_lookup_num_tokens=num_draft_tokens),
    }


def _timed(method: Method, prompt_ids: torch.Tensor) -> tuple[list[int], float]:
    started = time.perf_counter()
    tokens = method(prompt_ids)
    return tokens, time.perf_counter() - started


def run_bench(
    loaded: LoadedModel,
    speculative: SpeculativeConfig = SpeculativeConfig(),  # noqa: B008 (frozen, so a shared default is safe)
    repeats: int = 2,
    prompts: tuple[BenchPrompt, ...] = PROMPTS,
    log: Callable[[str], None] = lambda line: None,
    header: Callable[[str], None] = lambda line: None,
) -> dict:
    """Every method on every prompt, the order rotated each time so no method always runs first or warm."""
    methods = bench_methods(loaded, speculative)
    names = list(methods)
    warm_ids = chat_prompt_ids(loaded, "Hello!")
    for method in methods.values():
        method(warm_ids)  # first calls pay one-time initialisation
    header(table_header(names))
    rows = []
    for prompt_index, prompt in enumerate(prompts):
        prompt_ids = chat_prompt_ids(loaded, prompt.text)
        seconds: dict[str, list[float]] = {name: [] for name in names}
        outputs: dict[str, list[int]] = {}
        for repeat in range(repeats):
            shift = (prompt_index + repeat) % len(names)
            for name in names[shift:] + names[:shift]:
                outputs[name], elapsed = _timed(methods[name], prompt_ids)
                seconds[name].append(elapsed)
        # One more speculative run for its rounds: acceptance and overhead are counts, not timings.
        drafter = make_drafter(loaded, None, SamplingConfig(), speculative)
        rounds = list(
            speculative_generate(loaded.model, drafter, prompt_ids, SamplingConfig(), speculative, loaded.eos_token_ids)
        )
        stats = run_stats(rounds)
        num_tokens = len(outputs[names[0]])
        row = {
            "prompt": prompt.name,
            "grounded": prompt.grounded,
            "prompt_tokens": prompt_ids.shape[1],
            "new_tokens": num_tokens,
            "identical": all(output == outputs[names[0]] for output in outputs.values()),
            "tokens_per_second": {name: num_tokens / statistics.median(seconds[name]) for name in names},
            "acceptance_rate": stats.acceptance_rate,
            "mean_tokens_per_round": stats.mean_tokens_per_round,
            "overhead_fraction": stats.overhead_fraction,
        }
        rows.append(row)
        log(format_row(row, names))
    return {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, {platform.processor() or 'cpu'}",
        "device": str(loaded.device),
        "model": loaded.name,
        "torch": torch.__version__,
        "num_draft_tokens": speculative.num_draft_tokens,
        "max_new_tokens": speculative.max_new_tokens,
        "min_ngram_size": speculative.min_ngram_size,
        "repeats": repeats,
        "methods": names,
        "rows": rows,
        "summary": summarise(rows, names),
    }


def summarise(rows: list[dict], names: list[str]) -> dict:
    """Median ratios over the grounded and the open-ended prompts."""
    target, spec, hf, hf_lookup = names

    def median_ratio(group: list[dict], top: str, bottom: str) -> float:
        return statistics.median(row["tokens_per_second"][top] / row["tokens_per_second"][bottom] for row in group)

    summary = {}
    for label, group in (
        ("grounded", [r for r in rows if r["grounded"]]),
        ("open", [r for r in rows if not r["grounded"]]),
    ):
        if not group:
            continue
        summary[label] = {
            "speculative / target-only (ours)": median_ratio(group, spec, target),
            "target-only (ours) / HF generate": median_ratio(group, target, hf),
            "speculative (ours) / HF prompt lookup": median_ratio(group, spec, hf_lookup),
            "HF prompt lookup / HF generate": median_ratio(group, hf_lookup, hf),
            "median acceptance rate": statistics.median(row["acceptance_rate"] for row in group),
            "median overhead fraction": statistics.median(row["overhead_fraction"] for row in group),
        }
    summary["all outputs identical"] = all(row["identical"] for row in rows)
    return summary


def format_row(row: dict, names: list[str]) -> str:
    speeds = "  ".join(f"{row['tokens_per_second'][name]:6.1f}" for name in names)
    return (
        f"{row['prompt']:16s} {'yes' if row['grounded'] else 'no ':3s} {row['new_tokens']:4d}  {speeds}  "
        f"{row['acceptance_rate']:5.2f}  {row['mean_tokens_per_round']:4.2f}  {row['overhead_fraction']:5.1%}  "
        f"{'yes' if row['identical'] else 'NO'}"
    )


def table_header(names: list[str]) -> str:
    return (
        f"{'prompt':16s} {'grd':3s} {'new':>4s}  "
        + "  ".join(f"{name[:6]:>6s}" for name in names)
        + "  accept  tok/r  overhd  same"
    )


def bench_rejection_sampler(
    batch_size: int = 8, num_draft_tokens: int = 5, vocab_size: int = 49152, repeats: int = 50
) -> dict:
    """Median time of rejection_sample against the per-token reference loop, on the same random inputs."""
    generator = torch.Generator().manual_seed(0)

    def random_probs(*shape: int) -> torch.Tensor:  # peaked, like a language model's distributions
        weights = torch.rand(*shape, generator=generator) ** 8
        return weights / weights.sum(dim=-1, keepdim=True)

    target_probs = random_probs(batch_size, num_draft_tokens + 1, vocab_size)  # [B, K+1, V]
    draft_probs = (target_probs[:, :num_draft_tokens] + random_probs(batch_size, num_draft_tokens, vocab_size)) / 2
    draft_ids = torch.multinomial(draft_probs.reshape(-1, vocab_size), 1, generator=generator).reshape(
        batch_size, num_draft_tokens
    )  # [B, K]

    def generators() -> list[torch.Generator]:
        return [torch.Generator().manual_seed(row) for row in range(batch_size)]

    def median_seconds(call: Callable[[], object]) -> float:
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            call()
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    vectorised = median_seconds(lambda: rejection_sample(draft_ids, draft_probs, target_probs, generator=generators()))
    loop = median_seconds(lambda: reference_rejection_sample(draft_ids, draft_probs, target_probs, generators()))
    return {
        "batch_size": batch_size,
        "num_draft_tokens": num_draft_tokens,
        "vocab_size": vocab_size,
        "vectorised_ms": vectorised * 1e3,
        "per_token_loop_ms": loop * 1e3,
        "speedup": loop / vectorised,
    }


def markdown_table(results: dict) -> str:
    """The README's table, from bench JSON: tokens/s per method and prompt, then the median ratios."""
    names = results["methods"]
    lines = [
        f"Measured {results['date']} on {results['machine']} ({results['device']}), {results['model']}, float32, "
        f"greedy, {results['max_new_tokens']} new tokens at most, K = {results['num_draft_tokens']}, "
        f"prompt lookup on matches of {results.get('min_ngram_size', 2)} to 3 tokens, "
        f"median of {results['repeats']} interleaved runs, torch {results['torch']}.",
        "",
        "| prompt | grounded | new tokens | "
        + " | ".join(f"{name} tok/s" for name in names)
        + " | acceptance | tokens/pass | overhead | identical |",
        "|---" * (len(names) + 7) + "|",
    ]
    for row in results["rows"]:
        speeds = " | ".join(f"{row['tokens_per_second'][name]:.1f}" for name in names)
        lines.append(
            f"| {row['prompt']} | {'yes' if row['grounded'] else 'no'} | {row['new_tokens']} | {speeds} | "
            f"{row['acceptance_rate']:.2f} | {row['mean_tokens_per_round']:.2f} | {row['overhead_fraction']:.1%} | "
            f"{'yes' if row['identical'] else 'NO'} |"
        )
    lines += ["", "| median ratio | grounded prompts | open-ended prompts |", "|---|---|---|"]
    grounded, open_ended = results["summary"].get("grounded", {}), results["summary"].get("open", {})
    for key in grounded:
        lines.append(f"| {key} | {grounded[key]:.2f} | {open_ended.get(key, float('nan')):.2f} |")
    sampler = results.get("rejection_sampler")
    if sampler:
        lines += [
            "",
            (
                f"`rejection_sample` at B={sampler['batch_size']}, K={sampler['num_draft_tokens']}, "
                f"V={sampler['vocab_size']}: {sampler['vectorised_ms']:.2f} ms, against "
                f"{sampler['per_token_loop_ms']:.2f} ms for the per-token reference loop ({sampler['speedup']:.1f}×)."
            ),
        ]
    return "\n".join(lines)


def bench_app(prompts: tuple[BenchPrompt, ...] = PROMPTS[6:], max_new_tokens: int = 128) -> list[dict]:
    """Tokens/s as a streaming client sees them against the engine's own figure for the same run, and how often
    the charts were re-sent (the app launched in-process, driven through gradio_client)."""
    from gradio_client import Client

    from specdemo.ui import build_demo

    demo = build_demo()
    _, url, _ = demo.launch(prevent_thread_lock=True, quiet=True)
    try:
        client = Client(url, verbose=False)
        rows = []
        for prompt in (prompts[0], *prompts):  # the first run loads the model and is not counted
            started = time.perf_counter()
            job = client.submit(
                prompt.text,
                DEFAULT_PAIR.key,
                "",
                "ngram",
                0.0,
                0,
                1.0,
                1.0,
                1.5,
                5,
                max_new_tokens,
                0,
                True,
                False,
                api_name="/generate",
            )
            updates = [(time.perf_counter(), update) for update in job]
            client_seconds = updates[-1][0] - started
            # a skipped output arrives as {'__type__': 'update'}; a chart update carries the plot
            chart_times = [when for when, update in updates if "plot" in update[2]]
            with open(job.outputs()[-1][6]["value"]) as handle:
                trace = json.load(handle)
            engine = trace["stats"]
            rows.append(
                {
                    "prompt": prompt.name,
                    "tokens": engine["num_generated"],
                    "engine_tokens_per_second": engine["tokens_per_second"],
                    "client_tokens_per_second": engine["num_generated"] / client_seconds,
                    "ratio": engine["num_generated"] / client_seconds / engine["tokens_per_second"],
                    "updates": len(updates),
                    "chart_updates_per_second": len(chart_times) / max(1e-9, chart_times[-1] - chart_times[0])
                    if len(chart_times) > 1
                    else 0.0,
                }
            )
        return rows[1:]
    finally:
        demo.close()
