"""What the inspector's data costs in streaming speed: `bench --app`'s client tokens/s with the per-round views of p, q
and the residual and the trace's replay record, against the same runs with both left out, interleaved; and the
replay record's size per round.

    python -m experiments.inspector_cost --repeats 3
    python -m experiments.inspector_cost --repeats 3 --prompts-file benchmarks/prompts/teaching-fresh.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
from contextlib import nullcontext
from unittest import mock

from specdemo.bench.app import bench_app
from specdemo.bench.prompts import PROMPTS, load_prompts


def without_inspector() -> tuple:
    """The engine keeps no views and the trace no replay record (what main had before them)."""
    return (
        mock.patch("specdemo.engine.decoding.path_views", lambda *args, **kwargs: ()),
        mock.patch("specdemo.app.runs.replay_record", lambda *args, **kwargs: {"format": 0, "rounds": []}),
    )


def main(argv: list[str] | None = None) -> dict:
    flags = argparse.ArgumentParser(description=__doc__)
    flags.add_argument("--repeats", type=int, default=3, help="interleaved pairs of runs")
    flags.add_argument("--prompts", type=int, default=3, help="of the bench's open-ended prompts")
    flags.add_argument("--prompts-file", help="a prompts file instead (e.g. prompts written after the code)")
    flags.add_argument("--max-new-tokens", type=int, default=128)
    args = flags.parse_args(argv)
    prompts = load_prompts(args.prompts_file) if args.prompts_file else PROMPTS[6 : 6 + args.prompts]
    speeds: dict[str, list[float]] = {"with": [], "without": []}
    sizes: list[float] = []
    for _ in range(args.repeats):
        for label in ("with", "without"):
            views, replay = without_inspector() if label == "without" else (nullcontext(), nullcontext())
            with views, replay:
                rows = bench_app(prompts, args.max_new_tokens)
            speeds[label] += [row["client_tokens_per_second"] for row in rows]
            if label == "with":
                sizes += [row["replay_bytes_per_round"] for row in rows]
    result = {
        "client_tokens_per_second_median": {label: round(statistics.median(v), 2) for label, v in speeds.items()},
        "cost": round(1 - statistics.median(speeds["with"]) / statistics.median(speeds["without"]), 3),
        "replay_bytes_per_round_median": round(statistics.median(sizes)),
        "runs_each": len(speeds["with"]),
    }
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
