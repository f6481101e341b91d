"""A group's fixed-shape pass and round as a program runs them (each compiled where fusion is on, models/fusion.py),
and the host's side of a round: the input buffer's layout, how a row's inputs are written into it, and the round's one
wait (models/fixed_shape.py drives them)."""

# R = PASS_ROWS chains per pass, n = PASS_COLUMNS tokens per chain, L = a group's slots, V = vocab_size,
# H = hidden size, F = the hidden features kept (layers x H), Hkv = key-value heads, d = head size, K = drafted
# tokens, m = tokens read

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from transformers import PreTrainedModel

from specdemo.config import MAX_NUM_CANDIDATES, MAX_NUM_DRAFT_TOKENS
from specdemo.core.chain_round import CoupledRows, TreeRows, decide_chains, decide_trees
from specdemo.core.coupled import gumbel_noise
from specdemo.core.fixed_rule import RowSettings
from specdemo.core.rules import CoupledRule
from specdemo.core.verdicts import DeviceIds, RoundAsk, candidate_lengths
from specdemo.core.verify import select_positions
from specdemo.models import fusion, graphs
from specdemo.models.layout import HOLE
from specdemo.models.pools import PASS_ROWS, Group

PASS_COLUMNS = MAX_NUM_DRAFT_TOKENS + 1  # n: a chain is the sequence's last token and up to K drafted ones

EOS_COLUMNS = 4  # the most EOS ids a row whose draft is still on the device can name (the program cuts it there)

# The columns of a round's input buffer [R, INPUT_COLUMNS] float64: ids, positions, write slots and real (n each),
# then one column each for these; a row of several candidates (write_tree) names its candidates' chain rows in its
# first chain row (width, chain_0..), and each of its chain rows names that first one (head); a chain row whose ids
# are still on the device (core/verdicts.DeviceIds) says so (on_device) and names the row's EOS ids (-1 for none);
# a chain row that lacks some slots of its row's sequence names the chain row it copies them from (-1 for none)
ROW_COLUMNS = ("drafted", "row_real", "seed", "draws", "greedy", "temperature", "top_k", "top_p_drop", "top_p_on",
               "penalty", "sampled_draft", "coupled", "width", "head",
               *(f"chain_{w}" for w in range(MAX_NUM_CANDIDATES)), "on_device",
               *(f"eos_{e}" for e in range(EOS_COLUMNS)), "copy_from", "copy_start", "copy_stop")  # fmt: skip
INPUT_COLUMNS = 4 * PASS_COLUMNS + len(ROW_COLUMNS)


