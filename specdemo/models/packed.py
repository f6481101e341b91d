"""Pre-packed linears for the CPU's tree passes: oneDNN's inner product on weights reordered once, at the first tree
pass of a model; bfloat16 models always, float32 models where the packed products are faster on this machine.

A plain bfloat16 product of one row can take another kernel than of two or more, so tree passes were padded to two
rows (models/attention.py's MIN_GEMM_ROWS), which cost a one-token step about a quarter of its time: every layer ran
twice the tokens. Packed, each linear pads alone, and only where its shape needs it: `rows_needed` finds, per weight
shape on this machine, the fewest rows from which a row's bits do not depend on the product's other rows (one for
most of SmolLM2's linears, two for its MLP's down projection, whose 1,536 inputs are summed in another order for a
single row). Siblings that read one input (an attention's query, key and value projections; an MLP's gate and up
projections) are packed together and multiplied once. A one-row packed product also runs faster than a plain one
(docs/serving.md has the measurements).

In float32 the stock linear is MKL's, whose speed depends on the CPU: on an Intel Xeon it streamed a one-row product's
weights faster than oneDNN's packed kernel, on an AMD EPYC at half the packed kernel's speed. So a float32 model is
packed where `float32_packing_pays` measures the packed products faster here, once per process, on weights of
SmolLM2's shape; its one-row steps then keep their rows' bits too. SPECDEMO_PACKED_FLOAT32=1 packs float32 models
without measuring, =0 never packs them.

Only tree passes use the packed copy (TreeCachedModel runs them in `tree_passes`); any other call, Hugging Face
`generate` included, runs the stock linear on the stock weights. The copy doubles the linears' memory, so a model
whose copy would not fit is left unpacked, padded as before, and so is one with a shape no row count keeps.
SPECDEMO_PACKED_LINEARS=0 never packs."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator

import psutil
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from specdemo.models.attention import min_gemm_rows

VARIABLE = "SPECDEMO_PACKED_LINEARS"
FLOAT32_VARIABLE = "SPECDEMO_PACKED_FLOAT32"  # "1" packs float32 models, "0" never; unset: where it pays here
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # siblings that read the same input: one product
MAX_ROWS = 4  # the most rows a product is padded to
CHECK_ROWS = 128  # rows of random input each packed shape is checked on
CHECK_ELEMENTS = 2**22  # outputs compared per window count, at most (a 49,152-wide head: 85 rows)
MEMORY_SHARE = 0.5  # pack only when the copy takes at most this share of the memory free now
PAYS = 1.2  # packed float32 products of one row must take at most 1 / PAYS of the stock ones' time, and of 17 rows less
TIMING_SHAPE = (3072, 576)  # the weights timed: SmolLM2's gate and up projections, packed together
TIMING_COPIES = 16  # 113 MB of float32 weights, more than a CPU's caches hold, streamed as a pass streams its own
TIMING_REPEATS = 5  # interleaved; the fastest of each counts (another process can only add time)

log = logging.getLogger(__name__)
_in_tree_pass = contextvars.ContextVar("specdemo_tree_pass", default=False)
_groups: weakref.WeakKeyDictionary[PreTrainedModel, list[PackedGroup]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


class PackedGroup:
    """Sibling linears' weights, concatenated and packed: one product for all of them on an input they share, kept
    until the pass ends so that each sibling takes its columns of it."""

    def __init__(self, linears: list[torch.nn.Linear], min_rows: int) -> None:
        self.packed = _pack(torch.cat([linear.weight.detach() for linear in linears]))
        biases = [linear.bias for linear in linears]
        self.bias = None if biases[0] is None else torch.cat([bias.detach() for bias in biases])
        self.min_rows = min_rows
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None

    def product(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., sum of the siblings' out]
        if x is not self._input:
            self._input, self._output = x, self._multiply(x)
        return self._output

    def forget(self) -> None:
        self._input = self._output = None

    def _multiply(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[:-1].numel()
        if rows >= self.min_rows:
            return _packed_product(x, self.packed, self.bias)
        flat = x.reshape(rows, x.shape[-1])  # fewer rows take another kernel for this shape: repeat the last
        padded = torch.cat([flat, flat[-1:].expand(self.min_rows - rows, -1)])
        product = _packed_product(padded, self.packed, self.bias)
        return product[:rows].reshape(*x.shape[:-1], product.shape[-1])


class PackedLinear(torch.nn.Linear):
    """The stock linear outside tree passes; inside one, its columns of its group's packed product."""

    group: PackedGroup
    columns: slice

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if not _in_tree_pass.get():
            return F.linear(x, self.weight, self.bias)
        return self.group.product(x)[..., self.columns]


