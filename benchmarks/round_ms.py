"""A round's wall time in milliseconds, by pass width, for one row and for eight: engine rounds (the pass, the cache's
bookkeeping, the probabilities and the rule) after a 200-token context, the fastest of 7 (the median before
2026-11-26). SPECDEMO_PASS_SHAPE=fixed or tree picks the passes (a CPU takes tree passes by default). It runs on this
commit and on commits before the move into packages, so two engines can be alternated:

    PYTHONPATH=. .venv/bin/python benchmarks/round_ms.py --dtype bfloat16
    (cd ../other-checkout && PYTHONPATH=. /path/to/.venv/bin/python /path/to/benchmarks/round_ms.py --dtype bfloat16)"""

from __future__ import annotations

import argparse
import json

import torch

try:  # this layout
    from specdemo.engine.costs import measure_round_seconds
    from specdemo.models.loading import OFFLINE_DEFAULT, load_model
except ImportError:  # before 2026-11-25's move into packages
    from specdemo.costs import measure_round_seconds

    from specdemo.models import OFFLINE_DEFAULT, load_model


def main(argv: list[str] | None = None) -> dict:
    flags = argparse.ArgumentParser(description=__doc__)
    flags.add_argument("--model", default=OFFLINE_DEFAULT)
    flags.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    flags.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8, 17])
    flags.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    flags.add_argument("--repeats", type=int, default=7)
    args = flags.parse_args(argv)
    model = load_model(args.model, device=torch.device("cpu"), dtype=getattr(torch, args.dtype)).model
    seconds = measure_round_seconds(model, tuple(args.widths), 200, args.repeats, rows=tuple(args.rows))
    result = {rows: {width: round(1e3 * s, 1) for width, s in by_width.items()} for rows, by_width in seconds.items()}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