@dataclass(frozen=True)
class PassRunner:
    """A model's fixed-shape pass, as a program runs it: it holds the model weakly, so kept groups never keep it."""

    model: Callable[[], PreTrainedModel | None]  # a weakref.ref
    layer_kinds: tuple[str, ...]
    sliding_window: int | None
    hidden_layers: tuple[int, ...]

    def live_model(self) -> PreTrainedModel:
        model = self.model()
        assert model is not None, "a kept program outlived its model"
        return model

    def run_pass(
        self,
        group: Group,
        *inputs: torch.Tensor | int,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model's pass (self.forward), for a program that holds its model weakly."""
        model = self.live_model()
        return self.forward(model, group, *inputs)

    def forward(
        self, model: PreTrainedModel, group: Group, *inputs: torch.Tensor | int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Device work alone, with no host clock and no wait, which a CUDA graph can capture: table_pass over the
        group's tables (inputs: first row, tokens, positions, write slots, real, logits_to_keep)."""
        return table_pass(self.constants, model, _Tables(group.keys, group.values, group.slots), *inputs)

    @property
    def constants(self) -> tuple[tuple[str, ...], int | None, tuple[int, ...]]:
        """What a pass takes of the model besides its weights: its layer kinds, sliding window and kept layers."""
        return self.layer_kinds, self.sliding_window, self.hidden_layers

    def chain_pass(self, group: Group, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The pass of a group's programs over the chains in `inputs` ([R, >= 4n] float64), compiled where fusion is on
        (models/fusion.py): [R, n, V] logits and [R, n, F] hidden states or None. A compiled pass takes the group's
        tables as tensors, so an eager pass that writes only the scratch slot makes them where none are yet."""
        model = self.live_model()
        function = functools.partial(program_pass, self.constants)
        run = fusion.fused(model, ("pass", self.hidden_layers, group.slots), function)
        if run is None:
            return function(model, _Tables(group.keys, group.values, group.slots), inputs)
        if not group.keys:
            scratch = torch.full((1, 1), group.slots - 1, device=inputs.device)  # [1, 1]
            self.forward(model, group, 0, torch.zeros_like(scratch), scratch, scratch, scratch < 0, 1)
        return run(model, _Tables(group.keys, group.values, group.slots), inputs[:, : 4 * PASS_COLUMNS].contiguous())

    def group_pass(self, group: Group, inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # [R, 4n] float64
        """A whole group's pass from its input buffer: [R, n, V] logits (and [R, n, F] hidden states)."""
        logits, hidden = self.chain_pass(group, inputs)
        return (logits,) if hidden is None else (logits, hidden)

    def group_round(
        self,
        group: Group,
        sampled: bool,
        penalty: bool,
        inputs: torch.Tensor,  # [R, INPUT_COLUMNS] float64
        *extra: torch.Tensor,  # [R, K, V] q where sampled_draft, then [R, K] float32 ids where on_device
        views: bool = True,  # the inspector's entries packed (a row asks for them)
        coupled: bool = False,  # some row runs the coupled rule: its noise is drawn
        width: int = 1,  # the most candidates of a row (write_tree's rows where > 1)
        sampled_draft: bool = False,  # some row's q is given
        on_device: bool = False,  # some chain row's ids are given on the device (with_device_ids)
        synced: bool = False,  # some chain row copies slots from another first (sync_chains)
    ) -> tuple[torch.Tensor, ...]:
        """A whole group's round: the pass, then the rule (round_rule), each compiled where fusion is on; [R, P] packed
        (and [R, F] hidden states where the next round's logits were read). The group's seen rows follow the emitted
        tokens when a row has a penalty."""
        if on_device:
            inputs = with_device_ids(inputs, extra[-1])
        if synced:
            sync_chains(group, inputs)
        logits, hidden = self.chain_pass(group, inputs)
        model = self.live_model()
        rule = functools.partial(round_rule, sampled, views, coupled, width)
        mode = ("rule", self.hidden_layers, sampled, penalty, sampled_draft, views, coupled, width)
        run = fusion.fused(model, mode, rule) or rule
        seen = group.seen if penalty else None
        packed, seen_after, kept = run(inputs, logits, seen, extra[0] if sampled_draft else None, hidden)
        if seen_after is not None and group.seen is not None:
            group.seen.copy_(seen_after)
        return (packed,) if kept is None else (packed, kept)


class _Tables(NamedTuple):
    """A group's keys and values as a pass takes them: [R, Hkv, L, d] per layer (made by the first pass that writes
    each layer), and L."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    slots: int


def table_pass(
    constants: tuple[tuple[str, ...], int | None, tuple[int, ...]],  # PassRunner.constants
    model: PreTrainedModel,
    tables: _Tables,
    first: int,  # the first row of the pass
    tokens: torch.Tensor,  # [r, m] int64
    positions: torch.Tensor,  # [r, m]
    write_slots: torch.Tensor,  # [r, m]
    real: torch.Tensor,  # [r, m] bool: False for padding
    logits_to_keep: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # [r, logits_to_keep, V], [r, logits_to_keep, F] or None
    """The model's pass over rows first.. of the tables: their keys and values written at `write_slots`."""
    layer_kinds, sliding_window, hidden_layers = constants
    slots = torch.arange(tables.slots, device=tokens.device)  # [L]
    behind = positions[..., None] - slots  # [r, m, L]
    masks = {}
    for kind in layer_kinds:  # a real column sees its slots 0..position (its canonical prefix); padding slot 0
        window = sliding_window if kind == "sliding_attention" else None
        visible = (behind >= 0) & (behind < window) if window is not None else behind >= 0
        masks[kind] = torch.where(real[..., None], visible, slots == 0)[:, None]  # [r, 1, m, L]
    output = model(
        input_ids=tokens,
        position_ids=positions,
        attention_mask=masks if len(masks) > 1 else next(iter(masks.values())),
        past_key_values=_PassCache(tables, first, write_slots),
        use_cache=True,
        logits_to_keep=logits_to_keep,
        tree_pass=True,
        output_hidden_states=bool(hidden_layers),
    )
    if not hidden_layers:
        return output.logits, None
    hidden = torch.cat([output.hidden_states[layer][:, -logits_to_keep:] for layer in hidden_layers], -1)
    return output.logits, hidden


def program_pass(
    constants: tuple[tuple[str, ...], int | None, tuple[int, ...]],  # PassRunner.constants
    model: PreTrainedModel,
    tables: _Tables,
    inputs: torch.Tensor,  # [R, >= 4n] float64
) -> tuple[torch.Tensor, torch.Tensor | None]:  # [R, n, V], [R, n, F] or None
    """A group's pass from a program's input buffer: every chain row, every column."""
    ids, positions, slots, real = pass_inputs(inputs)
    return table_pass(constants, model, tables, 0, ids.clamp(min=0), positions, slots, real, PASS_COLUMNS)


def round_rule(
    sampled: bool,  # some row samples
    views: bool,  # the inspector's entries packed
    coupled: bool,  # some row runs the coupled rule
    width: int,  # the most candidates of a row: > 1, rows of several chain rows (core/chain_round.decide_trees)
    inputs: torch.Tensor,  # [R, INPUT_COLUMNS] float64
    logits: torch.Tensor,  # [R, n, V] the pass's
    seen: torch.Tensor | None,  # [R, V] bool where a row has a penalty
    draft_probs: torch.Tensor | None,  # [R, K, V] where a row sampled its draft
    hidden: torch.Tensor | None,  # [R, n, F] the pass's kept hidden states
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:  # [R, P], [R, V] seen after, [R, F]
    """A round's rule from the pass (core/chain_round.py) for the rows' settings and rules in the input buffer (a
    coupled row's noise from its seed and positions); the hidden states where the next round's logits were read (a
    row of several candidates: its path's chain row)."""
    column = dict(zip(ROW_COLUMNS, inputs[:, 4 * PASS_COLUMNS :].unbind(1), strict=True))  # each [R]
    settings = RowSettings.from_columns(column)
    decided = (
        logits,
        inputs[:, :PASS_COLUMNS].long(),
        column["drafted"].long(),
        column["row_real"].bool(),
        settings,
        column["seed"].long(),
        column["draws"].long(),
        seen,
        draft_probs,
        column["sampled_draft"].bool(),
        sampled,
        views,
    )
    coupled_rows = _coupled_rows(inputs, column, logits.shape[-1]) if coupled else None
    if width > 1:
        chains = torch.stack([column[f"chain_{w}"] for w in range(width)], 1).long()  # [R, W]
        trees = TreeRows(chains, column["width"].long(), column["head"].long())
        packed, seen_after, read_at, accepted = decide_trees(*decided, trees, coupled_rows)
        hidden = None if hidden is None else hidden.index_select(0, read_at)
    else:
        packed, seen_after, accepted = decide_chains(*decided, coupled_rows)
    return packed, seen_after, None if hidden is None else select_positions(hidden, accepted)


def _coupled_rows(
    inputs: torch.Tensor,  # [R, INPUT_COLUMNS] float64
    column: dict[str, torch.Tensor],  # the rows' columns, each [R]
    vocab_size: int,
) -> CoupledRows:
    """The coupled rows, and every chain row's noise at its round's positions: from its sequence's length (column 0's
    position + 1) on, integer operations on the device (core/coupled.gumbel_noise); a row's chain rows share their
    positions, so each holds its row's noise."""
    n = PASS_COLUMNS
    positions = inputs[:, n : n + 1].long() + 1 + torch.arange(n, device=inputs.device)  # [R, n]
    return CoupledRows(column["coupled"].bool(), gumbel_noise(column["seed"].long(), positions, vocab_size))


def with_device_ids(
    inputs: torch.Tensor,  # [R, INPUT_COLUMNS] float64
    device_ids: torch.Tensor,  # [R, K] float32: the drafted ids of the chain rows marked on_device
) -> torch.Tensor:  # [R, INPUT_COLUMNS] float64
    """The input buffer with the ids of the chain rows whose draft stayed on the device in their columns, and their
    drafted count cut after their first EOS (as the engine cuts a draft on the host): the pass feeds every drafted
    token, the rule tests them up to the EOS."""
    n = PASS_COLUMNS
    column = {name: 4 * n + index for index, name in enumerate(ROW_COLUMNS)}
    on_device = inputs[:, column["on_device"]] > 0  # [R]
    fed = torch.where(on_device[:, None], device_ids.double(), inputs[:, 1:n])  # [R, K]
    eos = inputs[:, column["eos_0"] : column["eos_0"] + EOS_COLUMNS]  # [R, E]
    drafted = inputs[:, column["drafted"]]  # [R]
    depth = torch.arange(n - 1, device=inputs.device)  # [K]
    ends = (fed[..., None] == eos[:, None]).any(dim=-1) & (depth < drafted[:, None])  # [R, K] an EOS drafted there
    first = torch.where(ends, depth, n - 1).amin(dim=1)  # [R] K where none
    cut = torch.where(on_device, torch.minimum(drafted, first + 1.0), drafted)  # [R]
    at = column["drafted"]
    return torch.cat([inputs[:, :1], fed, inputs[:, n:at], cut[:, None], inputs[:, at + 1 :]], 1)


def sync_chains(group: Group, inputs: torch.Tensor) -> None:  # inputs [R, INPUT_COLUMNS] float64
    """Each chain row that names a copy_from row takes that row's keys and values at slots copy_start..copy_stop - 1
    (the accepted tokens it lacks, which the row's path's chain row holds), every layer, before the pass."""
    column = {name: 4 * PASS_COLUMNS + index for index, name in enumerate(ROW_COLUMNS)}
    source = inputs[:, column["copy_from"]].long()  # [R] -1 for none
    slots = torch.arange(group.slots, device=inputs.device)  # [L]
    start, stop = inputs[:, column["copy_start"], None], inputs[:, column["copy_stop"], None]  # [R, 1] each
    copied = ((source >= 0)[:, None] & (slots >= start) & (slots < stop))[:, None, :, None]  # [R, 1, L, 1]
    rows = torch.where(source >= 0, source, torch.arange(source.shape[0], device=inputs.device))  # [R]
    for table in (*group.keys, *group.values):  # [R, Hkv, L, d] each
        table.copy_(torch.where(copied, table.index_select(0, rows), table))


def write_sync(row: np.ndarray, source: int, start: int, stop: int) -> None:  # row [INPUT_COLUMNS] float64
    """A chain row's copy of slots start..stop - 1 from chain row `source` of its group (sync_chains)."""
    first = 4 * PASS_COLUMNS + ROW_COLUMNS.index("copy_from")
    row[first : first + 3] = source, start, stop


def pass_inputs(inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # [R, >= 4n] float64 -> 4 x [R, n]
    n = PASS_COLUMNS
    return (
        inputs[:, :n].long(),
        inputs[:, n : 2 * n].long(),
        inputs[:, 2 * n : 3 * n].long(),
        inputs[:, 3 * n : 4 * n] > 0,
    )


class _PassCache:
    """What the model's attention layers call a cache for one pass over `rows` consecutive chain rows of a group's
    tables: each layer writes the pass's keys and values in place at the slots it names (padding at the scratch slot
    L - 1) and attends over those rows' L slots."""

    is_compileable = False

    def __init__(self, tables: _Tables, first: int, write_slots: torch.Tensor) -> None:  # write_slots [r, n]
        self.tables, self.first = tables, first
        count, columns = write_slots.shape
        self.rows = count
        self.write_rows = torch.arange(first, first + count, device=write_slots.device).repeat_interleave(columns)
        self.write_slots = write_slots.flatten()  # [r*n]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, cache_kwargs: object = None
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [r, Hkv, n, d] each -> [r, Hkv, L, d] each
        keys, values, slots = self.tables
        if layer_idx == len(keys):  # this layer's tables, shaped by its keys; zeros: masked slots hold no NaN
            _, heads, _, size = key_states.shape
            keys.append(key_states.new_zeros(PASS_ROWS, heads, slots, size))
            values.append(value_states.new_zeros(PASS_ROWS, heads, slots, size))
        rows = slice(self.first, self.first + self.rows)
        for table, states in ((keys[layer_idx], key_states), (values[layer_idx], value_states)):
            flat = states.transpose(1, 2).reshape(-1, states.shape[1], states.shape[3])  # [r*n, Hkv, d]
            table[self.write_rows, :, self.write_slots] = flat
        return keys[layer_idx][rows], values[layer_idx][rows]


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
    values = dict(greedy=1.0, temperature=1.0, penalty=1.0, copy_from=-1.0)
    for name, value in values.items():
        blank[4 * n + ROW_COLUMNS.index(name)] = value
    return Staging(inputs, outputs, blank)


def write_row(row: np.ndarray, ask: RoundAsk, candidate: int = 0) -> None:  # row [INPUT_COLUMNS] float64
    """One chain row's inputs: the row's last token and its candidate at their canonical slots (a candidate still on
    the device: its length, and the row's EOS ids), the row's settings, its rule and its draw stream (or noise
    seed)."""
    n, count = PASS_COLUMNS, (candidate_lengths(ask.candidates)[candidate] if ask.candidates else 0) + 1
    start = len(ask.trunk_ids) - 1
    row[0] = ask.trunk_ids[-1]
    if isinstance(ask.candidates, DeviceIds):
        eos = 4 * n + ROW_COLUMNS.index("eos_0")
        row[4 * n + ROW_COLUMNS.index("on_device")] = 1.0
        row[eos : eos + EOS_COLUMNS] = [*sorted(ask.eos_token_ids), *[-1] * (EOS_COLUMNS - len(ask.eos_token_ids))]
    else:
        row[1:count] = ask.candidates[candidate] if ask.candidates else []
    row[n : n + count] = row[2 * n : 2 * n + count] = range(start, start + count)
    row[3 * n : 3 * n + count] = 1.0
    row[4 * n : 4 * n + ROW_COLUMNS.index("width")] = (
        count - 1,
        1.0,
        ask.seed,
        ask.draws,
        *RowSettings.columns_of(ask.sampling),
        ask.draft_probs is not None,
        isinstance(ask.rule, CoupledRule),
    )


def write_tree(inputs: np.ndarray, chains: list[int], ask: RoundAsk) -> None:  # inputs [R, INPUT_COLUMNS] float64
    """A row's inputs to a program of rows with several candidates: candidate w in chain row chains[w] (write_row),
    the row decided at its first chain row, which names its candidates' chain rows; each names that first one."""
    n = 4 * PASS_COLUMNS
    for w, local in enumerate(chains):
        write_row(inputs[local], ask, w)
        inputs[local, n + ROW_COLUMNS.index("row_real")] = w == 0
        inputs[local, n + ROW_COLUMNS.index("head")] = chains[0]
    first = n + ROW_COLUMNS.index("chain_0")
    inputs[chains[0], n + ROW_COLUMNS.index("width")] = len(chains)
    inputs[chains[0], first : first + len(chains)] = chains


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
