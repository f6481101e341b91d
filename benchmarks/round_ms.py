"""A round's wall time in milliseconds, by pass width, for one row and for eight: engine rounds (the pass, the cache's
bookkeeping, the probabilities and the rule) after a 200-token context, the fastest of 7. SPECDEMO_PASS_SHAPE=fixed
or tree picks the passes (a CPU takes tree passes by default).

    python -m benchmarks.round_ms --dtype bfloat16
    SPECDEMO_PASS_SHAPE=fixed python -m benchmarks.round_ms --dtype bfloat16 --widths 1 17 --rows 1 8"""

from __future__ import annotations

import json

from benchmarks.common import load, parser
from specdemo.engine.costs import measure_round_seconds


def main(argv: list[str] | None = None) -> dict:
    flags = parser(__doc__.split("\n\n")[0])
    flags.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8, 17])
    flags.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    flags.add_argument("--repeats", type=int, default=7)
    args = flags.parse_args(argv)
    model = load(args).model
    seconds = measure_round_seconds(model, tuple(args.widths), 200, args.repeats, rows=tuple(args.rows))
    result = {rows: {width: round(1e3 * s, 1) for width, s in by_width.items()} for rows, by_width in seconds.items()}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
