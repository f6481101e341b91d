"""Captured device programs: a function of fixed input tensors, captured once as a CUDA graph and replayed, so a
round's hundreds of kernels cost one launch from the host. A program writes its results into output tensors made
before its capture, so graphs of one model can share one memory pool for their intermediates and replay in any
order on one stream."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from specdemo.models.platform import fork_safe

# "0" decodes eagerly on CUDA too; "1" tries graphs on any device (a test); "strict": graphs on any device, and a
# capture that fails raises CaptureFailed instead of running eagerly (the GPU check; on a CPU, CheckedProgram)
GRAPHS_VARIABLE = "SPECDEMO_CUDA_GRAPHS"
WARMUP_RUNS = 3  # eager runs on a side stream before a capture, as CUDA graphs need

# One CUDA graph capture at a time in the process (they share a capture stream), and no allocator cache emptied
# during one (empty_cache refuses while a capture is under way).
GRAPH_CAPTURE = fork_safe(threading.Lock())

Outputs = tuple[torch.Tensor, ...]


log = logging.getLogger(__name__)


def uses_graphs(device: torch.device) -> bool:
    """CUDA graphs on CUDA, unless SPECDEMO_CUDA_GRAPHS says otherwise."""
    forced = os.environ.get(GRAPHS_VARIABLE, "").strip().lower()
    return forced in ("1", "strict") if forced in ("0", "1", "strict") else device.type == "cuda"


def strict_graphs() -> bool:
    """SPECDEMO_CUDA_GRAPHS=strict: every program is captured or the run fails (CaptureFailed)."""
    return os.environ.get(GRAPHS_VARIABLE, "").strip().lower() == "strict"


class CaptureFailed(RuntimeError):
    """Under strict graphs, a program that could not be captured: its key and why."""

    def __init__(self, key: Hashable, reason: BaseException | str) -> None:
        super().__init__(f"Could not capture the program {key!r} as a CUDA graph: {reason}")
        self.key = key


def capture_failed(key: Hashable, error: BaseException, what: str) -> None:
    """A capture of `key` failed: under strict graphs, raise CaptureFailed; else one line in the log, and the caller
    runs `what` eagerly from then on."""
    if strict_graphs():
        raise CaptureFailed(key, error) from error
    log.warning("specdemo: %s without CUDA graphs: capturing %r failed (%s)", what, key, error)


def empty_cuda_cache() -> None:
    """Give the allocator's unused blocks back to CUDA, between graph captures."""
    with GRAPH_CAPTURE:
        torch.cuda.empty_cache()


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so that a timer around it measures the work and not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def wait(device: torch.device) -> torch.cuda.Event | None:
    """The host's one wait of a round: until everything queued on the device so far is done (on CUDA, an event
    recorded now, returned for timing); nothing to wait for on the CPU."""
    if device.type != "cuda":
        return None
    done = torch.cuda.Event(enable_timing=True)
    done.record()
    done.synchronize()
    return done


class Program:
    """`run(*inputs)` over fixed input tensors, its results copied into outputs it owns. Eager: each replay runs it."""

    def __init__(self, run: Callable[..., Outputs], inputs: Sequence[torch.Tensor]) -> None:
        self.run, self.inputs = run, list(inputs)
        self.outputs: Outputs = ()

    def replay(self) -> Outputs:
        results = self.run(*self.inputs)
        if not self.outputs:
            self.outputs = tuple(torch.empty_like(result) for result in results)
        for output, result in zip(self.outputs, results, strict=True):
            output.copy_(result)
        return self.outputs


