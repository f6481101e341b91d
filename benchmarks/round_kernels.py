"""Kernels a GPU round launches, counted on the CPU. Unfused, the round program (models/fixed_pass.py's group_round)
launches one kernel per aten op, counted over one eager run (views and allocations left out, as
tests/models/test_round_program.py's DeviceOps counts them). Fused (models/fusion.py), it launches the kernels inductor
generated for its pass and its rule, the library calls their code makes (matrix products, sorts, top-k, cumulative
sums), read from the generated code's `call`, and the few ops the program runs around them; with each compile's
seconds. Inductor's CPU code stands in for its GPU code: the same graphs, fused by the same scheduler, though Triton
and C++ kernels need not split alike.

Target-only greedy, target-only sampled (temperature, top-p, top-k, a repetition penalty) and the suffix drafter's
round at K = 16 (the same program, 16 drafted columns), each with and without the inspector's entries. Random weights
of SmolLM2-135M's shape at a few depths (a 30-layer compile takes minutes on a small CPU): the figures a layer and
their 30-layer extrapolation are printed beside them. --cold compiles into an empty cache folder.

    python -m benchmarks.round_kernels --random-smollm2 [--layers 1 2] [--cold]"""

from __future__ import annotations

import functools
import json
import os
import platform
import re
import tempfile
from collections.abc import Callable, Hashable
from pathlib import Path
from unittest import mock

import torch
from torch._inductor.codecache import PyCodeCache
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from benchmarks.common import load, parser
from benchmarks.cuda_graphs import SMOLLM2_135M
from specdemo.config import SamplingConfig
from specdemo.core.chain_round import packed_columns
from specdemo.core.rules import STANDARD
from specdemo.core.verdicts import RoundAsk
from specdemo.models import fusion, graphs, passes
from specdemo.models.fixed_pass import PASS_COLUMNS, staging_for, write_row
from specdemo.models.fixed_shape import FixedShapeModel
from specdemo.models.layout import RowRequest
from specdemo.models.pools import PASS_ROWS

CASES = {  # name: (settings, drafted tokens)
    "target-only greedy": (SamplingConfig(), 0),
    "target-only sampled": (SamplingConfig(temperature=0.8, top_p=0.9, top_k=50, repetition_penalty=1.2), 0),
    "suffix K=16": (SamplingConfig(), 16),
}
PROMPT_TOKENS = 64
DEPTH = 30  # SmolLM2-135M's layers, for the extrapolation
INPUT_COPY = 1  # the round's inputs copied into the pass's layout (contiguous()), unseen by a dispatch mode under
# inference mode
QUIET = ("empty", "empty_like", "empty_strided", "_to_copy.dtype", "lift_fresh")  # allocations: no kernel


