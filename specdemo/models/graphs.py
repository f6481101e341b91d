"""Captured device programs: a function of fixed input tensors, captured once as a CUDA graph and replayed, so a
round's hundreds of kernels cost one launch from the host. A program writes its results into output tensors made
before its capture, so graphs of one model can share one memory pool for their intermediates and replay in any
order on one stream.

One capture at a time, and no other device work beside it: PyTorch forbids other CUDA work during a capture (a
device-wide synchronize, or work on the default stream, in one thread breaks another thread's capture). So every
piece of device work in a thread takes DEVICE_WORK, one reentrant lock for the process: every capture (`capture`
takes it, stand-ins included), every round and pass (the schedulers' `models_lock` is DEVICE_WORK; the fixed-shape
passes and the head's steps take it again), the work a load does on the device (weights moved, kernels warmed,
programs captured, pass costs measured) and emptying the allocator's cache. Files are read from disk without it.
Rounds never synchronize the whole device: the host waits on an event recorded on its own stream (`wait`).

Lock order, deadlock-free: DEVICE_WORK comes first. Under it, a model's own locks (FixedShapeModel.lock,
ModelPools.lock, pools._POOLS_LOCK, head_steps' cache lock), none of which is held while DEVICE_WORK is asked for
(FixedShapeModel's passes take DEVICE_WORK before their own lock; a capture inside them asks for it again, which a
reentrant lock grants its holder at once). The locks held while asking for it (ModelCache's, whose evictions empty
the cache, and its loading locks, around a load) are never asked for under it."""

from __future__ import annotations

import gc
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


Outputs = tuple[torch.Tensor, ...]


log = logging.getLogger(__name__)


class DeviceLock:
    """A reentrant lock that counts the threads blocked waiting for it, and tells `changed` when that count moves
    (tests wait on it to see another thread blocked rather than at work)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.changed = threading.Condition(threading.Lock())
        self.waiting = 0  # threads blocked in acquire

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._lock.acquire(blocking=False):
            return True
        if not blocking:
            return False
        self._count(+1)
        try:
            return self._lock.acquire(timeout=timeout)
        finally:
            self._count(-1)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exception: object) -> None:
        self.release()

    def _count(self, step: int) -> None:
        with self.changed:
            self.waiting += step
            self.changed.notify_all()

    def _at_fork_reinit(self) -> None:  # platform.fork_safe: free and uncounted in a forked child
        self._lock._at_fork_reinit()  # type: ignore[attr-defined]
        self.changed = threading.Condition(threading.Lock())
        self.waiting = 0


DEVICE_WORK = fork_safe(DeviceLock())  # the one lock for device work in the process (see the module's docstring)


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
    out_of_memory = isinstance(error, torch.OutOfMemoryError)
    reason = f"out of memory twice, idle memory let go between: {error}" if out_of_memory else error
    if strict_graphs():
        raise CaptureFailed(key, reason) from error
    log.warning("specdemo: %s without CUDA graphs: capturing %r failed (%s)", what, key, reason)


def empty_cuda_cache() -> None:
    """Give the allocator's unused blocks back to CUDA, between graph captures (empty_cache refuses during one)."""
    with DEVICE_WORK:
        torch.cuda.empty_cache()


def synchronize(device: torch.device) -> None:
    """Wait for all of the device's queued work, so that a benchmark's timer measures the work and not its launch.
    Device-wide: a capture in another thread would break, so rounds and loads `wait` instead."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def wait(device: torch.device) -> torch.cuda.Event | None:
    """The host waits until the work queued so far on its current stream is done: on CUDA, an event recorded there
    (returned, for timing), never the whole device; on MPS, which captures nothing, the device; nothing on the CPU."""
    if device.type == "mps":
        torch.mps.synchronize()
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
    and leave results in `outputs`. It is made under DEVICE_WORK (`capture`), so no other device work meets its
    capture; `memory` is the graph pool the model's programs share."""

    def __init__(self, run: Callable[..., Outputs], inputs: Sequence[torch.Tensor], memory: object) -> None:
        super().__init__(run, inputs)
        caller, side = torch.cuda.current_stream(), torch.cuda.Stream()
        self.graph = torch.cuda.CUDAGraph()
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
    """The program captured as a CUDA graph, holding DEVICE_WORK; raises where it cannot be (no CUDA, a kernel that
    cannot be captured, out of memory). Under strict graphs on a device without CUDA, a CheckedProgram: the
    capture's checks, run eagerly."""
    with DEVICE_WORK:
        if _stand_in is not None:
            return _stand_in(run, inputs, memory)
        if not torch.cuda.is_available() or inputs[0].device.type != "cuda":
            if strict_graphs():
                return CheckedProgram(run, inputs)
            raise RuntimeError("CUDA graphs need a CUDA device")
        return CapturedProgram(run, inputs, memory)


def capture_with_room(
    run: Callable[..., Outputs], inputs: Sequence[torch.Tensor], memory: object, make_room: Callable[[], None]
) -> Program:
    """`capture`; where the device runs out of memory, `make_room()` (idle memory let go) and one more try."""
    with DEVICE_WORK:  # nothing else runs between the two tries
        try:
            return capture(run, inputs, memory)
        except torch.OutOfMemoryError:
            make_room()
            return capture(run, inputs, memory)


def free_cached_memory(device: torch.device) -> None:
    """What no tensor holds any more goes: reference cycles collected and, on CUDA, the allocator's cache emptied."""
    gc.collect()
    if device.type == "cuda":
        empty_cuda_cache()


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
