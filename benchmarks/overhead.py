"""A round's time outside the model, ours against HF's prompt lookup, at B = 1: every model forward timed while each
grounded prompt is decoded by our suffix pair (K = 16) and by `generate(prompt_lookup_num_tokens=16)`, interleaved, the
faster of two runs kept.

    PYTHONPATH=. .venv/bin/python benchmarks/overhead.py --prompts benchmarks/prompts/review-fresh.jsonl"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from specdemo import SamplingConfig, SpeculativeConfig, build_drafter, speculative_generate
from specdemo.bench.prompts import PROMPTS, load_prompts
from specdemo.engine.drafting import prepare_drafter
from specdemo.models.loading import chat_prompt_ids

sys.path.insert(0, str(Path(__file__).parent))
from common import load, parser


def main(argv: list[str] | None = None) -> dict[str, dict]:
    flags = parser(__doc__)
    flags.add_argument("--prompts", help="a prompts file (default: the bench's); its grounded prompts are used")
    flags.add_argument("--max-new-tokens", type=int, default=128)
    args = flags.parse_args(argv)
    target = load(args)
    prepare_drafter("suffix", target, print)
    forwards: list[float] = []
    forward = target.model.forward

    def timed_forward(*inputs, **kwargs):
        started = time.perf_counter()
        output = forward(*inputs, **kwargs)
        forwards.append(time.perf_counter() - started)
        return output

    target.model.forward = timed_forward
    spec = SpeculativeConfig(max_new_tokens=args.max_new_tokens, num_draft_tokens=16)
    methods = {"ours": lambda ids: ours(target, ids, spec), "HF": lambda ids: hf(target, ids, spec)}
    results = {}
    try:
        for prompt in [p for p in (load_prompts(args.prompts) if args.prompts else PROMPTS) if p.grounded is not False]:
            ids, best = chat_prompt_ids(target, prompt.text), {}
            for name in [*methods, *methods]:  # interleaved; the faster run of each is kept
                forwards.clear()
                started = time.perf_counter()
                tokens = methods[name](ids)
                wall = time.perf_counter() - started
                run = {"seconds": wall, "passes": len(forwards), "tokens": tokens}
                run["outside_ms_per_pass"] = 1e3 * (wall - sum(forwards)) / max(1, len(forwards))
                best[name] = min(best.get(name, run), run, key=lambda r: r["seconds"])
            results[prompt.name] = best
            print(prompt.name, "; ".join(f"{n}: {r['tokens']} tokens, {r['passes']} passes, "
                                         f"{r['outside_ms_per_pass']:.1f} ms outside the model per pass"
                                         for n, r in best.items()))  # fmt: skip
    finally:
        target.model.forward = forward
    return results


def ours(target, ids: torch.Tensor, spec: SpeculativeConfig) -> int:
    drafter = build_drafter("suffix", target)
    rounds = speculative_generate(target.model, drafter, ids, SamplingConfig(), spec, target.eos_token_ids)
    return sum(len(r.emitted_token_ids) for r in rounds)


def hf(target, ids: torch.Tensor, spec: SpeculativeConfig) -> int:
    with torch.inference_mode():
        output = target.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=spec.max_new_tokens,
            pad_token_id=min(target.eos_token_ids) if target.eos_token_ids else 0,
            prompt_lookup_num_tokens=16,
        )
    return output.shape[1] - ids.shape[1]


if __name__ == "__main__":
    main()