class Ops(TorchDispatchMode):
    """The aten ops that launch a kernel on a GPU (not views, not allocations), by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket.__name__)
        if not func.is_view and name not in QUIET:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def launches(code: str) -> dict[str, int]:
    """What a compiled graph's `call` launches: kernels inductor generated, library calls (extern_kernels.*) and aten
    ops it falls back to."""
    body = code[code.index("def call(") : code.index("runner = Runner(") if "runner = Runner(" in code else None]
    generated = set(re.findall(r"^(\w+) = async_compile\.", code, re.MULTILINE))
    calls = re.findall(r"^\s+(?:\w+ = )?([\w.]+)\(", body, re.MULTILINE)
    return {
        "generated": sum(call.split(".")[0] in generated for call in calls),
        "extern": sum(call.startswith("extern_kernels.") for call in calls),
        "fallback": sum(call.startswith(("aten.", "torch.ops.")) for call in calls),
    }


def round_inputs(verifier: FixedShapeModel, prompt: list[int], sampling: SamplingConfig, drafted: int):
    """A group holding the prompt, and the input buffer of its row's round (drafting the prompt's first tokens)."""
    request = RowRequest(prompt, [], "all", capacity=2 * PROMPT_TOKENS)
    verifier.logits({"row": request})  # reads the prompt into the row's chain
    chain = verifier.rows["row"].chains[0]
    group = chain.group
    staging = staging_for(group, packed_columns(PASS_COLUMNS), verifier.device)
    staging.write[:] = staging.blank
    write_row(
        staging.write[chain.local], RoundAsk(prompt, [prompt[:drafted]], 2 * PROMPT_TOKENS, sampling, STANDARD, 1, 0, 0)
    )
    if sampling.repetition_penalty != 1.0 and group.seen is None:
        group.seen = torch.zeros(PASS_ROWS, verifier.vocab_size, dtype=torch.bool, device=verifier.device)
    return group, staging.inputs.to(verifier.device)


def count_round(run: Callable[[], object]) -> dict:
    """Unfused: the aten ops of one eager run. Fused: each graph's launches, read from its code at its first run,
    which compiles it, and the ops the program runs around its graphs."""
    with mock.patch.dict(os.environ, {fusion.FUSED_VARIABLE: "0"}), Ops() as ops:
        run()
    unfused = len(ops.ops)
    fused = Graphs()
    with mock.patch.dict(os.environ, {fusion.FUSED_VARIABLE: "1"}), mock.patch.object(fusion, "fused", fused.wrap):
        run()  # compiles what is not compiled yet
        fused.ran.clear()
        with Ops() as ops:
            run()
    launched = {str(mode): LAUNCHES[model, mode] for model, mode in fused.ran}
    around = len(ops.ops) + INPUT_COPY
    total = around + sum(sum(counts.values()) for counts in launched.values())
    return {"unfused_ops": unfused, "fused_launches": total, "fused_ops_around_graphs": around, **launched}


class Graphs:
    """fusion.fused whose compiled functions run outside any counting mode, each graph's launches read from the code
    inductor generated (or found in its cache) at its first run."""

    def __init__(self) -> None:
        self.ran: list[Hashable] = []

    def wrap(self, model: PreTrainedModel, mode: Hashable, function: Callable) -> Callable | None:
        compiled = _fused(model, mode, function)
        if compiled is None:
            return None

        def call(*args: object) -> object:
            paths: list[str] = []
            load = PyCodeCache.load_by_key_path

            def loading(key: str, path: str, *more: object, **options: object) -> object:
                paths.append(path)
                return load(key, path, *more, **options)

            with mock.patch.object(PyCodeCache, "load_by_key_path", loading), _disable_current_modes():
                results = compiled(*args)
            for path in paths:
                code = Path(path).read_text()
                if "def call(" in code:
                    LAUNCHES[id(model), mode] = launches(code)
            self.ran.append((id(model), mode))
            return results

        return call


_fused = fusion.fused
LAUNCHES: dict[tuple[int, Hashable], dict[str, int]] = {}  # each graph's, by (id of its model, mode)


def measure(model: PreTrainedModel, cases: list[str], views: list[bool]) -> dict:
    """Each case's counts, with and without the inspector's entries, and the model's compiles."""
    verifier = FixedShapeModel(model)
    prompt = torch.randint(model.config.vocab_size, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(0))
    found: dict = {}
    for name in cases:
        sampling, drafted = CASES[name]
        group, inputs = round_inputs(verifier, prompt.tolist(), sampling, drafted)
        penalty = sampling.repetition_penalty != 1.0
        for shown in views:
            run = functools.partial(
                verifier.runner.group_round, group, not sampling.is_greedy, penalty, inputs, views=shown
            )
            with torch.inference_mode():
                found[f"{name}{'' if shown else ', without views'}"] = count_round(run)
        verifier.drop("row")
    found["compile_seconds"] = {str(mode): round(seconds, 1) for mode, seconds in fusion.compiles(model)}
    return found


def per_layer(results: dict[int, dict], depths: list[int]) -> tuple[dict, dict]:
    """Each count's change a layer between the shallowest and the deepest depth, and the 30-layer extrapolation."""
    low, high = min(depths), max(depths)
    slopes, at_depth = {}, {}
    for case, counts in results[low].items():
        if case == "compile_seconds":
            continue
        for key in ("unfused_ops", "fused_launches"):
            slope = (results[high][case][key] - counts[key]) / (high - low)
            slopes[f"{case}: {key}"] = slope
            at_depth[f"{case}: {key}"] = round(counts[key] + (DEPTH - low) * slope)
    return slopes, at_depth


def main(argv: list[str] | None = None) -> dict:
    flags = parser(__doc__)
    flags.add_argument("--random-smollm2", action="store_true", help="random weights of SmolLM2-135M's shape")
    flags.add_argument("--layers", type=int, nargs="+", default=[1, 2], help="depths of the random model")
    flags.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    flags.add_argument("--smoke", action="store_true", help="target-only greedy with the inspector's entries only")
    flags.add_argument("--cold", action="store_true", help="compile into an empty cache folder")
    args = flags.parse_args(argv)
    cases, views = (["target-only greedy"], [True]) if args.smoke else (args.cases, [True, False])
    settings = {passes.PASS_SHAPE_VARIABLE: "fixed", graphs.GRAPHS_VARIABLE: "0"}  # the GPU's programs, run eagerly
    if args.cold:
        settings["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="round_kernels-")
    result: dict = {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__}
    with mock.patch.dict(os.environ, settings):
        if not args.random_smollm2:
            model = load(args).model
            result[f"{model.config.num_hidden_layers} layers"] = measure(model, cases, views)
        else:
            by_depth = {}
            for depth in sorted(set(args.layers)):
                torch.manual_seed(0)
                config = LlamaConfig(**dict(SMOLLM2_135M, num_hidden_layers=depth))
                model = LlamaForCausalLM(config).to(getattr(torch, args.dtype)).eval()
                by_depth[depth] = result[f"{depth} layers"] = measure(model, cases, views)
            if len(by_depth) > 1:
                result["a layer"], result[f"{DEPTH} layers, extrapolated"] = per_layer(by_depth, list(by_depth))
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
