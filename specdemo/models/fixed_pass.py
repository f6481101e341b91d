"""A group's fixed-shape pass and round as a program runs them, and the host's side of a round: the input buffer's
layout, how a row's inputs are written into it, and the round's one wait (models/fixed_shape.py drives them)."""

# R = PASS_ROWS chains per pass, n = PASS_COLUMNS tokens per chain, L = a group's slots, V = vocab_size,
# H = hidden size, Hkv = key-value heads, d = head size, K = drafted tokens, m = tokens read

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedModel

from specdemo.config import MAX_NUM_DRAFT_TOKENS, SamplingConfig
from specdemo.core.chain_round import decide_chains
from specdemo.core.fixed_rule import RowSettings
from specdemo.core.verify import select_positions
from specdemo.models import graphs
from specdemo.models.layout import HOLE
from specdemo.models.pools import PASS_ROWS, Group

PASS_COLUMNS = MAX_NUM_DRAFT_TOKENS + 1  # n: a chain is the sequence's last token and up to K drafted ones

# The columns of a round's input buffer [R, INPUT_COLUMNS] float64: ids, positions, write slots and real (n each),
# then one column each for these
ROW_COLUMNS = ("drafted", "row_real", "seed", "draws", "greedy", "temperature", "top_k", "top_p_drop", "top_p_on",
               "penalty", "sampled_draft")  # fmt: skip
INPUT_COLUMNS = 4 * PASS_COLUMNS + len(ROW_COLUMNS)


@dataclass(frozen=True)
class ChainRequest:
    """What one one-candidate row asks of a round decided on the device (FixedShapeModel.decide)."""

    trunk_ids: list[int]  # the sequence so far
    draft_ids: list[int]  # its candidate (may be empty)
    capacity: int  # the most tokens it will hold
    sampling: SamplingConfig
    seed: int  # its draw stream (< 2**SEED_BITS), and the draws it used before
    draws: int
    draft_probs: torch.Tensor | None  # [K, V] q of a sampled draft; None: deterministic


