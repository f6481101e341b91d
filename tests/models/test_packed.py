"""Packed linears (models/packed.py): tree passes multiply siblings once on packed weights, padded only where a shape
needs it, in bfloat16 and in float32; every other call runs the stock linears; a model is left unpacked, padded as
before, where packing would not keep a row's bits or would not fit; and float32 models are packed where the packed
products are measured faster. The bit-for-bit batch tests (engine/test_batch.py) run the packed passes on the
offline model in both formats."""

from __future__ import annotations

import pytest
import torch

from specdemo.models import packed
from specdemo.models.tree_cache import RowRequest, TreeCachedModel
from tests.helpers import tiny_model

FORMATS = [torch.bfloat16, torch.float32]
packing_formats = pytest.mark.parametrize(
    "dtype",
    [
        pytest.param(
            dtype,
            marks=pytest.mark.skipif(packed.rows_needed(64, 32, dtype) is None, reason=f"oneDNN cannot pack {dtype}"),
            id=str(dtype).removeprefix("torch."),
        )
        for dtype in FORMATS
    ],
)


def bfloat16_model(seed: int = 3) -> torch.nn.Module:
    return tiny_model(seed).to(torch.bfloat16)


@pytest.fixture
def packs_float32(monkeypatch) -> None:
    monkeypatch.setenv(packed.FLOAT32_VARIABLE, "1")


def count_products(monkeypatch) -> list[int]:
    """The rows of every packed product, as oneDNN multiplies them."""
    seen: list[int] = []
    product = packed._packed_product

    def counted(x, weight, bias=None):
        seen.append(x.shape[:-1].numel())
        return product(x, weight, bias)

    monkeypatch.setattr(packed, "_packed_product", counted)
    return seen


@packing_formats
def test_tree_passes_multiply_each_group_once_and_other_calls_run_the_stock_linears(monkeypatch, packs_float32, dtype):
    """Planted: PackedLinear using its group outside tree passes (generate would run our kernels, and the peer would
    not be Hugging Face's); a group multiplied again for each sibling."""
    model = tiny_model(3).to(dtype)
    reference = tiny_model(3).to(dtype)
    products = count_products(monkeypatch)
    cached = TreeCachedModel(model)
    products.clear()  # those that checked each shape's rows
    assert packed.gemm_rows(model) == 1
    assert {type(m).__name__ for m in model.modules() if isinstance(m, torch.nn.Linear)} == {"PackedLinear"}
    cached.logits({0: RowRequest([2, 3, 4], [], "all")})
    layers = model.config.num_hidden_layers
    assert len(products) == 4 * layers + 1  # q, k and v as one; o; gate and up as one; down; and the LM head
    assert set(products[:-1]) == {3} and products[-1] == 1  # the prompt's three tokens; its last token's logits
    products.clear()
    ids = torch.tensor([[2, 3, 4, 5]])
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, reference(ids).logits)
        assert torch.equal(
            model.generate(ids, max_new_tokens=3, do_sample=False),
            reference.generate(ids, max_new_tokens=3, do_sample=False),
        )
    assert products == []


@packing_formats
def test_a_shape_that_needs_more_rows_is_padded_alone(monkeypatch, packs_float32, dtype):
    """Each group pads to its own shape's fewest rows, and a one-token pass then has one row elsewhere. Planted: the
    padding dropped, after which the down projection multiplies one row."""
    monkeypatch.setattr(packed, "rows_needed", lambda out_features, in_features, dtype: 2 if in_features == 64 else 1)
    model = tiny_model(3).to(dtype)
    products = count_products(monkeypatch)
    cached = TreeCachedModel(model)
    products.clear()
    cached.logits({0: RowRequest([2], [], "all")})
    padded = {group.min_rows for group in packed._groups[model]}
    assert padded == {1, 2}
    assert products.count(2) == model.config.num_hidden_layers and set(products) == {1, 2}


