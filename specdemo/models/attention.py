"""Attention whose output for a row depends only on that row: the engine's passes are batch-invariant.

A row's keys sit at the same slots in any batch (models/layout.py), so what remains is arithmetic that takes another
path with the shape of the pass. On the CPUs here (bfloat16; docs/serving.md has the measurements):
- a matrix product of a few rows can take another kernel than of many (a bfloat16 linear of a wide input at one row,
  a float32 product below three or four rows, and on some CPUs a remainder past a multiple of four);
- the flash kernel behind scaled_dot_product_attention splits its work by the numbers of queries and keys, and
  transformers sends a single query down another path again;
- a softmax over fewer than 16 keys takes a scalar path, over more a vector one;
- a product's sum over the key slots can take another order with their number (on an AMD EPYC, 192 to 320 slots).
So a tree pass attends as transformers' eager attention does, in float32 (the cache holds a bfloat16 model's keys and
values in float32: its products cost a fraction of bfloat16's here), with the query heads of one key head stacked into
the rows of one product, padded to a count whose products keep a row's bits on this machine (`attention_rows`), over a
width that is a multiple of WIDTH_STEP (the masked slots past a row's keys add exact zeros), the values weighed
WIDTH_STEP slots at a time. The linears keep their rows' bits in models/packed.py, or with every pass at least
MIN_GEMM_ROWS rows where a bfloat16 model is not packed. Any other call (generate, a plain forward) goes to
transformers' sdpa attention, with its masks."""

# B = rows, H = query heads, Hkv = key-value heads, G = H / Hkv, n = queries, S = key slots, d = head size

from __future__ import annotations

import functools
import itertools
import logging
import threading

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from specdemo.models.layout import WIDTH_STEP

log = logging.getLogger(__name__)
NAME = "specdemo-tree"  # the attention implementation a TreeCachedModel's model runs with
MIN_GEMM_ROWS = {torch.bfloat16: 2, torch.float16: 2}  # a linear's fewer rows take another kernel; stock float32
# linears would need 4, and a four-token float32 pass costs 1.45 one-token steps on a Xeon (bench --pass-costs), so
# they are not padded (models/packed.py pads packed linears one by one, only where their shape needs it)
ATTENTION_ROWS = 3  # the fewest stacked rows of a pass that names none (a fixed-shape pass, models/fixed_pass.py)
MAX_ATTENTION_ROWS = 8  # the most rows attention_rows answers
CHECK_WIDTHS = (64, 320)  # key slots the attention's products are checked over
_last_mask = threading.local()  # per thread: the mask _blocked last prepared, and what it made
QUERY_CHUNK = 512  # stacked query rows attended at once, so a long prompt's scores stay tens of megabytes


def min_gemm_rows(dtype: torch.dtype) -> int:
    return MIN_GEMM_ROWS.get(dtype, 1)


def use_tree_attention(model: PreTrainedModel) -> None:
    """Let the model attend with tree_attention when a pass asks for it (tree_pass=True), and with sdpa otherwise."""
    model.config._attn_implementation = NAME


def tree_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H, n, d]
    key: torch.Tensor,  # [B, Hkv, S, d]
    value: torch.Tensor,  # [B, Hkv, S, d]
    attention_mask: torch.Tensor | None,  # [B, 1, n, S] bool: True where a query may attend
    scaling: float,
    dropout: float = 0.0,
    tree_pass: bool = False,
    query_rows: tuple[int, int] | None = None,  # a tree pass's (TreeCachedModel's): attention_rows for its shapes
    **kwargs: object,
) -> tuple[torch.Tensor, None]:  # [B, n, H, d]
    if not tree_pass:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    batch, heads, num_queries, size = query.shape
    groups = heads // key.shape[1]
    stacked = query.reshape(batch, key.shape[1], groups * num_queries, size)  # [B, Hkv, G*n, d]: heads as rows
    fewest, step = query_rows or (ATTENTION_ROWS, 1)
    rows = max(-(-groups * num_queries // step) * step, fewest)
    if rows > groups * num_queries:  # repeat the last query up to a count whose products keep a row's bits
        stacked = torch.cat([stacked, stacked[:, :, -1:].expand(-1, -1, rows - groups * num_queries, -1)], dim=2)
    blocked = _blocked(attention_mask, groups, rows)
    softcap = kwargs.get("softcap")
    parts = [
        _attend(stacked[:, :, chunk], key, value, blocked[:, :, chunk], scaling, softcap, query_rows is not None)
        for chunk in _chunks(rows, fewest)
    ]
    output = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))[:, :, : groups * num_queries].to(query.dtype)
    return output.reshape(batch, heads, num_queries, size).transpose(1, 2).contiguous(), None


def _attend(
    query: torch.Tensor,  # [B, Hkv, r, d]
    key: torch.Tensor,  # [B, Hkv, S, d]
    value: torch.Tensor,  # [B, Hkv, S, d]
    blocked: torch.Tensor,  # [B, 1, r, S] True where a query may not attend
    scaling: float,
    softcap: object,
    in_steps: bool,
) -> torch.Tensor:  # [B, Hkv, r, d]
    """The eager attention of transformers' models, its products in the cache's format: float32 (float64 for a float64
    model), where a bfloat16 product of a few rows costs several float32 ones on the CPU (docs/serving.md); the values
    weighed in_steps of WIDTH_STEP slots (`_weigh_in_steps`) in a tree pass."""
    scores = torch.matmul(query.to(key.dtype), key.transpose(2, 3)).mul_(scaling)  # [B, Hkv, r, S]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores.masked_fill_(blocked, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1)
    return _weigh_in_steps(weights, value) if in_steps else torch.matmul(weights, value)


