"""Batch benchmark: aggregate tokens/s of our batched target-only and speculative decoding per batch size B and
candidates W, against Hugging Face generate batched at the same B, interleaved in one process, medians."""

# B = batch size, T = the longest prompt, W = num_candidates

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from specdemo.bench.prompts import BenchPrompt
from specdemo.bench.single import TARGET_ONLY
from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.core.planning import BatchCosts
from specdemo.drafters.base import Drafter, NoDrafter
from specdemo.engine.costs import batch_costs
from specdemo.engine.decoding import batch_generate
from specdemo.engine.scheduler import MAX_BATCH_ROWS
from specdemo.engine.setup import make_drafter
from specdemo.models.loading import LoadedModel, prompt_token_ids
from specdemo.pairs import DEFAULT_PAIR, Pair

HF_BATCHED = "HF generate batched"
SHARED_CUT = "speculative, cut for shared passes (ours)"  # W = 1, drafts cut by the pass costs, as the app's batches
WARM_UP_TOKENS = 8  # each method's short run at each B before timing


def _ours(
    target: LoadedModel,
    drafter: Drafter,
    prompts: list[list[int]],
    batch_size: int,
    speculative: SpeculativeConfig,
    costs: BatchCosts | None = None,
) -> dict:
    greedy = [SamplingConfig()] * len(prompts)
    rows: dict[int, list] = {}
    started = time.perf_counter()
    for index, round_ in batch_generate(
        target.model, drafter, prompts, greedy, speculative, target.eos_token_ids, batch_size, costs
    ):
        rows.setdefault(index, []).append(round_)
    seconds = time.perf_counter() - started
    tokens = sum(len(r.emitted_token_ids) for rounds in rows.values() for r in rounds)
    return {"seconds": seconds, "tokens": tokens, "tokens_per_pass": tokens / sum(map(len, rows.values()))}


def _hf_batched(target: LoadedModel, prompts: list[list[int]], batch_size: int, max_new_tokens: int) -> dict:
    """generate(do_sample=False) on left-padded static batches of batch_size; tokens counted up to each row's EOS."""
    eos, pad = target.eos_token_ids, min(target.eos_token_ids)
    tokens, seconds = 0, 0.0
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        width = max(map(len, batch))
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=target.device)  # [B, T]
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=target.device)
        started = time.perf_counter()
        with torch.inference_mode():
            output = target.model.generate(
                input_ids,
                attention_mask=attention_mask,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=pad,
            )
        seconds += time.perf_counter() - started
        for row in output[:, width:].tolist():
            tokens += next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
    return {"seconds": seconds, "tokens": tokens}


def run_batch_bench(
    target: LoadedModel,
    draft: LoadedModel | None,
    speculative: SpeculativeConfig,
    prompts: tuple[BenchPrompt, ...],
    batch_sizes: list[int],
    candidates: list[int],
    repeats: int,
    log: Callable[[str], None] = print,
    pair: Pair = DEFAULT_PAIR,
) -> dict:
    """Every B decodes the same work: all the prompts (repeated up to the largest B when fewer), at most B at a time.
    Hugging Face generate takes them in static batches of B; ours refills a finished row's place at the next round
    (continuous batching). Every method runs once per repeat, interleaved, after a short warm-up at that B."""
    encoded = [prompt_token_ids(target, p.text) for p in prompts]
    costs = batch_costs(target.model, MAX_BATCH_ROWS)  # what the app's shared batches cut drafts by
    work = [encoded[i % len(encoded)] for i in range(max(len(encoded), *batch_sizes))]
    results = []
    for batch_size in batch_sizes:

        def methods_for(max_new_tokens: int, b: int = batch_size) -> dict[str, Callable[[], dict]]:
            budget = replace(speculative, max_new_tokens=max_new_tokens)
            methods = {
                HF_BATCHED: lambda: _hf_batched(target, work, b, max_new_tokens),
                TARGET_ONLY: lambda: _ours(target, NoDrafter(), work, b, budget),
            }
            methods[SHARED_CUT] = lambda: _ours(target, make_drafter(pair, target, draft), work, b, budget, costs)
            for w in candidates:
                spec_w = replace(budget, num_candidates=w)
                methods[f"speculative W={w} (ours)"] = lambda s=spec_w: _ours(
                    target, make_drafter(pair, target, draft), work, b, s
                )
            return methods

        for method in methods_for(WARM_UP_TOKENS).values():
            method()
        methods = methods_for(speculative.max_new_tokens)
        runs: dict[str, list[dict]] = {name: [] for name in methods}
        for _ in range(repeats):
            for name, method in methods.items():
                runs[name].append(method())
        row = {"batch_size": batch_size, "num_prompts": len(work)}
        for name, measured in runs.items():
            row[name] = {
                "tokens_per_second": statistics.median(m["tokens"] / m["seconds"] for m in measured),
                "tokens": measured[-1]["tokens"],
                **({"tokens_per_pass": measured[-1]["tokens_per_pass"]} if "tokens_per_pass" in measured[-1] else {}),
            }
        log(batch_table([row], list(methods)))
        results.append(row)
    return {"rows": results, "methods": list(methods)}


def batch_table(rows: list[dict], names: list[str]) -> str:
    """Aggregate tokens/s per B (and tokens per target pass per row for ours)."""
    lines = ["| B | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
    for row in rows:
        cells = []
        for name in names:
            cell = f"{row[name]['tokens_per_second']:.1f}"
            if "tokens_per_pass" in row[name]:
                cell += f" ({row[name]['tokens_per_pass']:.2f}/pass)"
            cells.append(cell)
        lines.append(f"| {row['batch_size']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
