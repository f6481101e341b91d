"""What a recurrent-head draft step costs against a target step, by sub-vocabulary size S and by the target layers the
head reads: the median time of the drafter's propose() for one row (K tokens, W = 1, greedy and sampled) per drafted
token, over an engine round of the target with one token after a 200-token context (the pass, the cache's
bookkeeping, the probabilities and the rule). Random head weights (the cost does not depend on them), in the target's
format, as load_head gives them. --layers also measures what handing a head its layers' states adds to a round:
one-token rounds keeping no states, and keeping each choice's, interleaved (fastest and median of --repeats).

    python -m benchmarks.head_cost --dtype bfloat16 --sizes 8192 --layers 30 15,22,30"""

from __future__ import annotations

import json
import statistics
import time

import torch

from benchmarks.common import load, parser
from specdemo.config import MAX_NEW_TOKENS_LIMIT, SamplingConfig, SpeculativeConfig
from specdemo.drafters.base import Draft, DraftRequest
from specdemo.drafters.head import RecurrentHead
from specdemo.drafters.recurrent import RecurrentDrafter
from specdemo.engine.costs import measure_round_seconds
from specdemo.engine.decoding import BatchDecoder


class ReadsStates:
    """Drafts nothing, but has the engine hand it `hidden_layers`' states every round."""

    reads_hidden_state = True

    def __init__(self, layers: tuple[int, ...]) -> None:
        self.hidden_layers = layers

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        return [Draft([], None) for _ in requests]

    def forget(self, key) -> None:
        pass


def round_seconds_keeping(model, choices: list[tuple[int, ...]], repeats: int) -> dict[str, dict[str, float]]:
    """One-token engine rounds after a 200-token context, keeping no states or each choice's, interleaved."""
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(model.config.vocab_size, (200,), generator=generator).tolist()
    decoders = {layers: BatchDecoder(model, ReadsStates(layers), frozenset()) for layers in [(), *choices]}
    for decoder in decoders.values():
        decoder.add(0, context, SamplingConfig(), SpeculativeConfig(max_new_tokens=MAX_NEW_TOKENS_LIMIT))
    times: dict[tuple[int, ...], list[float]] = {layers: [] for layers in decoders}
    for repeat in range(repeats + 1):
        for layers, decoder in decoders.items():
            started = time.perf_counter()
            decoder.step()
            if repeat:
                times[layers].append(time.perf_counter() - started)
    none = times[()]
    return {
        ",".join(map(str, layers)) or "none": {
            "fastest_ms": round(1e3 * min(t), 3),
            "median_ms": round(1e3 * statistics.median(t), 3),
            "extra_share_fastest": round(min(t) / min(none) - 1, 4),
            "extra_share_median": round(statistics.median(t) / statistics.median(none) - 1, 4),
        }
        for layers, t in times.items()
    }


def draft_step_seconds(drafter: RecurrentDrafter, sampling: SamplingConfig, depth: int, repeats: int) -> float:
    hidden = torch.randn(len(drafter.head.shape.layers) * drafter.head.shape.hidden_size)
    generator = torch.Generator().manual_seed(0)
    times = []
    for repeat in range(repeats + 1):
        request = DraftRequest(repeat, [1, 2, 3], depth, 1, sampling, generator, hidden)
        started = time.perf_counter()
        drafter.propose([request])
        if repeat:
            times.append((time.perf_counter() - started) / depth)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    flags = parser(__doc__)
    flags.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768, 49152])
    flags.add_argument("--depth", type=int, default=4)
    flags.add_argument("--repeats", type=int, default=21)
    flags.add_argument("--layers", nargs="+", default=["-1"], help="layer choices the head reads, e.g. 30 8,15,30")
    args = flags.parse_args(argv)
    choices = [tuple(int(layer) for layer in choice.split(",")) for choice in args.layers]
    target = load(args)
    vocab_size = target.vocab_size
    target_round = measure_round_seconds(target.model, (1,), 200, args.repeats, rows=(1,))[1][1]
    result: dict = {"dtype": args.dtype, "target_round_ms": round(1e3 * target_round, 2), "sizes": {}}
    for size in args.sizes:
        for layers in choices:
            vocabulary = torch.arange(min(size, vocab_size))
            head = RecurrentHead(target.model, vocabulary, layers=layers).to(target.model.dtype).eval()
            drafter = RecurrentDrafter(head, vocab_size)
            greedy = draft_step_seconds(drafter, SamplingConfig(), args.depth, args.repeats)
            sampled = draft_step_seconds(drafter, SamplingConfig(temperature=0.7), args.depth, args.repeats)
            result["sizes"][f"{min(size, vocab_size)} layers {','.join(map(str, layers))}"] = {
                "greedy_ms": round(1e3 * greedy, 3),
                "sampled_ms": round(1e3 * sampled, 3),
                "greedy_share": round(greedy / target_round, 4),
                "sampled_share": round(sampled / target_round, 4),
            }
    result["rounds_keeping_states"] = round_seconds_keeping(target.model, choices, args.repeats)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