def _weigh_in_steps(
    weights: torch.Tensor,  # [B, Hkv, r, S]
    value: torch.Tensor,  # [B, Hkv, S, d]
) -> torch.Tensor:  # [B, Hkv, r, d]
    """weights @ value, summed over the slots WIDTH_STEP at a time, in order. One product over all S slots sums them
    in an order that can depend on S (an AMD EPYC's float32 kernel does between 192 and 320 slots), and a row's S is
    the widest row's of its pass, or grows with the drafts it verifies. Here each step's product sums 64 slots, and
    the steps past a row's keys weigh exact zeros, which leave the running sum as it was."""
    steps = weights.shape[-1] // WIDTH_STEP
    parts = torch.matmul(  # [B, Hkv, steps, r, d]
        weights.unflatten(3, (steps, WIDTH_STEP)).transpose(2, 3), value.unflatten(2, (steps, WIDTH_STEP))
    )
    return parts.cumsum(dim=2)[:, :, -1]  # a cumulative sum adds the steps one after another


def query_rows_for(model: PreTrainedModel, dtype: torch.dtype) -> tuple[int, int]:
    """attention_rows for the model's attention on its device, `dtype` the cache's; ATTENTION_ROWS on the meta device
    (a memory estimate's pass, which computes nothing)."""
    config = model.config.get_text_config()
    if model.device.type == "meta":
        return ATTENTION_ROWS, 1
    size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return attention_rows(model.device.type, kv_heads, size, dtype)


@functools.cache
def attention_rows(device_type: str, kv_heads: int, size: int, dtype: torch.dtype) -> tuple[int, int]:
    """(fewest, step): attention's products ([B, Hkv, r, d] queries against keys, weights against values, in `dtype`)
    give every row the bits it gets among 128, in a batch of one row or two, wherever r is at least `fewest` (at most
    MAX_ATTENTION_ROWS) and a multiple of `step` (1, 2, 4 or 8, the smallest that allows one). Checked once per shape
    on this machine, on windows of each count through 128 rows, over CHECK_WIDTHS key slots: float32 products of three
    key heads need three rows on an Intel Xeon and four on an AMD EPYC, of one key head there a multiple of four, and
    float64 products a multiple of four; fewer rows, or a remainder past the last four, sum in another order."""
    generator = torch.Generator(device="cpu").manual_seed(0)

    def random(*shape: int) -> torch.Tensor:
        return torch.randn(2, kv_heads, *shape, generator=generator, device=generator.device).to(device_type, dtype)

    def keeps(rows: int, left: torch.Tensor, right: torch.Tensor, together: torch.Tensor) -> bool:
        return all(
            torch.equal(
                torch.matmul(left[:batch, :, start : start + rows], right[:batch]),
                together[:batch, :, start : start + rows],
            )
            for start in range(0, left.shape[2] - rows + 1, rows)
            for batch in (1, 2)
        )

    counts = (*range(1, 3 * MAX_ATTENTION_ROWS + 1), 51, 52)
    kept = dict.fromkeys(counts, True)
    for width in CHECK_WIDTHS:
        queries, weights, values = random(128, size), random(128, width), random(width, size)
        keys = random(width, size).transpose(2, 3)  # as the cache holds them
        scores, outputs = torch.matmul(queries, keys), torch.matmul(weights, values)
        for rows in counts:
            kept[rows] &= keeps(rows, queries, keys, scores) and keeps(rows, weights, values, outputs)
    for step in (1, 2, 4, MAX_ATTENTION_ROWS):
        for fewest in range(step, MAX_ATTENTION_ROWS + 1, step):
            if all(kept[rows] for rows in counts if rows >= fewest and rows % step == 0):
                return fewest, step
    log.warning("Attention products of %d rows sum in another order here than among more.", MAX_ATTENTION_ROWS)
    return MAX_ATTENTION_ROWS, MAX_ATTENTION_ROWS


def _blocked(mask: torch.Tensor, groups: int, rows: int) -> torch.Tensor:  # [B, 1, n, S] -> [B, 1, rows, S]
    """Where the stacked rows may not attend: the mask repeated per query head (the last row repeated up to `rows`),
    inverted. Made once a pass: every layer gets the same mask, and the last one made is kept for the next."""
    if getattr(_last_mask, "mask", None) is mask and _last_mask.shape == (groups, rows):
        return _last_mask.blocked
    batch, _, num_queries, _ = mask.shape
    allowed = mask.expand(batch, groups, num_queries, -1).reshape(batch, 1, groups * num_queries, -1)
    if rows > groups * num_queries:
        allowed = torch.cat([allowed, allowed[:, :, -1:].expand(-1, -1, rows - groups * num_queries, -1)], dim=2)
    blocked = ~allowed
    _last_mask.mask, _last_mask.shape, _last_mask.blocked = mask, (groups, rows), blocked
    return blocked


def _chunks(rows: int, min_rows: int) -> list[slice]:
    """Slices of at most QUERY_CHUNK rows and at least min_rows each (a short last chunk joins the one before)."""
    bounds = [*range(0, rows, QUERY_CHUNK), rows]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] < min_rows:
        bounds.pop(-2)
    return [slice(start, end) for start, end in itertools.pairwise(bounds)]


AttentionInterface.register(NAME, tree_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)  # what transformers builds for the other calls
