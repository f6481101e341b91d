"""Tree attention's products keep a row's bits (models/attention.py): the row counts `attention_rows` measures on this
machine hold on fresh inputs, widths and batches, a pass pads its stacked query rows to one of them, and the values
weighed in steps of 64 slots give a row its bits at any wider width."""

from __future__ import annotations

import pytest
import torch

from specdemo.models import attention
from specdemo.models.tree_cache import RowRequest, TreeCachedModel
from tests.helpers import tiny_model


@pytest.mark.parametrize(
    ("kv_heads", "size", "dtype"),
    [(3, 64, torch.float32), (1, 64, torch.float32), (3, 64, torch.float64)],
    ids=["float32, 3 key heads", "float32, 1 key head", "float64"],
)
def test_attention_rows_keep_every_row_its_bits_on_fresh_inputs(kv_heads, size, dtype):
    """Every allowed count through 60 rows (at least `fewest`, a multiple of `step`) gives each row of a product of 120
    the bits it gets there, at widths and batch sizes the check did not use. Planted: (1, 1) answered (here one row
    sums in another order), and a step of 1 where 4 is needed (float64, 5 rows)."""
    fewest, step = attention.attention_rows("cpu", kv_heads, size, dtype)
    assert 1 <= fewest <= attention.MAX_ATTENTION_ROWS and step in (1, 2, 4, 8)
    generator = torch.Generator().manual_seed(11)
    for width in (128, 448):
        queries = torch.randn(3, kv_heads, 120, size, generator=generator).to(dtype)
        keys = torch.randn(3, kv_heads, width, size, generator=generator).to(dtype).transpose(2, 3)
        together = torch.matmul(queries, keys)
        for rows in range(fewest, 61):
            if rows % step:
                continue
            for start in range(0, 120 - rows + 1, rows):
                for batch in (1, 3):
                    part = torch.matmul(queries[:batch, :, start : start + rows], keys[:batch])
                    assert torch.equal(part, together[:batch, :, start : start + rows]), (width, rows, start, batch)


def test_a_pass_pads_its_query_rows_to_an_allowed_count(monkeypatch):
    """A one-token pass of a model with three query heads per key head stacks three rows; each product gets at least
    `fewest`, and a multiple of `step`, rows. Planted: the step ignored (5 rows)."""
    seen: list[int] = []
    attend = attention._attend

    def counted(query, *args):
        seen.append(query.shape[2])
        return attend(query, *args)

    monkeypatch.setattr(attention, "_attend", counted)
    attention.attention_rows.cache_clear()
    monkeypatch.setattr(attention, "attention_rows", lambda *shape: (4, 4))
    model = tiny_model(3)
    groups = model.config.num_attention_heads // model.config.num_key_value_heads
    TreeCachedModel(model).logits({0: RowRequest([2, 3, 4, 5, 6], [], "all")})
    assert set(seen) == {-(-5 * groups // 4) * 4}
    seen.clear()
    monkeypatch.setattr(attention, "attention_rows", lambda *shape: (6, 1))
    TreeCachedModel(model).logits({0: RowRequest([2], [], "all")})
    assert set(seen) == {max(6, groups)}


def test_values_weighed_in_steps_give_a_row_its_bits_at_any_wider_width():
    """A row's weights over its slots, padded with exact zeros to a wider pass (rows beside it, drafts it verifies),
    give the same bits, at every width from 64 to 1,024 slots. Planted: one product over all slots (on an AMD EPYC
    widths of 192 to 320 slots sum otherwise)."""
    generator = torch.Generator().manual_seed(5)
    for own in range(64, 1024, 64):
        weights = torch.softmax(torch.randn(1, 3, 4, own, generator=generator), dim=-1)
        values = torch.randn(1, 3, 1024, 64, generator=generator)
        alone = attention._weigh_in_steps(weights, values[:, :, :own])
        for wider in range(own + 64, 1025, 64):
            padded = torch.cat([weights, weights.new_zeros(1, 3, 4, wider - own)], dim=-1)
            assert torch.equal(attention._weigh_in_steps(padded, values[:, :, :wider]), alone), (own, wider)
