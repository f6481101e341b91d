"""Where a token's time goes on the CPU: our target-only decoding against Hugging Face `generate`, greedy, the same
prompts, model and number format, interleaved, medians over prompts and repeats. Each decoding step is split by
timing the model's modules from forward hooks:

- attention: the layers' attention modules (projections, RoPE, cache writes and the products);
- MLP, norms and the LM head: those modules;
- rest of the pass: the rest of the model's forward (embedding, rotary tables, transformers' masks, residual adds);
- outside the pass: ours, the pass's layout and masks, the rule and the round's bookkeeping; HF, generate's loop.

The prompt's first pass is left out: every figure is per decoded token.

    python -m benchmarks.token_time --prompts benchmarks/prompts/cpu-fresh.jsonl --dtype bfloat16
    python -m benchmarks.token_time --prompts benchmarks/prompts/cpu-fresh.jsonl --dtype float32
"""

from __future__ import annotations

import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from benchmarks.common import hf_greedy, load, parser
from specdemo.bench.prompts import load_prompts
from specdemo.config import SamplingConfig
from specdemo.core.stats import emitted_ids
from specdemo.engine.decoding import autoregressive_generate
from specdemo.models.loading import chat_prompt_ids

PARTS = ("attention", "MLP", "norms", "LM head", "rest of the pass", "outside the pass")
OURS, HF = "ours", "HF generate"


class StepClock:
    """Seconds per part of the model's forward passes, from hooks on its modules, step by step."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.steps: list[dict[str, float]] = []
        self.handles = []
        inner = model.model
        parts = {"norms": [inner.norm], "LM head": [model.lm_head], "attention": [], "MLP": []}
        for layer in inner.layers:
            parts["attention"].append(layer.self_attn)
            parts["MLP"].append(layer.mlp)
            parts["norms"] += [child for name, child in layer.named_children() if "norm" in name]
        for part, modules in parts.items():
            for module in modules:
                self._time(module, part)
        self._time(model, "pass")

    def _time(self, module: torch.nn.Module, part: str) -> None:
        started: list[float] = []

        def before(*_: object, **__: object) -> None:
            if part == "pass":
                self.steps.append(defaultdict(float))
            started.append(time.perf_counter())

        def after(*_: object, **__: object) -> None:
            self.steps[-1][part] += time.perf_counter() - started.pop()

        self.handles += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def split(steps: list[dict[str, float]], seconds: float) -> dict[str, float]:
    """Milliseconds per token by part, over every step but the prompt's first pass."""
    decoding = steps[1:]
    tokens = len(decoding)
    totals = {part: sum(step[part] for step in decoding) for part in ("attention", "MLP", "norms", "LM head")}
    passes = sum(step["pass"] for step in decoding)
    totals["rest of the pass"] = passes - sum(totals.values())
    totals["outside the pass"] = seconds - steps[0]["pass"] - passes
    return {part: value / tokens * 1e3 for part, value in totals.items()}


def methods(model: torch.nn.Module, max_new_tokens: int) -> dict[str, Callable[[torch.Tensor], list[int]]]:
    def ours(prompt_ids: torch.Tensor) -> list[int]:
        return emitted_ids(autoregressive_generate(model, prompt_ids, SamplingConfig(), max_new_tokens, frozenset()))

    def hf(prompt_ids: torch.Tensor) -> list[int]:  # exactly max_new_tokens, as ours (no EOS given)
        return hf_greedy(model, prompt_ids, max_new_tokens, min_new_tokens=max_new_tokens, pad_token_id=0)

    return {OURS: ours, HF: hf}


def main(argv: list[str] | None = None) -> dict:
    flags = parser(__doc__.split("\n\n")[0])
    flags.add_argument("--prompts", required=True, help="a JSONL prompt set (benchmarks/prompts/README.md)")
    flags.add_argument("--max-new-tokens", type=int, default=64)
    flags.add_argument("--repeats", type=int, default=2)
    args = flags.parse_args(argv)
    loaded = load(args)
    model = loaded.model
    prompts = load_prompts(args.prompts)
    ways = methods(model, args.max_new_tokens)
    for prompt in prompts[:1]:  # warm both up, outside the clock
        for way in ways.values():
            way(chat_prompt_ids(loaded, prompt.text))
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in ways}
    same = 0
    for repeat in range(args.repeats):
        for index, prompt in enumerate(prompts):
            prompt_ids = chat_prompt_ids(loaded, prompt.text)
            order = list(ways) if (repeat + index) % 2 == 0 else list(reversed(ways))
            texts = {}
            for name in order:
                clock = StepClock(model)
                started = time.perf_counter()
                texts[name] = ways[name](prompt_ids)
                seconds = time.perf_counter() - started
                clock.close()
                samples[name].append(split(clock.steps, seconds))
            same += texts[OURS] == texts[HF]
    table = {
        name: {part: statistics.median(sample[part] for sample in rows) for part in PARTS}
        for name, rows in samples.items()
    }
    for figures in table.values():
        figures["token"] = sum(figures[part] for part in PARTS)
    result = {
        "model": args.model,
        "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens,
        "runs": len(samples[OURS]),
        "same_text": same,
        "ms_per_token": table,
        "threads": torch.get_num_threads(),
    }
    print(f"ms per decoded token, {args.dtype}, medians of {len(samples[OURS])} runs each ({same} with the same text)")
    print(f"| part | {OURS} | {HF} |\n|---|---|---|")
    for part in (*PARTS, "token"):
        print(f"| {part} | {table[OURS][part]:.1f} | {table[HF][part]:.1f} |")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
