"""The engine's KV cache and forward pass on a GPU: every decoding pass has one shape, so a token's arithmetic is the
same whether it is decoded alone, verified in a draft of any length, or beside any other rows.

A GPU picks its matrix and attention kernels by shape, and kernels of different shapes sum in different orders: a
token's logits from a one-token step and from a k-token pass differ in the last bits (bfloat16, an H200: up to 0.023),
which flips greedy argmaxes at near-ties. Here every pass is PASS_ROWS chains of PASS_COLUMNS tokens attending over a
row's fixed number of slots (its bucket, chosen once from the most tokens it will hold), and a row's W candidates are
chains in rows of their own, each at the row's canonical slots: the token at position t always sits at slot t, its
query always sees slots 0..t, and every product it takes part in has the same shape. Prompts are read in a pass of
their own, whose shape depends on the prompt alone. So greedy speculative text equals target-only text, and a row's
text is the same in any batch, bit for bit (docs/how-it-works.md; tests/models/test_fixed_shape.py).

On CUDA each group's pass is captured once as a CUDA graph, at its first use, and replayed: an eager pass launches
hundreds of small kernels, and the host's launching, not the GPU, set its pace (benchmarks/cuda_graphs.py: 33.9 against
4.6 ms a token on an H100). A replay runs the kernels its capture recorded, so its logits are the eager pass's bit for
bit. A capture that fails leaves the model eager, with one line in the log.

On a CPU, a one-token round padded to PASS_ROWS x PASS_COLUMNS tokens costs about eleven one-token rounds
(benchmarks/README.md), and the CPU's kernels already keep a row's sums in order (models/attention.py): the CPU keeps
tree_cache.py."""

# R = PASS_ROWS chains per pass, n = PASS_COLUMNS tokens per chain, L = a row's slots (its bucket), V = vocab_size,
# H = hidden size, Hkv = key-value heads, d = head size, W = a row's candidates, K = its longest, m = tokens read

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from specdemo.config import MAX_NUM_DRAFT_TOKENS
from specdemo.models.layout import HOLE, RowRequest
from specdemo.models.tree_cache import GRAPH_CAPTURE, CachedModel, synchronize

PASS_ROWS = 8  # R: chains per pass; a batch of up to 8 one-candidate rows (the app's) decodes in one pass
PASS_COLUMNS = MAX_NUM_DRAFT_TOKENS + 1  # n: a chain is the sequence's last token and up to K drafted ones
MIN_SLOTS = 256  # L: a row's slots are a power of two, at least this, above the most tokens it will hold
PASS_SHAPE_VARIABLE = "SPECDEMO_PASS_SHAPE"  # "fixed" or "tree" overrides the device's default (fixed on a GPU)
GRAPHS_VARIABLE = "SPECDEMO_CUDA_GRAPHS"  # "0" decodes eagerly on CUDA too; "1" tries graphs on any device (a test)
WARMUP_PASSES = 3  # eager passes on a side stream before a capture, as CUDA graphs need

log = logging.getLogger(__name__)


def uses_fixed_shape(device: torch.device) -> bool:
    """Fixed-shape passes on a GPU (any device but the CPU), tree passes on the CPU, unless SPECDEMO_PASS_SHAPE says."""
    forced = os.environ.get(PASS_SHAPE_VARIABLE, "").strip().lower()
    if forced in ("fixed", "tree"):
        return forced == "fixed"
    return device.type != "cpu"


def uses_graphs(device: torch.device) -> bool:
    """CUDA graphs on CUDA, unless SPECDEMO_CUDA_GRAPHS says otherwise."""
    forced = os.environ.get(GRAPHS_VARIABLE, "").strip()
    return forced == "1" if forced in ("0", "1") else device.type == "cuda"


def slot_bucket(num_tokens: int) -> int:
    """L for a row that will hold num_tokens tokens: the next power of two above them (slot L - 1 is scratch)."""
    return max(MIN_SLOTS, 1 << num_tokens.bit_length())


@dataclass
class _Chain:
    """A chain row: one candidate of one row, its keys at canonical slots."""

    index: int  # its row in the pool's tables
    held: list[int] = field(default_factory=list)  # the tokens whose keys sit at slots 0..len - 1


