"""Our target-only decoding on an idle machine and beside a busy process, as the CLI runs it: each run is `python -m
specdemo generate --baseline` in a process of its own (libgomp reads its waiting once, as torch loads), under each
OpenMP setting in turn, alternated. The busy process multiplies matrices on every core with libgomp's default waiting.

    python -m benchmarks.busy --repeats 3 --max-new-tokens 32 --dtype bfloat16

Settings: `specdemo` (the app's and the CLI's: libgomp's spinning, and threads that follow the cores' load,
models/threads.py), `threads fixed` (SPECDEMO_ADAPTIVE_THREADS=0: torch's count throughout) and `spin 2000, threads
fixed` (GOMP_SPINCOUNT=2000 as well: workers that sleep soon) and `one thread` (OMP_NUM_THREADS=1); `--spin-counts
20000 ...` adds others, threads fixed.
Reports tokens per second, medians, and busy ÷ idle."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import parser

ROOT = Path(__file__).resolve().parents[1]
FIXED = {"SPECDEMO_ADAPTIVE_THREADS": "0"}
SETTINGS = {
    "specdemo": {},
    "threads fixed": FIXED,
    "spin 2000, threads fixed": {**FIXED, "GOMP_SPINCOUNT": "2000"},
    "one thread": {**FIXED, "OMP_NUM_THREADS": "1"},
}
OURS = (
    "GOMP_SPINCOUNT",
    "OMP_WAIT_POLICY",
    "SPECDEMO_ADAPTIVE_THREADS",
)  # what the settings set, taken from the caller
BUSY = """import torch
a = torch.randn(1500, 1500)
while True:
    a = (a @ a).clamp_(-1, 1)
"""
PROMPT = "Explain why the sky looks blue at noon and red at sunset."


def tokens_per_second(args, extra: dict[str, str]) -> float:
    env = {key: value for key, value in os.environ.items() if key not in OURS}
    command = [sys.executable, "-m", "specdemo", "generate", "--baseline", "--target", args.model, "--json"]
    command += ["--max-new-tokens", str(args.max_new_tokens), "--dtype", args.dtype, "--prompt", PROMPT]
    done = subprocess.run(command, cwd=ROOT, env={**env, **extra}, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)["stats"]["tokens_per_second"]


def main(argv: list[str] | None = None) -> dict:
    flags = parser(__doc__.split("\n\n")[0])
    flags.add_argument("--max-new-tokens", type=int, default=32)
    flags.add_argument("--repeats", type=int, default=3)
    flags.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    flags.add_argument("--states", nargs="+", default=["idle", "busy"], choices=["idle", "busy"])
    flags.add_argument("--spin-counts", nargs="*", type=int, default=[], help="more settings: GOMP_SPINCOUNT=N each")
    args = flags.parse_args(argv)
    if any(count < 0 for count in args.spin_counts):
        flags.error(f"--spin-counts takes counts of 0 or more (libgomp's default is 300000), got {args.spin_counts}")
    settings = SETTINGS | {f"spin {n}, threads fixed": {**FIXED, "GOMP_SPINCOUNT": str(n)} for n in args.spin_counts}
    args.settings += [name for name in settings if name not in SETTINGS]
    speeds = {state: {name: [] for name in args.settings} for state in args.states}
    for state in speeds:
        busy = subprocess.Popen([sys.executable, "-c", BUSY]) if state == "busy" else None
        try:
            if busy:
                time.sleep(2)  # its workers running
            for repeat in range(args.repeats):
                order = args.settings if repeat % 2 == 0 else list(reversed(args.settings))
                for name in order:
                    speeds[state][name].append(tokens_per_second(args, settings[name]))
        finally:
            if busy:
                busy.kill()
                busy.wait()
    result = {
        name: {**{state: statistics.median(speeds[state][name]) for state in speeds}, "runs": speeds}
        for name in args.settings
    }
    print(f"tokens/s, target-only, {args.max_new_tokens} tokens, {args.dtype}, medians of {args.repeats}")
    print(f"| setting | {' | '.join(speeds)} | busy ÷ idle |\n|---|{'---|' * len(speeds)}---|")
    for name, figures in result.items():
        if len(speeds) == 2:
            figures["busy_over_idle"] = figures["busy"] / figures["idle"]
        cells = " | ".join(f"{figures[state]:.1f}" for state in speeds)
        print(f"| {name} | {cells} | {figures.get('busy_over_idle', float('nan')):.2f} |")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
