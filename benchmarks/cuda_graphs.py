"""Our fixed-shape pass (models/fixed_shape.py) decoding greedily, eager and replayed from a CUDA graph: milliseconds a
token, the graph's capture time, and whether every replayed step's logits are the eager step's bit for bit; HF
`generate` beside them. On a GPU the engine is bound by launching kernels (about 1,300 a token, issue 37); a graph
launches a whole pass at once, and replays the kernels it captured, so the bits should not change. Without CUDA it
times the eager pass only. --compile-check asks torch.compile(fullgraph=True) to trace the pass whole: no graph break
means no host sync inside, the CPU's proxy for a pass that a graph can capture.

    python3 -m benchmarks.cuda_graphs --random-smollm2 --dtype bfloat16"""

from __future__ import annotations

import json
import platform
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from benchmarks.common import parser
from specdemo.models.fixed_shape import PASS_COLUMNS, PASS_ROWS, FixedShapeModel
from specdemo.models.graphs import synchronize
from specdemo.models.layout import RowRequest
from specdemo.models.loading import load_model

SMOLLM2_135M = dict(  # SmolLM2-135M-Instruct's shape: a pass's cost does not depend on the weights
    vocab_size=49_152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rope_theta=100_000.0,
    tie_word_embeddings=True,
)


def main(argv: list[str] | None = None) -> dict:
    flags = parser(__doc__)
    flags.add_argument("--random-smollm2", action="store_true", help="random weights of SmolLM2-135M's shape")
    flags.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    flags.add_argument("--prompt-tokens", type=int, default=200)
    flags.add_argument("--steps", type=int, default=64, help="tokens decoded a run")
    flags.add_argument("--repeats", type=int, default=3, help="runs of each method, interleaved; medians")
    flags.add_argument("--compile-check", action="store_true")
    args = flags.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    if args.random_smollm2:
        model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).to(device=device, dtype=dtype).eval()
    else:
        model = load_model(args.model, device=device, dtype=dtype, allow_local=True).model
    prompt = torch.randint(model.config.vocab_size, (args.prompt_tokens,), device="cpu").tolist()
    with torch.inference_mode():
        result = measure(model, prompt, args.steps, args.repeats, args.compile_check)
    print(json.dumps(result, indent=1))
    return result


def measure(model: PreTrainedModel, prompt: list[int], steps: int, repeats: int, compile_check: bool) -> dict:
    device = model.device
    passes = FixedShapeModel(model)
    passes.logits({"row": RowRequest(prompt, [], "all", capacity=len(prompt) + steps + 1)})  # reads the prompt
    chain = passes.rows["row"].chains[0]
    pool, first, local = chain.group, 0, chain.local

    def inputs(token: int, position: int) -> list[torch.Tensor]:  # a one-token step of the row, as _decode pads it
        ids = torch.zeros(PASS_ROWS, PASS_COLUMNS, dtype=torch.long)
        real = torch.zeros(PASS_ROWS, PASS_COLUMNS, dtype=torch.bool)
        positions = torch.zeros(PASS_ROWS, PASS_COLUMNS, dtype=torch.long)
        ids[local, 0], real[local, 0], positions[local, 0] = token, True, position
        slots = torch.where(real, positions, pool.slots - 1)
        return [t.to(device) for t in (ids, positions, slots, real)]

    def step(ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        return passes.run_pass(pool, first, ids, positions, slots, real, PASS_COLUMNS)[0]  # [R, n, V]

    def decode(run_step) -> tuple[list[int], list[torch.Tensor], float]:  # tokens, each step's logits row, ms a token
        token, tokens, rows = prompt[-1], [], []
        synchronize(device)
        started = time.perf_counter()
        for position in range(len(prompt) - 1, len(prompt) - 1 + steps):
            logits = run_step(inputs(token, position))[local, 0]
            token = int(logits.argmax())  # the host waits for the step, as the engine's rule does
            tokens.append(token)
            rows.append(logits.clone())
        return tokens, rows, 1e3 * (time.perf_counter() - started) / steps

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    result: dict = dict(device=name, dtype=str(model.dtype), torch=torch.__version__, prompt_tokens=len(prompt),
                        steps=steps, pass_shape=[PASS_ROWS, PASS_COLUMNS], slots=pool.slots)  # fmt: skip
    if compile_check:
        traced = torch.compile(step, fullgraph=True, backend="eager")
        result["compiles_whole"] = bool(torch.equal(traced(*inputs(prompt[-1], len(prompt) - 1)),
                                                    step(*inputs(prompt[-1], len(prompt) - 1))))  # fmt: skip
    methods = {"eager": lambda: decode(lambda given: step(*given))}
    if device.type == "cuda":
        try:
            methods["graph"] = graph_method(step, inputs(prompt[-1], len(prompt) - 1), decode, result)
        except RuntimeError as error:  # say what stopped the capture, and still time the rest
            result["capture_failed"] = f"{type(error).__name__}: {error}"[:2000]
    methods["HF generate"] = lambda: hf_generate(model, prompt, steps)
    timings: dict[str, list[float]] = {name: [] for name in methods}
    outcomes = {}
    for repeat in range(repeats + 1):  # the first is a warm-up
        for name in list(methods)[:: 1 if repeat % 2 else -1]:
            outcomes[name] = methods[name]()
            if repeat:
                timings[name].append(outcomes[name][2])
    result["ms_per_token"] = {name: round(statistics.median(times), 2) for name, times in timings.items()}
    if "graph" in outcomes:
        eager, graph = outcomes["eager"], outcomes["graph"]
        same = sum(torch.equal(a, b) for a, b in zip(eager[1], graph[1], strict=True))
        result["graph_logits_bitwise_equal_steps"] = f"{same}/{steps}"
        result["graph_tokens_equal"] = eager[0] == graph[0]
    return result


def graph_method(step, example: list[torch.Tensor], decode, result: dict):
    """Capture `step` on static copies of `example` (after warm-up passes on a side stream, as CUDA graphs need), and
    return a method that decodes by copying each step's inputs in and replaying."""
    static = [tensor.clone() for tensor in example]
    started = time.perf_counter()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = step(*static)
    torch.cuda.synchronize()
    result["capture_seconds"] = round(time.perf_counter() - started, 3)

    def replayed(given: list[torch.Tensor]) -> torch.Tensor:
        for target, source in zip(static, given, strict=True):
            target.copy_(source)
        graph.replay()
        return output

    return lambda: decode(replayed)


def hf_generate(model: PreTrainedModel, prompt: list[int], steps: int) -> tuple[list[int], list, float]:
    ids = torch.tensor([prompt], device=model.device)
    synchronize(model.device)
    started = time.perf_counter()
    out = model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0)
    synchronize(model.device)
    return out[0, len(prompt) :].tolist(), [], 1e3 * (time.perf_counter() - started) / steps


if __name__ == "__main__":
    main()