class _Pool:
    """The keys and values of every chain row of L slots, [rows, Hkv, L, d] per layer, grown PASS_ROWS rows at a time
    (a pass reads one group of PASS_ROWS consecutive rows, as a view)."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.keys: list[torch.Tensor] = []  # made by the first pass that writes each layer
        self.values: list[torch.Tensor] = []
        self.size = 0  # rows, a multiple of PASS_ROWS
        self.free: list[int] = []
        self.graphs: dict[int, _Graph] = {}  # by group: its pass, captured over these tables

    def take(self) -> int:
        if not self.free:
            self.free = list(range(self.size, self.size + PASS_ROWS))
            self.size += PASS_ROWS
            self.keys = [_grown(table, self.size) for table in self.keys]
            self.values = [_grown(table, self.size) for table in self.values]
            self.graphs.clear()  # captured over the old tables
        return self.free.pop(0)

    def give_back(self, index: int) -> None:
        self.free = sorted([*self.free, index])

    @property
    def used(self) -> int:
        return self.size - len(self.free)

    def copy(self, source: int, target: int, start: int, stop: int) -> None:
        """Keys and values of slots start..stop - 1 from one chain row to another, every layer."""
        for table in (*self.keys, *self.values):
            table[target, :, start:stop] = table[source, :, start:stop]


def _grown(table: torch.Tensor, rows: int) -> torch.Tensor:  # [B, Hkv, L, d] -> [rows, Hkv, L, d]
    return torch.cat([table, table.new_zeros(rows - table.shape[0], *table.shape[1:])])


class _PassCache:
    """What the model's attention layers call a cache for one pass over `rows` consecutive chain rows of a pool: each
    layer writes the pass's keys and values in place at the slots it names (padding at the scratch slot L - 1) and
    attends over those rows' L slots."""

    is_compileable = False

    def __init__(self, pool: _Pool, first: int, rows: int, write_slots: torch.Tensor) -> None:  # write_slots [r, n]
        self.pool, self.first, self.rows = pool, first, rows
        count, columns = write_slots.shape
        self.write_rows = torch.arange(first, first + count, device=write_slots.device).repeat_interleave(columns)
        self.write_slots = write_slots.flatten()  # [r*n]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, cache_kwargs: object = None
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [r, Hkv, n, d] each -> [r, Hkv, L, d] each
        pool = self.pool
        if layer_idx == len(pool.keys):  # this layer's tables, shaped by its keys; zeros: masked slots hold no NaN
            _, heads, _, size = key_states.shape
            pool.keys.append(key_states.new_zeros(pool.size, heads, pool.slots, size))
            pool.values.append(value_states.new_zeros(pool.size, heads, pool.slots, size))
        rows = slice(self.first, self.first + self.rows)
        for table, states in ((pool.keys[layer_idx], key_states), (pool.values[layer_idx], value_states)):
            flat = states.transpose(1, 2).reshape(-1, states.shape[1], states.shape[3])  # [r*n, Hkv, d]
            table[self.write_rows, :, self.write_slots] = flat
        return pool.keys[layer_idx][rows], pool.values[layer_idx][rows]