def test_a_model_is_left_unpacked_where_packing_would_not_keep_its_rows_or_fit_or_is_turned_off(monkeypatch):
    """Left as it was, its passes padded to MIN_GEMM_ROWS: where some shape keeps no row's bits, where the copy would
    not fit, with SPECDEMO_PACKED_LINEARS=0; and a float32 model with SPECDEMO_PACKED_FLOAT32=0 (the tests' setting).
    Planted: packing regardless."""
    monkeypatch.setattr(packed, "rows_needed", lambda out_features, in_features, dtype: None)
    assert not packed.pack(first := bfloat16_model())
    assert packed.gemm_rows(first) == 2
    monkeypatch.undo()
    monkeypatch.setattr(packed.psutil, "virtual_memory", lambda: type("Memory", (), {"available": 1000})())
    assert not packed.pack(bfloat16_model())
    monkeypatch.undo()
    monkeypatch.setenv(packed.VARIABLE, "0")
    assert not packed.pack(bfloat16_model())
    monkeypatch.delenv(packed.VARIABLE)
    assert not packed.pack(float32 := tiny_model(3).to(torch.float32))
    assert packed.gemm_rows(float32) == 1
    assert all(type(m) is torch.nn.Linear for m in first.modules() if isinstance(m, torch.nn.Linear))


@packing_formats
def test_rows_needed_finds_the_fewest_rows_that_keep_every_row_its_bits(dtype):
    """What rows_needed answers holds on fresh inputs: a product of that many rows, or more, gives each row the bits it
    gets among 128 (one to four rows of each shape of SmolLM2, through 17 rows)."""
    generator = torch.Generator().manual_seed(7)
    for out_features, in_features in ((576, 576), (960, 576), (3072, 576), (576, 1536)):
        fewest = packed.rows_needed(out_features, in_features, dtype)
        assert fewest is not None and 1 <= fewest <= packed.MAX_ROWS
        weight = (torch.randn(out_features, in_features, generator=generator) * 0.05).to(dtype)
        group = packed.PackedGroup([torch.nn.Linear(in_features, out_features, bias=False)], fewest)
        group.packed = packed._pack(weight)
        x = torch.randn(128, in_features, generator=generator).to(dtype)
        together = group._multiply(x)
        for rows in range(1, 18):
            for start in range(0, 128 - rows, rows):
                assert torch.equal(group._multiply(x[start : start + rows]), together[start : start + rows]), (
                    out_features,
                    in_features,
                    rows,
                )


@pytest.mark.parametrize(
    ("seconds", "pays"),
    [
        ({1: (10.0, 5.0), 17: (14.0, 7.0)}, True),  # twice as fast at both (an AMD EPYC: 9.6 against 4.6 ms)
        ({1: (10.0, 9.0), 17: (14.0, 7.0)}, False),  # one row only a tenth faster: short of PAYS
        ({1: (10.0, 5.0), 17: (7.0, 14.0)}, False),  # a verify pass twice as slow
        ({1: (5.0, 9.0), 17: (7.0, 12.0)}, False),  # slower at both (an Intel Xeon's MKL)
    ],
)
def test_float32_models_are_packed_where_the_packed_products_are_measured_faster(monkeypatch, seconds, pays):
    """Unset, SPECDEMO_PACKED_FLOAT32 leaves it to the measurement: packed where one row is PAYS times as fast and 17
    rows faster at all, measured once; =1 and =0 decide without measuring. Planted: the 17-row condition dropped (the
    third case fails); one row's bar without PAYS (the second)."""
    measured: list[int] = []

    def product_seconds() -> dict[int, tuple[float, float]]:
        measured.append(1)
        return seconds

    monkeypatch.setattr(packed, "float32_product_seconds", product_seconds)
    packed.float32_packing_pays.cache_clear()
    monkeypatch.delenv(packed.FLOAT32_VARIABLE)
    try:
        assert packed.packs_float32() is pays
        assert packed.pack(model := tiny_model(3).to(torch.float32)) is (
            pays and packed.rows_needed(64, 32, torch.float32) is not None
        )
        assert packed.gemm_rows(model) == 1
        assert packed.packs_float32() is pays and measured == [1]
        for forced in ("0", "1"):
            monkeypatch.setenv(packed.FLOAT32_VARIABLE, forced)
            assert packed.packs_float32() is (forced == "1") and measured == [1]
    finally:
        packed.float32_packing_pays.cache_clear()