@contextlib.contextmanager
def tree_passes(model: PreTrainedModel) -> Iterator[None]:
    """The model's packed linears, where it has them, for what this thread runs inside (a tree pass)."""
    token = _in_tree_pass.set(True)
    try:
        yield
    finally:
        _in_tree_pass.reset(token)
        for group in _groups.get(model, ()):
            group.forget()


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def _packed_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@functools.cache
def rows_needed(out_features: int, in_features: int, dtype: torch.dtype = torch.bfloat16) -> int | None:
    """The fewest rows (1 to MAX_ROWS) from which packed products of this shape and format give every row the bits it
    gets among 128, on this machine; None where no count up to MAX_ROWS does, or oneDNN cannot pack here. Checked on
    every window of each count through 128 random rows: a product of one row of a wide input (in_features above about
    a thousand) sums in another order, which shows in a few outputs of a few rows only."""
    try:
        generator = torch.Generator(device="cpu").manual_seed(0)
        weight = torch.randn(out_features, in_features, generator=generator, device=generator.device) * 0.05
        x = torch.randn(CHECK_ROWS, in_features, generator=generator, device=generator.device).to(dtype)
        weight = weight.to(dtype)
        packed = _pack(weight)
        together = _packed_product(x, packed)
    except (RuntimeError, NotImplementedError):
        return None
    windows = min(CHECK_ROWS, max(8, CHECK_ELEMENTS // out_features))  # fewer rows for a vocabulary-wide head

    def keeps(rows: int) -> bool:
        return all(
            torch.equal(_packed_product(x[start : start + rows], packed), together[start : start + rows])
            for start in range(0, windows - rows + 1, rows)
        )

    kept = {rows: keeps(rows) for rows in (*range(1, MAX_ROWS + 1), 5, 8, 17)}
    return next((fewest for fewest in kept if all(v for rows, v in kept.items() if rows >= fewest)), None)


def _sibling_groups(model: PreTrainedModel) -> list[list[torch.nn.Linear]]:
    """Every linear of the model, in groups of siblings that read one input (GROUPS), each other one alone."""
    grouped: list[list[torch.nn.Linear]] = []
    for module in model.modules():
        children = {name: child for name, child in module.named_children() if type(child) is torch.nn.Linear}
        for names in GROUPS:
            siblings = [children.get(name) for name in names]
            if all(siblings) and len({(s.in_features, s.bias is None) for s in siblings}) == 1:
                grouped.append(siblings)
    taken = {id(linear) for group in grouped for linear in group}
    alone = [[m] for m in model.modules() if type(m) is torch.nn.Linear and id(m) not in taken]
    return grouped + alone


def pack(model: PreTrainedModel) -> bool:
    """Pack a CPU model's linears for its tree passes, siblings together, once (later calls answer what the first
    did): a bfloat16 model's, and a float32 model's where that pays here (`packs_float32`). False: left as it is
    (another device or format, SPECDEMO_PACKED_LINEARS=0, a machine where packed products of some shape keep no row's
    bits, or too little memory free for the copy)."""
    with _lock:
        if model in _groups:
            return bool(_groups[model])
        _groups[model] = []
        if model.device.type != "cpu" or os.environ.get(VARIABLE) == "0":
            return False
        if not (model.dtype == torch.bfloat16 or (model.dtype == torch.float32 and packs_float32())):
            return False
        groups = _sibling_groups(model)
        shapes = [(sum(linear.out_features for linear in group), group[0].in_features) for group in groups]
        needed = [rows_needed(*shape, model.dtype) for shape in shapes]
        if None in needed:
            log.info("Linears left unpacked: packed %s products here do not keep a row's bits.", model.dtype)
            return False
        copy_bytes = sum(out * in_ * model.dtype.itemsize for out, in_ in shapes)
        if copy_bytes > MEMORY_SHARE * psutil.virtual_memory().available:
            log.info("Linears left unpacked: their packed copy (%.1f GB) would not fit.", copy_bytes / 2**30)
            return False
        for linears, min_rows in zip(groups, needed, strict=True):
            group, start = PackedGroup(linears, min_rows), 0
            for linear in linears:
                linear.group, linear.columns = group, slice(start, start + linear.out_features)
                linear.__class__ = PackedLinear
                start += linear.out_features
            _groups[model].append(group)
        return True


def packs_float32() -> bool:
    """Whether float32 models are packed: as SPECDEMO_PACKED_FLOAT32 says, else where it pays on this machine."""
    forced = os.environ.get(FLOAT32_VARIABLE, "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    return float32_packing_pays()


@functools.cache
def float32_packing_pays() -> bool:
    """Whether oneDNN's products on packed float32 weights beat the stock linear's here: at one row (a token's step)
    by PAYS, and at 17 rows (a verify pass) at all, each the fastest of TIMING_REPEATS interleaved sweeps over
    TIMING_COPIES weights of TIMING_SHAPE. Measured once per process, and logged."""
    try:
        seconds = float32_product_seconds()
    except (RuntimeError, NotImplementedError):  # oneDNN cannot pack float32 here
        return False
    pays = seconds[1][1] * PAYS <= seconds[1][0] and seconds[17][1] < seconds[17][0]
    log.info(
        "Float32 linears %s for tree passes: one row %.1f ms packed against %.1f ms stock, 17 rows %.1f against %.1f "
        "(%d weights of %d x %d).",
        "packed" if pays else "left unpacked",
        *(1e3 * value for rows in (1, 17) for value in reversed(seconds[rows])),
        TIMING_COPIES,
        *TIMING_SHAPE,
    )
    return pays


def float32_product_seconds() -> dict[int, tuple[float, float]]:
    """Rows -> (stock, packed) seconds of float32 products over TIMING_COPIES weights of TIMING_SHAPE, at 1 and 17
    rows: the fastest of TIMING_REPEATS interleaved sweeps each."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    weights = [torch.randn(*TIMING_SHAPE, generator=generator, device=generator.device) for _ in range(TIMING_COPIES)]
    packed = [_pack(weight) for weight in weights]
    sweeps = (
        lambda x: [F.linear(x, weight) for weight in weights],
        lambda x: [_packed_product(x, weight) for weight in packed],
    )
    seconds: dict[int, tuple[float, float]] = {}
    for rows in (1, 17):
        x = torch.randn(rows, TIMING_SHAPE[1], generator=generator, device=generator.device)
        fastest = [float("inf"), float("inf")]
        for repeat in range(TIMING_REPEATS + 1):
            for index, sweep in enumerate(sweeps):
                started = time.perf_counter()
                sweep(x)
                if repeat:  # the first sweep of each warms its kernel
                    fastest[index] = min(fastest[index], time.perf_counter() - started)
        seconds[rows] = (fastest[0], fastest[1])
    return seconds


def is_packed(model: PreTrainedModel) -> bool:
    """Whether the model's tree passes multiply on packed weights."""
    return bool(_groups.get(model))


def gemm_rows(model: PreTrainedModel) -> int:
    """The fewest rows a tree pass's linears may multiply at once and keep a row's bits: 1 where they are packed."""
    return 1 if is_packed(model) else min_gemm_rows(model.dtype)