class _Graph:
    """One group's pass captured as a CUDA graph: its inputs are copied into `inputs` and the graph replayed, which
    leaves the pass's logits (and hidden states) in `outputs`, overwritten by the next replay. Captures hold
    GRAPH_CAPTURE, so two models' captures (a run's and a pass-cost measurement's) and an emptied cache never meet."""

    def __init__(
        self, run_pass: Callable[..., tuple[torch.Tensor, torch.Tensor | None]], inputs: list[torch.Tensor]
    ) -> None:
        self.inputs = [tensor.clone() for tensor in inputs]
        caller = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        self.graph = torch.cuda.CUDAGraph()
        with GRAPH_CAPTURE:
            side.wait_stream(caller)
            try:
                with torch.cuda.stream(side):
                    for _ in range(WARMUP_PASSES):  # the same writes the pass makes anyway
                        run_pass(*self.inputs)
                with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):  # other threads' models go on
                    self.outputs = run_pass(*self.inputs)
            finally:  # a failed capture leaves its stream current: the eager pass that follows runs on the caller's
                torch.cuda.set_stream(caller)
                caller.wait_stream(side)

    def replay(self, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        for target, source in zip(self.inputs, inputs, strict=True):
            target.copy_(source)
        self.graph.replay()
        return self.outputs


@dataclass
class _Row:
    """A row of the batch: its candidates' chain rows, all in the pool of its slot bucket."""

    pool: _Pool
    chains: list[_Chain]  # chain 0 always; one per candidate of the widest pass so far


@dataclass
class _Fed:
    """One chain's part of a pass: what it feeds from which slot, and whose logits those are."""

    key: Hashable
    candidate: int
    chain: _Chain
    tokens: list[int]  # the sequence's last token, then the candidate's drafted ones
    start: int  # the slot (and position) of its first token


class FixedShapeModel(CachedModel):
    """TreeCachedModel's contract (logits_for="all"), with every pass of one shape (see the module's docstring)."""

    def __init__(self, model: PreTrainedModel, hidden_layers: tuple[int, ...] = ()) -> None:
        super().__init__(model, hidden_layers)
        self.rows: dict[Hashable, _Row] = {}
        self.pools: dict[int, _Pool] = {}  # by L
        self.leaving: set[Hashable] = set()
        self.graphs = uses_graphs(self.device)  # False once a capture failed
        self.capture_seconds = 0.0  # spent capturing graphs, in all

    def drop(self, key: Hashable) -> None:
        """The row leaves before the next pass; its chain rows go back to its pool."""
        self.leaving.add(key)

    @torch.inference_mode()
    def logits(self, asked: dict[Hashable, RowRequest]) -> list[torch.Tensor]:
        """One pass per group of PASS_ROWS chains (one for up to 8 candidates in all), after reading what a row's
        chains do not hold yet (its prompt, when it joins) in a pass of its own. In the order asked: [W, K+1, V]
        with position 0 after the trunk and j+1 after candidate w's first j+1 tokens (zeros past its end)."""
        self._remove_leaving()
        started = self.forward_seconds
        read = {key: self._prepare(key, request) for key, request in asked.items()}
        fed = [
            _Fed(key, w, self.rows[key].chains[w], [request.trunk_ids[-1], *branch], len(request.trunk_ids) - 1)
            for key, request in asked.items()
            for w, branch in enumerate(request.branch_ids or [[]])
        ]
        logits, hidden = {}, {}
        for pool, group in dict.fromkeys((self.rows[f.key].pool, f.chain.index // PASS_ROWS) for f in fed):
            chains = [f for f in fed if self.rows[f.key].pool is pool and f.chain.index // PASS_ROWS == group]
            for f, (row_logits, row_hidden) in zip(chains, self._decode(pool, group, chains), strict=True):
                logits[f.key, f.candidate], hidden[f.key, f.candidate] = row_logits, row_hidden
        for f in fed:
            f.chain.held = asked[f.key].trunk_ids[: f.start] + f.tokens
        self.last_forward_seconds = self.forward_seconds - started
        self.last_input_lengths = {key: read[key] + sum(len(f.tokens) for f in fed if f.key == key) for key in asked}
        if self.keep_hidden_states:
            self.last_hidden_states = {key: _arranged(hidden, key, asked[key]) for key in asked}
        return [_arranged(logits, key, request) for key, request in asked.items()]

    def _remove_leaving(self) -> None:
        for key in self.leaving & set(self.rows):
            self._release(self.rows.pop(key))
        self.leaving.clear()

    def _release(self, row: _Row) -> None:
        for chain in row.chains:
            row.pool.give_back(chain.index)
        if not row.pool.used:  # nobody left in it: its memory goes
            del self.pools[row.pool.slots]

    def _prepare(self, key: Hashable, request: RowRequest) -> int:
        """The row's chains (one per candidate) each hold its sequence but the last token; returns the tokens read."""
        assert request.logits_for == "all", "fixed-shape passes verify; a draft model's steps use tree passes"
        trunk = request.trunk_ids
        assert all(len(b) < PASS_COLUMNS for b in request.branch_ids), (
            f"candidates of at most {PASS_COLUMNS - 1} tokens, got {list(map(len, request.branch_ids))}"
        )
        needed = max(request.capacity, len(trunk) + max(map(len, request.branch_ids), default=0))  # slots written
        row = self.rows.get(key)
        if row is None or needed >= row.pool.slots:  # new, or past its bucket (when no capacity was named)
            if row is not None:
                self._release(row)
            pool = self.pools.setdefault(slot_bucket(needed), _Pool(slot_bucket(needed)))
            row = self.rows[key] = _Row(pool, [_Chain(pool.take())])  # it reads its whole sequence again
        while len(row.chains) < max(1, len(request.branch_ids)):
            row.chains.append(_Chain(row.pool.take()))
        known = trunk[:-1]
        best = max(row.chains, key=lambda chain: _common(chain.held, known))
        read = len(known) - _common(best.held, known)
        if read:
            self._read(row.pool, best, known)
        for chain in row.chains:
            common = _common(chain.held, known)
            if common < len(known):
                row.pool.copy(best.index, chain.index, common, len(known))
                chain.held = list(known)
        return read

    def _read(self, pool: _Pool, chain: _Chain, known: list[int]) -> None:
        """Tokens the chain does not hold yet, read in one pass of their own: [1, m], its shape set by them alone."""
        start = _common(chain.held, known)
        tokens = torch.tensor([known[start:]], device=self.device)  # [1, m]
        positions = torch.arange(start, len(known), device=self.device)[None]  # [1, m]
        self._forward(pool, chain.index, tokens, positions, positions, positions >= 0, logits_to_keep=1)
        chain.held = list(known)

    def _decode(self, pool: _Pool, group: int, chains: list[_Fed]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """One pass over a group's PASS_ROWS chain rows, PASS_COLUMNS columns each (padding elsewhere)."""
        tokens = [[HOLE] * PASS_COLUMNS for _ in range(PASS_ROWS)]
        positions = [[0] * PASS_COLUMNS for _ in range(PASS_ROWS)]
        for f in chains:
            local = f.chain.index - group * PASS_ROWS
            tokens[local][: len(f.tokens)] = f.tokens
            positions[local][: len(f.tokens)] = range(f.start, f.start + len(f.tokens))
        ids = torch.tensor(tokens, device=self.device)  # [R, n]
        real = ids != HOLE  # [R, n]
        where = torch.tensor(positions, device=self.device)  # [R, n]
        slots = torch.where(real, where, pool.slots - 1)  # padding writes the scratch slot
        logits, hidden = self._group_pass(pool, group, [ids.clamp(min=0), where, slots, real])
        found = []
        for f in chains:
            local, count = f.chain.index - group * PASS_ROWS, len(f.tokens)
            found.append((logits[local, :count], None if hidden is None else hidden[local, :count]))
        return found

    def _group_pass(
        self, pool: _Pool, group: int, inputs: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # [R, n, V], [R, n, H] or None
        """A group's pass: replayed from its graph (captured now if it has none), or eager."""
        first = group * PASS_ROWS
        if not self.graphs:
            return self._forward(pool, first, *inputs, PASS_COLUMNS)
        graph = pool.graphs.get(group)
        if graph is None:
            started = time.perf_counter()
            try:
                graph = pool.graphs[group] = _Graph(
                    lambda *given: self.run_pass(pool, first, *given, PASS_COLUMNS), inputs
                )
            except (RuntimeError, AssertionError) as error:  # no CUDA, or a kernel that cannot be captured
                log.warning("specdemo: decoding without CUDA graphs: the capture failed (%s)", error)
                self.graphs = False
                return self._forward(pool, first, *inputs, PASS_COLUMNS)
            synchronize(self.device)
            self.capture_seconds += time.perf_counter() - started
        started = time.perf_counter()
        outputs = graph.replay(inputs)
        synchronize(self.device)
        self.forward_seconds += time.perf_counter() - started
        return outputs

    def _forward(
        self,
        pool: _Pool,
        first: int,  # the first chain row of the pass
        tokens: torch.Tensor,  # [r, m] int64
        positions: torch.Tensor,  # [r, m]
        write_slots: torch.Tensor,  # [r, m]
        real: torch.Tensor,  # [r, m] bool: False for padding
        logits_to_keep: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # [r, logits_to_keep, V], [r, logits_to_keep, H] or None
        started = time.perf_counter()
        outputs = self.run_pass(pool, first, tokens, positions, write_slots, real, logits_to_keep)
        synchronize(self.device)
        self.forward_seconds += time.perf_counter() - started
        return outputs

    def run_pass(
        self,
        pool: _Pool,
        first: int,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        write_slots: torch.Tensor,
        real: torch.Tensor,
        logits_to_keep: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """_forward's work, with no host clock and no wait: device work alone, which a CUDA graph can capture
        (benchmarks/cuda_graphs.py)."""
        slots = torch.arange(pool.slots, device=self.device)  # [L]
        behind = positions[..., None] - slots  # [r, m, L]
        masks = {}
        for kind in self.layer_kinds:  # a real column sees its slots 0..position (its canonical prefix); padding slot 0
            window = self.sliding_window if kind == "sliding_attention" else None
            visible = (behind >= 0) & (behind < window) if window is not None else behind >= 0
            masks[kind] = torch.where(real[..., None], visible, slots == 0)[:, None]  # [r, 1, m, L]
        cache = _PassCache(pool, first, tokens.shape[0], write_slots)
        output = self.model(
            input_ids=tokens,
            position_ids=positions,
            attention_mask=masks if len(masks) > 1 else next(iter(masks.values())),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=logits_to_keep,
            tree_pass=True,
            output_hidden_states=self.keep_hidden_states,
        )
        hidden = self.read_hidden(output.hidden_states, logits_to_keep) if self.keep_hidden_states else None
        return output.logits, hidden


def _common(first: list[int], second: list[int]) -> int:
    """The length of the common prefix."""
    length = 0
    for a, b in zip(first, second, strict=False):
        if a != b:
            break
        length += 1
    return length


def _arranged(found: dict, key: Hashable, request: RowRequest) -> torch.Tensor:  # [W, K+1, V] (or [W, K+1, H])
    """A row's chains' outputs side by side, zeros past a shorter candidate's end."""
    chains = [found[key, w] for w in range(max(1, len(request.branch_ids)))]
    depth = max(chain.shape[0] for chain in chains)
    arranged = chains[0].new_zeros(len(chains), depth, chains[0].shape[-1])
    for w, chain in enumerate(chains):
        arranged[w, : chain.shape[0]] = chain
    return arranged
