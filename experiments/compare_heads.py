"""Two heads prompt by prompt, from `python -m benchmarks.recurrent`'s outputs (for each prompt set, one file per head,
the same runs): for each run, on how many open-ended prompts the first head gives more tokens per pass and on how many
fewer, the mean difference and the two medians, pooled over every set given.

    python -m experiments.compare_heads --set PROMPTS.jsonl FIRST.txt SECOND.txt [--set ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from specdemo.bench.prompts import read_prompts_file


def prompt_rows(path: Path) -> list[dict]:
    """The lines benchmarks.recurrent prints per prompt: its name and each run's tokens per pass."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith('{"prompt"')]


def main(argv: list[str] | None = None) -> dict:
    flags = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    flags.add_argument("--set", nargs=3, action="append", required=True, metavar=("PROMPTS", "FIRST", "SECOND"),
                       help="a prompts file, then the first head's and the second head's outputs on it")  # fmt: skip
    flags.add_argument("--grounded", action="store_true", help="the grounded prompts instead")
    args = flags.parse_args(argv)
    pooled: dict[str, list[tuple[float, float]]] = {}
    for prompts, first, second in args.set:
        grounded = {prompt.name: prompt.grounded for prompt in read_prompts_file(prompts).prompts}
        for a, b in zip(prompt_rows(Path(first)), prompt_rows(Path(second)), strict=True):
            assert a["prompt"] == b["prompt"], f"{first} and {second} do not list the same prompts"
            if grounded[a["prompt"]] == args.grounded:
                for run in sorted(a.keys() - {"prompt"}):
                    pooled.setdefault(run, []).append((a[run], b[run]))
    result = {}
    for run, pairs in pooled.items():
        differences = [a - b for a, b in pairs]
        result[run] = dict(
            prompts=len(pairs),
            higher=sum(d > 0 for d in differences),
            lower=sum(d < 0 for d in differences),
            mean_difference=round(statistics.mean(differences), 3),
            medians=[round(statistics.median(side), 3) for side in zip(*pairs, strict=True)],
        )
        print(json.dumps({"run": run, **result[run]}))
    return result


if __name__ == "__main__":
    main()
