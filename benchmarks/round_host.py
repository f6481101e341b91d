"""The host's time around a GPU round, measured on the CPU with a model that costs nothing: fixed-shape passes and
graphs forced, each capture a stand-in whose first replay runs the program and whose later replays return its
outputs at once, claiming as many tokens accepted as asked (all the drafted ones, or none). What remains of a round is
what the host does around one launch: drafting, writing the inputs, reading the packed round back, the Round, the
inspector's views. Target-only, and the suffix drafter at K = 16 on a text that repeats (it drafts 16 a round), from
sequences of about 200 and 2,000 tokens; the median round of each run, the least of three runs. Random weights of
SmolLM2-135M's shape, two layers (the host's work does not depend on the weights or the depth).

    python -m benchmarks.round_host [--json results.json]"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from unittest import mock

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.cuda_graphs import SMOLLM2_135M
from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.core.planning import PassCosts
from specdemo.drafters import Drafter, NoDrafter, SuffixDrafter
from specdemo.engine.decoding import BatchDecoder
from specdemo.models import graphs, passes
from specdemo.models.fixed_pass import PASS_COLUMNS
from specdemo.models.graphs import Program

NEW_TOKENS = 48
DEPTH = 16
CYCLE = 50  # the text repeats 50 random tokens
LENGTHS = (200, 2000)
RUNS = 3
EOS: frozenset[int] = frozenset()
SHAPE = dict(SMOLLM2_135M, num_hidden_layers=2)  # the host's work per round does not depend on the depth


class ZeroCost(Program):
    """A captured round that costs nothing: its first replay runs the program, the later ones return its outputs with
    each row's accepted count set to min(`accepted`, drafted) and its next token the one that continues `cycle` (the
    text repeats it), so the suffix drafter keeps finding what follows."""

    accepted = 0
    cycle = torch.zeros(1, dtype=torch.float64)  # [C] token ids

    def __init__(self, run: Callable, inputs: list[torch.Tensor], memory: object) -> None:
        super().__init__(run, inputs)

    def replay(self) -> tuple[torch.Tensor, ...]:
        if not self.outputs:
            return super().replay()
        inputs, packed = self.inputs[0], self.outputs[0]  # [R, C], [R, P]
        accepted = inputs[:, 4 * PASS_COLUMNS].clamp(max=ZeroCost.accepted)  # [R] of the drafted
        packed[:, 0] = accepted
        packed[:, 1] = ZeroCost.cycle[(inputs[:, PASS_COLUMNS] + accepted + 1).long() % len(ZeroCost.cycle)]
        return self.outputs


def host_ms_per_round(
    target: torch.nn.Module, drafter: Callable[[], Drafter], prompt: list[int], depth: int, new_tokens: int, runs: int
) -> dict:
    """The median round's milliseconds, the least of `runs` runs, and the tokens drafted a round."""
    medians, drafted = [], []
    for _ in range(runs):
        decoder = BatchDecoder(target, drafter(), EOS)
        decoder.add(0, prompt, SamplingConfig(), SpeculativeConfig(depth, max_new_tokens=new_tokens))
        decoder.step()  # the prompt's read, apart
        rounds = []
        while decoder.rows:
            started = time.perf_counter()
            outcomes = decoder.step()
            rounds.append((time.perf_counter() - started) * 1000)
            drafted.append(len(outcomes[0][1].draft_token_ids))
        medians.append(statistics.median(rounds))
    return {"host_ms_per_round": round(min(medians), 3), "drafted_per_round": round(statistics.mean(drafted), 2)}


def main(argv: list[str] | None = None) -> dict:
    flags = argparse.ArgumentParser(description=__doc__)
    flags.add_argument("--json", help="also write the results here")
    flags.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS), help="sequence lengths, in tokens")
    flags.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    flags.add_argument("--runs", type=int, default=RUNS, help="runs of each; the least median is kept")
    args = flags.parse_args(argv)
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(**SHAPE)).eval()
    free = PassCosts.from_seconds({1: 1.0, 2: 1.01, 129: 1.1})  # passes nearly free: the drafter drafts it all
    results: dict = {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__}
    gpu_path = {passes.PASS_SHAPE_VARIABLE: "fixed", graphs.GRAPHS_VARIABLE: "1"}  # the GPU's, on any device
    with mock.patch.dict(os.environ, gpu_path), graphs.standing_in(ZeroCost):
        for length in args.lengths:
            ZeroCost.cycle = torch.randint(0, SHAPE["vocab_size"], (CYCLE,), generator=torch.Generator().manual_seed(1))
            prompt = (ZeroCost.cycle.tolist() * (length // CYCLE + 1))[:length]  # the token at position t: cycle[t % C]
            ZeroCost.cycle = ZeroCost.cycle.double()
            ZeroCost.accepted = 0
            each = dict(new_tokens=args.new_tokens, runs=args.runs)
            results[f"target-only, {length} tokens"] = host_ms_per_round(target, NoDrafter, prompt, 1, **each)
            for accepted in (DEPTH, 0):
                ZeroCost.accepted = accepted
                results[f"suffix K={DEPTH}, {accepted} accepted, {length} tokens"] = host_ms_per_round(
                    target, lambda: SuffixDrafter(free, cache_tokens=0), prompt, DEPTH, **each
                )
    print(json.dumps(results, indent=1))
    if args.json:
        with open(args.json, "w") as file:
            json.dump(results, file, indent=1)
    return results


if __name__ == "__main__":
    main()
