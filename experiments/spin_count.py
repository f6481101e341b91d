"""One-token decoding steps in milliseconds under each OpenMP wait setting, alternated: libgomp reads GOMP_SPINCOUNT
and OMP_WAIT_POLICY once, when torch loads it, so each setting runs in a process of its own. Run it once on an idle
machine and once beside a loop that keeps the cores busy (docs/testing.md, on a busy machine):

    python -m experiments.spin_count
    setsid bash -c 'while true; do .venv/bin/python -m specdemo bench --pass-costs >/dev/null; done' &
    python -m experiments.spin_count; kill -- -$!"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the children run from this checkout's root, importing its specdemo
SETTINGS = {  # name: the environment the steps run in
    "default": {},
    "2000": {"GOMP_SPINCOUNT": "2000"},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
}


def main(argv: list[str] | None = None) -> dict:
    flags = argparse.ArgumentParser(description=__doc__)
    flags.add_argument("--model", default=None, help="default: the offline SmolLM2")
    flags.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    flags.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    flags.add_argument("--rounds", type=int, default=3, help="each setting once a round, in turn")
    flags.add_argument("--steps", type=int, default=30)
    flags.add_argument("--prompt-tokens", type=int, default=128)
    flags.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one setting's steps, in this process
    args = flags.parse_args(argv)
    if args.child:
        print(json.dumps(step_ms(args.model, args.dtype, args.steps, args.prompt_tokens)))
        return {}
    child = [sys.executable, "-m", "experiments.spin_count", "--child", "--dtype", args.dtype]
    child += ["--steps", str(args.steps), "--prompt-tokens", str(args.prompt_tokens)]
    child += ["--model", args.model] if args.model else []
    result: dict[str, list[float]] = {name: [] for name in args.settings}
    for _ in range(args.rounds):
        for name in args.settings:
            environment = {
                key: value for key, value in os.environ.items() if key not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")
            }
            done = subprocess.run(
                child, cwd=ROOT, env=environment | SETTINGS[name], capture_output=True, text=True, check=True
            )
            result[name].append(json.loads(done.stdout.splitlines()[-1]))
    print(json.dumps(result))
    return result


def step_ms(model_name: str | None, dtype: str, steps: int, prompt_tokens: int) -> float:
    """The median of 5 timings of `steps` one-token steps after a prompt of random tokens, in ms a step."""
    import torch
    from transformers import DynamicCache

    from specdemo.models.loading import OFFLINE_DEFAULT, load_model

    model = load_model(model_name or OFFLINE_DEFAULT, device=torch.device("cpu"), dtype=getattr(torch, dtype)).model
    generator = torch.Generator(device="cpu").manual_seed(0)
    prompt = torch.randint(model.config.vocab_size, (1, prompt_tokens), generator=generator, device="cpu")

    def timed() -> float:
        cache = DynamicCache()
        with torch.inference_mode():
            token = model(prompt, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            started = time.perf_counter()
            for _ in range(steps):
                token = model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            return 1e3 * (time.perf_counter() - started) / steps

    timed()  # warm-up
    return round(statistics.median(timed() for _ in range(5)), 1)


if __name__ == "__main__":
    main()