@dataclass(frozen=True)
class PassRunner:
    """A model's fixed-shape pass, as a program runs it: it holds the model weakly, so kept groups never keep it."""

    model: Callable[[], PreTrainedModel | None]  # a weakref.ref
    layer_kinds: tuple[str, ...]
    sliding_window: int | None
    hidden_layers: tuple[int, ...]

    def run_pass(
        self,
        group: Group,
        *inputs: torch.Tensor | int,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model's pass (self.forward), for a program that holds its model weakly."""
        model = self.model()
        assert model is not None, "a kept program outlived its model"
        return self.forward(model, group, *inputs)

    def forward(
        self,
        model: PreTrainedModel,
        group: Group,
        first: int,  # the group's first row of the pass
        tokens: torch.Tensor,  # [r, m] int64
        positions: torch.Tensor,  # [r, m]
        write_slots: torch.Tensor,  # [r, m]
        real: torch.Tensor,  # [r, m] bool: False for padding
        logits_to_keep: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # [r, logits_to_keep, V], [r, logits_to_keep, L*H] or None
        """Device work alone, with no host clock and no wait, which a CUDA graph can capture."""
        slots = torch.arange(group.slots, device=tokens.device)  # [L]
        behind = positions[..., None] - slots  # [r, m, L]
        masks = {}
        for kind in self.layer_kinds:  # a real column sees its slots 0..position (its canonical prefix); padding slot 0
            window = self.sliding_window if kind == "sliding_attention" else None
            visible = (behind >= 0) & (behind < window) if window is not None else behind >= 0
            masks[kind] = torch.where(real[..., None], visible, slots == 0)[:, None]  # [r, 1, m, L]
        output = model(
            input_ids=tokens,
            position_ids=positions,
            attention_mask=masks if len(masks) > 1 else next(iter(masks.values())),
            past_key_values=_PassCache(group, first, write_slots),
            use_cache=True,
            logits_to_keep=logits_to_keep,
            tree_pass=True,
            output_hidden_states=bool(self.hidden_layers),
        )
        if not self.hidden_layers:
            return output.logits, None
        hidden = torch.cat([output.hidden_states[layer][:, -logits_to_keep:] for layer in self.hidden_layers], -1)
        return output.logits, hidden

    def group_pass(self, group: Group, inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # [R, 4n] float64
        """A whole group's pass from its input buffer: [R, n, V] logits (and [R, n, L*H] hidden states)."""
        ids, positions, slots, real = pass_inputs(inputs)
        logits, hidden = self.run_pass(group, 0, ids.clamp(min=0), positions, slots, real, PASS_COLUMNS)
        return (logits,) if hidden is None else (logits, hidden)

    def group_round(
        self, group: Group, sampled: bool, penalty: bool, inputs: torch.Tensor, *draft_probs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:  # inputs [R, INPUT_COLUMNS] float64, draft_probs [R, K, V] when given
        """A whole group's round: the pass, then core/chain_round.py; [R, P] packed (and [R, L*H] hidden states where
        the next round's logits were read). The group's seen rows follow the emitted tokens when a row has a penalty."""
        ids, positions, slots, real = pass_inputs(inputs)
        column = dict(zip(ROW_COLUMNS, inputs[:, 4 * PASS_COLUMNS :].unbind(1), strict=True))  # each [R]
        settings = RowSettings(
            greedy=column["greedy"].bool(),
            temperature=column["temperature"].float(),
            top_k=column["top_k"].long(),
            top_p_drop=column["top_p_drop"].float(),
            top_p_on=column["top_p_on"].bool(),
            penalty=column["penalty"].float(),
        )
        logits, hidden = self.run_pass(group, 0, ids.clamp(min=0), positions, slots, real, PASS_COLUMNS)
        packed, seen_after, accepted = decide_chains(
            logits,
            ids,
            column["drafted"].long(),
            column["row_real"].bool(),
            settings,
            column["seed"].long(),
            column["draws"].long(),
            group.seen if penalty else None,
            draft_probs[0] if draft_probs else None,
            column["sampled_draft"].bool(),
            sampled,
        )
        if seen_after is not None and group.seen is not None:
            group.seen.copy_(seen_after)
        return (packed,) if hidden is None else (packed, select_positions(hidden, accepted))


def pass_inputs(inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # [R, >= 4n] float64 -> 4 x [R, n]
    n = PASS_COLUMNS
    return (
        inputs[:, :n].long(),
        inputs[:, n : 2 * n].long(),
        inputs[:, 2 * n : 3 * n].long(),
        inputs[:, 3 * n : 4 * n] > 0,
    )


class _PassCache:
    """What the model's attention layers call a cache for one pass over `rows` consecutive chain rows of a group: each
    layer writes the pass's keys and values in place at the slots it names (padding at the scratch slot L - 1) and
    attends over those rows' L slots."""

    is_compileable = False

    def __init__(self, group: Group, first: int, write_slots: torch.Tensor) -> None:  # write_slots [r, n]
        self.group, self.first = group, first
        count, columns = write_slots.shape
        self.rows = count
        self.write_rows = torch.arange(first, first + count, device=write_slots.device).repeat_interleave(columns)
        self.write_slots = write_slots.flatten()  # [r*n]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, cache_kwargs: object = None
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [r, Hkv, n, d] each -> [r, Hkv, L, d] each
        group = self.group
        if layer_idx == len(group.keys):  # this layer's tables, shaped by its keys; zeros: masked slots hold no NaN
            _, heads, _, size = key_states.shape
            group.keys.append(key_states.new_zeros(PASS_ROWS, heads, group.slots, size))
            group.values.append(value_states.new_zeros(PASS_ROWS, heads, group.slots, size))
        rows = slice(self.first, self.first + self.rows)
        for table, states in ((group.keys[layer_idx], key_states), (group.values[layer_idx], value_states)):
            flat = states.transpose(1, 2).reshape(-1, states.shape[1], states.shape[3])  # [r*n, Hkv, d]
            table[self.write_rows, :, self.write_slots] = flat
        return group.keys[layer_idx][rows], group.values[layer_idx][rows]


@dataclass
class Staging:
    """A program's host side: its input buffer, written row by row, and where its packed output lands (pinned on
    CUDA, so both copies are asynchronous)."""

    inputs: torch.Tensor  # [R, C] float64, host
    outputs: torch.Tensor  # [R, P] float64, host
    blank: np.ndarray  # [C] an unused row's inputs

    def __post_init__(self) -> None:
        self.write, self.read = self.inputs.numpy(), self.outputs.numpy()


def staging_for(group: Group, num_packed: int, device: torch.device) -> Staging:
    pinned = device.type == "cuda"
    inputs = torch.zeros(PASS_ROWS, INPUT_COLUMNS, dtype=torch.float64, device="cpu", pin_memory=pinned)
    outputs = torch.zeros(PASS_ROWS, num_packed, dtype=torch.float64, device="cpu", pin_memory=pinned)
    blank = np.zeros(INPUT_COLUMNS)
    n = PASS_COLUMNS
    blank[:n], blank[2 * n : 3 * n] = HOLE, group.slots - 1
    values = dict(greedy=1.0, temperature=1.0, penalty=1.0)
    for name, value in values.items():
        blank[4 * n + ROW_COLUMNS.index(name)] = value
    return Staging(inputs, outputs, blank)


def write_row(row: np.ndarray, request: ChainRequest) -> None:  # row [INPUT_COLUMNS] float64
    """One row's inputs: its last token and draft at its canonical slots, its settings and its draw stream."""
    n, count = PASS_COLUMNS, len(request.draft_ids) + 1
    start = len(request.trunk_ids) - 1
    row[0] = request.trunk_ids[-1]
    row[1:count] = request.draft_ids
    row[n : n + count] = row[2 * n : 2 * n + count] = range(start, start + count)
    row[3 * n : 3 * n + count] = 1.0
    sampling = request.sampling
    row[4 * n :] = (
        count - 1,
        1.0,
        request.seed,
        request.draws,
        sampling.is_greedy,
        1.0 if sampling.is_greedy else sampling.temperature,
        sampling.top_k,
        1.0 - sampling.top_p,  # in float64, as transformers computes it, then float32 on the device
        sampling.top_p < 1.0,
        sampling.repetition_penalty,
        request.draft_probs is not None,
    )


class Clock:
    """The device's time from now until `wait`, which waits once for everything queued (graphs.wait)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.started = device, time.perf_counter()
        self.start = torch.cuda.Event(enable_timing=True) if device.type == "cuda" else None
        if self.start is not None:
            self.start.record()

    def wait(self) -> float:
        done = graphs.wait(self.device)
        if self.start is None or done is None:
            return time.perf_counter() - self.started
        return self.start.elapsed_time(done) / 1000