class CapturedProgram(Program):
    """A Program captured as a CUDA graph: a replay launches the recorded kernels, which read `inputs` where they are
    and leave results in `outputs`. Captures hold GRAPH_CAPTURE, so two models' captures and an emptied cache never
    meet; `memory` is the graph pool the model's programs share."""

    def __init__(self, run: Callable[..., Outputs], inputs: Sequence[torch.Tensor], memory: object) -> None:
        super().__init__(run, inputs)
        caller, side = torch.cuda.current_stream(), torch.cuda.Stream()
        self.graph = torch.cuda.CUDAGraph()
        with GRAPH_CAPTURE:
            side.wait_stream(caller)
            try:
                with torch.cuda.stream(side):
                    for _ in range(WARMUP_RUNS):  # the same writes the program makes anyway
                        Program.replay(self)  # also makes the outputs, outside the graph's pool
                with torch.cuda.graph(self.graph, pool=memory, capture_error_mode="thread_local"):
                    for output, result in zip(self.outputs, self.run(*self.inputs), strict=True):
                        output.copy_(result)
            finally:  # a failed capture leaves its stream current: the eager run that follows uses the caller's
                torch.cuda.set_stream(caller)
                caller.wait_stream(side)

    def replay(self) -> Outputs:
        self.graph.replay()
        return self.outputs


def memory_pool(device: torch.device) -> object:
    """A graph memory pool for one model's programs (None where there is no CUDA)."""
    return torch.cuda.graph_pool_handle() if device.type == "cuda" else None


# aten ops a CUDA graph cannot capture: each reads a value back to the host, or sizes its output by values
HOST_READS = frozenset({"_local_scalar_dense", "nonzero", "nonzero_static", "masked_select", "unique_dim",
                        "_unique", "_unique2", "unique_consecutive", "is_nonzero", "equal"})  # fmt: skip
HOST_CALLS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"})


class _HostReads(TorchFunctionMode):
    """Refuses, in its block, every torch call that would make the host wait for a GPU (CheckedProgram)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_CALLS:
            raise RuntimeError(f"{name}() reads a value back to the host, which a CUDA graph cannot capture")
        if name in ("__getitem__", "__setitem__") and _masked(args[1]):
            raise RuntimeError("indexing through a boolean mask sizes its work by values, which a graph cannot capture")
        return func(*args, **(kwargs or {}))


class _HostReadOps(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in HOST_READS or (name in ("index", "index_put", "index_put_") and _masked(args[1])):
            raise RuntimeError(f"aten.{name} reads values back to the host, which a CUDA graph cannot capture")
        return func(*args, **(kwargs or {}))


def _masked(index: object) -> bool:
    indices = index if isinstance(index, (tuple, list)) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


class CheckedProgram(Program):
    """A capture as a CPU can check it, under strict graphs: the warm-up runs, then one run in which any read back to
    the host (what makes a CUDA capture fail) raises; replays run eagerly."""

    def __init__(self, run: Callable[..., Outputs], inputs: Sequence[torch.Tensor]) -> None:
        super().__init__(run, inputs)
        for _ in range(WARMUP_RUNS):
            Program.replay(self)
        with _HostReads(), _HostReadOps():
            Program.replay(self)


def capture(run: Callable[..., Outputs], inputs: Sequence[torch.Tensor], memory: object) -> Program:
    """The program captured as a CUDA graph; raises where it cannot be (no CUDA, a kernel that cannot be captured).
    Under strict graphs on a device without CUDA, a CheckedProgram: the capture's checks, run eagerly."""
    if _stand_in is not None:
        return _stand_in(run, inputs, memory)
    if not torch.cuda.is_available() or inputs[0].device.type != "cuda":
        if strict_graphs():
            return CheckedProgram(run, inputs)
        raise RuntimeError("CUDA graphs need a CUDA device")
    return CapturedProgram(run, inputs, memory)


_stand_in: Callable[..., Program] | None = None


@contextmanager
def standing_in(program: Callable[..., Program]) -> Iterator[None]:
    """Captures made in the block are `program(run, inputs, memory)` instead: the GPU's path on a CPU, where a
    stand-in that runs eagerly lets the tests and benchmarks/round_host.py see what a round does around its replay."""
    global _stand_in
    _stand_in, before = program, _stand_in
    try:
        yield
    finally:
        _stand_in = before
