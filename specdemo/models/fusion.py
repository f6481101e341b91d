"""Fused rounds: the functions a group's programs run (the pass, the rule), compiled with inductor before they are
captured, so a captured round replays a few dozen fused kernels a layer instead of a kernel per aten op.

Inductor compiles without CUDA graphs of its own (models/graphs.py captures what it runs) and for fixed shapes. A
compiled function is kept per model and mode, so a new decoder or a new group of a kept bucket compiles nothing; it
takes its tables as tensors, never a group. Its first call compiles it, timed for the load's progress, and later calls
refuse to recompile: a mode keeps one graph, so the pass and round programs run one compiled pass and a token's logits
keep their bits. A compile that fails leaves the model's functions unfused from then on, with one line in the log
(raised under strict graphs)."""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import threading
import time
import types
import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from specdemo.models import graphs
from specdemo.models.platform import on_zerogpu

# "1" fuses on any device (a test on the CPU), "0" never; unset: where rounds are captured on CUDA, but not on ZeroGPU,
# whose worker would compile inside a call's 10 s set-up allowance (compile times on a GPU are not yet measured)
FUSED_VARIABLE = "SPECDEMO_FUSED_ROUND"

log = logging.getLogger(__name__)


def uses_fusion(device: torch.device) -> bool:
    """Fused programs where CUDA graphs capture them on CUDA (not on ZeroGPU), unless SPECDEMO_FUSED_ROUND says
    otherwise."""
    forced = os.environ.get(FUSED_VARIABLE, "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    return device.type == "cuda" and graphs.uses_graphs(device) and not on_zerogpu()


@dataclass
class _ModelFusion:
    """One model's compiled functions by mode, and what compiling them took."""

    functions: dict[Hashable, Callable[..., Any]] = field(default_factory=dict)
    compiles: list[tuple[Hashable, float]] = field(default_factory=list)  # (mode, seconds) of every compile, in order
    failed: bool = False  # a compile failed: this model's programs run unfused


_models: weakref.WeakKeyDictionary[torch.nn.Module, _ModelFusion] = weakref.WeakKeyDictionary()
_lock = threading.Lock()
_serial = itertools.count()


def _fusion(model: torch.nn.Module) -> _ModelFusion:
    with _lock:
        return _models.setdefault(model, _ModelFusion())


def fused(model: torch.nn.Module, mode: Hashable, function: Callable[..., Any]) -> Callable[..., Any] | None:
    """`function` (a plain function, or a partial of one over constants) compiled for `model` and `mode`, made at the
    mode's first use; None where fusion is off for the model's device or a compile of the model's failed. The compiled
    function is the first use's: later callers pass the same function for the same mode."""
    if not uses_fusion(next(model.parameters()).device):
        return None
    fusion = _fusion(model)
    if fusion.failed:
        return None
    found = fusion.functions.get(mode)
    if found is None:
        found = fusion.functions[mode] = _Compiled(model, mode, function)
    return found


def compile_seconds(model: torch.nn.Module) -> float:
    """Seconds spent compiling the model's fused functions (each compiled once for the process)."""
    return sum(seconds for _, seconds in compiles(model))


def compiles(model: torch.nn.Module) -> list[tuple[Hashable, float]]:
    """(mode, seconds) of each of the model's compiles, in order."""
    return list(_fusion(model).compiles)


class _Compiled:
    """A compiled function whose first call compiles it, timed; later calls refuse to recompile, so a mode keeps one
    graph. A compile, or a recompile, that fails leaves the model's functions unfused from then on. Under a torch
    function or dispatch mode (a test's counters, a CPU's capture checks), where dynamo runs no compiled code, the
    function runs as written."""

    def __init__(self, model: torch.nn.Module, mode: Hashable, function: Callable[..., Any]) -> None:
        self.model, self.mode, self.function = weakref.ref(model), mode, function
        self.compiled = torch.compile(_own_code(function), backend="inductor", dynamic=False, fullgraph=True)
        self.ready = False

    def __call__(self, *args: Any) -> Any:
        model = self.model()
        assert model is not None, "a kept program outlived its model"
        fusion = _fusion(model)
        if _watched() or fusion.failed:
            return self.function(*args)
        started = time.perf_counter()
        try:
            with torch.compiler.set_stance("fail_on_recompile") if self.ready else contextlib.nullcontext():
                results = self.compiled(*args)
        except torch.OutOfMemoryError:
            raise
        except Exception as error:  # dynamo and inductor raise many kinds; each leaves the model unfused
            if graphs.strict_graphs():
                graphs.capture_failed(("fuse", self.mode), error, "a fused round")  # raises CaptureFailed
            log.warning("specdemo: rounds run unfused: compiling %r failed (%s)", self.mode, error)
            fusion.failed = True
            return self.function(*args)
        if not self.ready:
            fusion.compiles.append((self.mode, time.perf_counter() - started))
            log.info("specdemo: compiled %r in %.1f s", self.mode, fusion.compiles[-1][1])
            self.ready = True
        return results


def _watched() -> bool:
    """A torch function or dispatch mode sees each op."""
    return bool(_get_current_function_mode_stack()) or is_in_torch_dispatch_mode(include_infra_modes=False)


def _own_code(function: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of `function` (a partial: a function that calls it) with a code object of its own: dynamo keeps compiled
    graphs, their guards and its recompile limit per code object, so each mode's stay apart from the others' and from
    other models'."""
    name = f"fused_{getattr(function, 'func', function).__name__}_{next(_serial)}"
    if isinstance(function, functools.partial):
        assert not function.keywords, f"bind constants by position, not {function.keywords!r}"
        inner, constants = function.func, function.args

        def function(*args: Any) -> Any:
            return inner(*constants, *args)

    assert isinstance(function, types.FunctionType), f"fuse a function or a partial of one, not {function!r}"
    code = function.__code__.replace(co_name=name)
    return types.FunctionType(code, function.__globals__, code.co_name, function.__defaults__, function.__closure__)
