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

Rows decode in groups of PASS_ROWS chain rows kept for the process (models/pools.py). On CUDA a group's round is one
captured program (models/graphs.py, models/fixed_pass.py): the pass, the user's settings, the rule and the inspector's
entries (core/chain_round.py), for rows of one candidate and rows of up to PASS_ROWS candidates (each candidate a
chain row of the row's group) under the standard or the coupled rule (its candidates fixed tokens), read from one input
buffer and read back in one copy, so the host waits once a round, on an event recorded on its stream (graphs.wait),
never on the whole device. A replay runs the kernels its capture recorded, so its numbers are the eager program's bit
for bit. Passes and rounds hold graphs.DEVICE_WORK, as every capture does, so one capture runs at a time and no other
device work meets it. A capture that fails leaves the model's programs eager, with one line in the log
(SPECDEMO_CUDA_GRAPHS=strict: CaptureFailed); one that runs out of memory lets the model's idle groups go and tries once
more, and failing again leaves that group's mode eager.

On a CPU, a one-token round padded to PASS_ROWS x PASS_COLUMNS tokens costs about eleven one-token rounds, and the
CPU's kernels already keep a row's sums in order (models/attention.py): the CPU keeps tree_cache.py."""

# R = PASS_ROWS chains per pass, n = PASS_COLUMNS tokens per chain, L = a row's slots (its bucket), V = vocab_size,
# H = hidden size, Hkv = key-value heads, d = head size, W = a row's candidates, K = its longest, m = tokens read

from __future__ import annotations

import functools
import logging
import threading
import time
import weakref
from collections.abc import Hashable
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from transformers import PreTrainedModel

from specdemo.config import MAX_NUM_CANDIDATES
from specdemo.core.chain_round import chain_verdict, drafted_ids, packed_columns
from specdemo.core.rules import CoupledRule
from specdemo.core.verdicts import DeviceIds, Overflowed, RoundAsk, RowVerdict, candidate_lengths
from specdemo.models import graphs
from specdemo.models.fixed_pass import (
    EOS_COLUMNS,
    PASS_COLUMNS,
    Clock,
    PassRunner,
    Staging,
    staging_for,
    write_row,
    write_sync,
    write_tree,
)
from specdemo.models.graphs import Program
from specdemo.models.layout import HOLE, RowRequest
from specdemo.models.pools import PASS_ROWS, Group, ModelPools, pools_for
from specdemo.models.tree_cache import CachedModel

MIN_SLOTS = 256  # L: a row's slots are a power of two, at least this, above the most tokens it will hold
SEED_BITS = 53  # a row's draw stream seed travels in the round's float64 input buffer, exactly

__all__ = ["HOLE", "PASS_COLUMNS", "PASS_ROWS", "FixedShapeModel", "slot_bucket"]

log = logging.getLogger(__name__)


def slot_bucket(num_tokens: int) -> int:
    """L for a row that will hold num_tokens tokens: the next power of two above them (slot L - 1 is scratch)."""
    return max(MIN_SLOTS, 1 << num_tokens.bit_length())


@dataclass(eq=False)
class _Chain:
    """A chain row: one candidate of one row, its keys at canonical slots of one group's row."""

    group: Group
    local: int  # its row in the group
    start: int = 0  # slots 0..start - 1 hold the row's sequence as it was then (a row's sequence only grows)
    tail: list[int] = field(default_factory=list)  # the tokens at slots start.., fed since: drafts may be rejected
    seen_valid: bool = False  # the group's seen row holds this chain's sequence (kept by rounds with a penalty)
    seen_length: int = 0  # how many of the sequence's first tokens the group's seen row holds, where a draft model's
    # steps keep it (drafters/model_steps.py)

    def common(self, trunk: list[int], known: int) -> int:
        """How many of trunk's first `known` tokens the chain holds: O(tokens fed since), not O(sequence)."""
        if known <= self.start:
            return known
        length = self.start
        for held, token in zip(self.tail, trunk[self.start : known], strict=False):
            if held != token:
                break
            length += 1
        return length


@dataclass(frozen=True)
class _Sync:
    """A chain row that lacks slots start..stop - 1 of its row's sequence, which another of its group holds: copied in
    the round program, before its pass (fixed_pass.sync_chains)."""

    key: Hashable  # the row
    group: Group
    source: int
    target: int
    start: int
    stop: int


@dataclass
class _Row:
    """A row of the batch: its candidates' chain rows, all of one slot bucket."""

    chains: list[_Chain]  # chain 0 always; one per candidate of the widest pass so far

    @property
    def slots(self) -> int:
        return self.chains[0].group.slots


@dataclass(frozen=True)
class _Fed:
    """One chain's part of a pass: what it feeds from which slot, and whose logits those are."""

    key: Hashable
    candidate: int
    chain: _Chain
    tokens: list[int]  # the sequence's last token, then the candidate's drafted ones
    start: int  # the slot (and position) of its first token


class FixedShapeModel(CachedModel):
    """TreeCachedModel's contract (logits_for="all"), with every pass of one shape (see the module's docstring), and
    `decide`: whole rounds on the device, of one-candidate rows and of rows of several candidates, under either rule
    (in_program)."""

    def __init__(self, model: PreTrainedModel, hidden_layers: tuple[int, ...] = ()) -> None:
        super().__init__(model, hidden_layers)
        self.rows: dict[Hashable, _Row] = {}
        self.pools: ModelPools = pools_for(model)
        self.leased: list[Group] = []  # the groups this model's rows use; each goes back to the pools when it empties
        self.lock = threading.Lock()  # a row leaving between rounds waits for the round in flight
        self.runner = PassRunner(weakref.ref(model), self.layer_kinds, self.sliding_window, hidden_layers)
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.captures_before = len(self.pools.captures)

    @property
    def replays_graphs(self) -> bool:
        """Programs are captured as CUDA graphs: asked for (uses_graphs), and no capture of this model's failed."""
        return graphs.uses_graphs(self.device) and not self.pools.graphs_failed

    @property
    def capture_seconds(self) -> float:
        """Seconds spent capturing programs since this model's passes were made (kept programs cost nothing)."""
        return sum(seconds for _, seconds in self.pools.captures[self.captures_before :])

    def drop(self, key: Hashable) -> None:
        """The row leaves: its chain rows go back to its groups, and a group it empties back to the pools."""
        with self.lock:
            row = self.rows.pop(key, None)
            if row is not None:
                self._release(row)

    def close(self) -> None:
        """Every row leaves and nothing is kept (a decoder starting afresh after running out of memory): the groups
        its rows held and the model's idle ones go, with their programs."""
        with self.lock:
            self.rows.clear()
            self.leased.clear()
            self.pools.forget_idle()

    def _release(self, row: _Row) -> None:
        for chain in row.chains:
            chain.group.give_back(chain.local)
        for group in {chain.group for chain in row.chains}:
            if not group.used and group in self.leased:
                self.leased.remove(group)
                self.pools.give_back(group)

    def _take(self, slots: int, near: Group | None = None) -> _Chain:
        """A free chain row of `slots` slots, its keys and values zeroed (a row that left may have written inf or NaN
        there, decoding.NonFiniteLogits, which the next row would meet at its masked slots, 0 * NaN): in `near` where
        it has one (a row's candidates in one group run in one program), else in a group this model leased, or in one
        more."""
        group = near if near is not None and near.free else None
        if group is None:
            group = next((g for g in self.leased if g.slots == slots and g.free), None)
        if group is None:
            group = self.pools.lease(slots)
            self.leased.append(group)
        chain = _Chain(group, group.free.pop(0))
        for table in (*group.keys, *group.values):
            table[chain.local].zero_()
        return chain

    @torch.inference_mode()
    def logits(self, asked: dict[Hashable, RowRequest]) -> list[torch.Tensor]:
        """One pass per group of PASS_ROWS chains (one for up to 8 candidates in all), after reading what a row's
        chains do not hold yet (its prompt, when it joins) in a pass of its own. In the order asked: [W, K+1, V]
        with position 0 after the trunk and j+1 after candidate w's first j+1 tokens (zeros past its end)."""
        with graphs.DEVICE_WORK, self.lock:
            return self._chain_logits(asked, {key: self._prepare(key, request) for key, request in asked.items()})

    def _chain_logits(self, asked: dict[Hashable, RowRequest], read: dict[Hashable, int]) -> list[torch.Tensor]:
        """logits() for prepared rows (`read`: the tokens each row's preparation read)."""
        started = self.forward_seconds
        fed = [
            _Fed(key, w, self.rows[key].chains[w], [request.trunk_ids[-1], *branch], len(request.trunk_ids) - 1)
            for key, request in asked.items()
            for w, branch in enumerate(request.branch_ids or [[]])
        ]
        logits, hidden = {}, {}
        for group in dict.fromkeys(f.chain.group for f in fed):
            chains = [f for f in fed if f.chain.group is group]
            outputs = self._run(group, ("pass", self.hidden_layers), self._pass_inputs(group, chains))
            for f in chains:
                count = len(f.tokens)
                logits[f.key, f.candidate] = outputs[0][f.chain.local, :count]
                hidden[f.key, f.candidate] = outputs[1][f.chain.local, :count] if len(outputs) > 1 else None
        for f in fed:
            f.chain.start, f.chain.tail, f.chain.seen_valid = f.start, f.tokens, False
        self.last_forward_seconds = self.forward_seconds - started
        self.last_input_lengths = {key: read[key] + sum(len(f.tokens) for f in fed if f.key == key) for key in asked}
        if self.keep_hidden_states:
            self.last_hidden_states = {key: _arranged(hidden, key, asked[key]) for key in asked}
        return [_arranged(logits, key, request) for key, request in asked.items()]

    def _pass_inputs(self, group: Group, chains: list[_Fed]) -> torch.Tensor:  # [R, 4n] float64
        n = PASS_COLUMNS
        inputs = np.zeros((PASS_ROWS, 4 * n))
        inputs[:, :n], inputs[:, 2 * n : 3 * n] = HOLE, group.slots - 1
        for f in chains:
            row, count = inputs[f.chain.local], len(f.tokens)
            row[:count] = f.tokens
            row[n : n + count] = row[2 * n : 2 * n + count] = range(f.start, f.start + count)
            row[3 * n : 3 * n + count] = 1
        return torch.from_numpy(inputs)

    def _run(
        self, group: Group, mode: Hashable, inputs: torch.Tensor, *extra: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """The group's program for `mode` (made, and captured where graphs are on, at its first use) run on `inputs`,
        copied in with one copy; the outputs stay on the device."""
        program = group.programs.get((mode, self.replays_graphs)) or self._program(group, mode, [inputs, *extra])
        program.inputs[0].copy_(inputs, non_blocking=True)
        started = time.perf_counter()
        outputs = program.replay()
        graphs.wait(self.device)
        self.forward_seconds += time.perf_counter() - started
        return outputs

    def _program(self, group: Group, mode: Hashable, first: list[torch.Tensor]) -> Program:
        """The group's program for `mode`, made at its first use, whose inputs are that use's (`first`): a capture
        runs it a few times before recording it, and those runs must make the writes the first use makes anyway (its
        keys and values at its own slots). The penalty's seen rows, which a round updates, are put back after."""
        captured = self.replays_graphs
        if mode[0] == "pass":
            run = functools.partial(self.runner.group_pass, group)
        else:  # _round_mode's; a penalty's seen rows made by _round
            run = functools.partial(
                self.runner.group_round,
                group,
                mode[2],
                mode[3],
                views=mode[5],
                coupled=mode[6],
                width=mode[7],
                sampled_draft=mode[4],
                on_device=mode[8],
                synced=mode[9],
            )
        inputs = [tensor.to(self.device, copy=True) for tensor in first]
        program = Program(run, inputs)
        if captured:
            started, seen = time.perf_counter(), None if group.seen is None else group.seen.clone()
            try:
                program = graphs.capture_with_room(run, inputs, self.pools.memory, self._make_room)
            except torch.OutOfMemoryError as error:  # twice: this group's mode runs eagerly, the model stays usable
                graphs.capture_failed((mode, group.slots), error, "a group's rounds")  # strict graphs: raised
            except (RuntimeError, AssertionError) as error:  # no CUDA, or a kernel that cannot be captured
                graphs.capture_failed((mode, group.slots), error, "decoding")  # strict graphs: raised
                self.pools.graphs_failed = True
                return self._program(group, mode, first)
            else:
                graphs.wait(self.device)
                self.pools.captures.append((mode, time.perf_counter() - started))
                log.info("specdemo: captured %s for %d slots in %.2f s", mode, group.slots, self.pools.captures[-1][1])
            finally:
                if seen is not None and group.seen is not None:
                    group.seen.copy_(seen)
        group.programs[mode, captured] = program
        return program

    def _make_room(self) -> None:
        """Memory for a capture that ran out of it: the model's idle groups, and what the allocator keeps unused."""
        self.pools.forget_idle()
        graphs.free_cached_memory(self.device)

    def _prepare(self, key: Hashable, request: RowRequest, synced: list[_Sync] | None = None) -> int:
        """The row's chains this pass feeds (one per candidate) each hold its sequence but the last token, read or
        copied from its fullest chain (a chain the pass leaves out is brought up when a pass feeds it); returns the
        tokens read. A copy within one group goes to `synced` where given, for the round program to make
        (sync_chains)."""
        assert request.logits_for == "all", "fixed-shape passes give every position's logits"
        trunk = request.trunk_ids
        assert all(len(b) < PASS_COLUMNS for b in request.branch_ids), (
            f"candidates of at most {PASS_COLUMNS - 1} tokens, got {list(map(len, request.branch_ids))}"
        )
        needed = max(request.capacity, len(trunk) + max(map(len, request.branch_ids), default=0))  # slots written
        row = self.rows.get(key)
        if row is None or needed >= row.slots:  # new, or past its bucket (when no capacity was named)
            if row is not None:
                self._release(row)
            row = self.rows[key] = _Row([self._take(slot_bucket(needed))])  # it reads its whole sequence again
        width = max(1, len(request.branch_ids))
        while len(row.chains) < width:
            row.chains.append(self._take(row.slots, near=row.chains[0].group))
        known = len(trunk) - 1
        held = [chain.common(trunk, known) for chain in row.chains]
        best = row.chains[held.index(max(held))]
        read = known - max(held)
        if read:
            self._read(best, trunk, max(held), known)
        for chain, common in zip(row.chains[:width], held, strict=False):  # the chains this pass feeds
            if chain is not best and common < known:
                if synced is not None and chain.group is best.group:
                    synced.append(_Sync(key, best.group, best.local, chain.local, common, known))
                else:
                    best.group.copy(best.local, chain.group, chain.local, common, known)
                chain.start, chain.tail = known, []  # its seen row, if valid, holds the row's sequence still
        return read

    def hold(self, key: Hashable, trunk: list[int], width: int, depth: int) -> list[tuple[_Chain, int]]:
        """The row's first `width` chains, each holding all of trunk but the tokens from the slot returned with it on:
        at most PASS_COLUMNS tokens, its last one included, for a program's first pass to feed (a draft model's
        steps, drafters/model_steps.py). A row that lacks more (its prompt) reads them in a pass of its own first,
        and a chain that lacks more is copied from the row's fullest one. Its bucket holds depth more tokens."""
        needed = len(trunk) + depth
        row = self.rows.get(key)
        if row is None or needed >= row.slots:  # new, or past its bucket
            if row is not None:
                self._release(row)
            row = self.rows[key] = _Row([self._take(slot_bucket(needed))])
        while len(row.chains) < width:
            row.chains.append(self._take(row.slots))
        chains, known = row.chains[:width], len(trunk) - 1
        held = [chain.common(trunk, known) for chain in chains]
        best = chains[held.index(max(held))]
        if len(trunk) - max(held) > PASS_COLUMNS:
            self._read(best, trunk, max(held), known)
            held[chains.index(best)] = known
        top = max(held)
        for w, chain in enumerate(chains):
            if len(trunk) - held[w] > PASS_COLUMNS:
                best.group.copy(best.local, chain.group, chain.local, held[w], top)
                chain.start, chain.tail, held[w] = top, [], top
        return list(zip(chains, held, strict=True))

    def _read(self, chain: _Chain, trunk: list[int], start: int, known: int) -> None:
        """Tokens the chain does not hold yet, read in one pass of their own: [1, m], its shape set by them alone."""
        tokens = torch.tensor([trunk[start:known]], device=self.device)  # [1, m]
        positions = torch.arange(start, known, device=self.device)[None]  # [1, m]
        began = time.perf_counter()
        self.runner.run_pass(chain.group, chain.local, tokens, positions, positions, positions >= 0, 1)
        graphs.wait(self.device)
        self.forward_seconds += time.perf_counter() - began
        chain.start, chain.tail, chain.seen_valid = known, [], False

    def run_pass(
        self, group: Group, first: int, *inputs: torch.Tensor | int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One pass over rows first.. of a group (tokens, positions, write slots, real, logits_to_keep): the device work
        a program captures (benchmarks/cuda_graphs.py, tests)."""
        return self.runner.forward(self.model, group, first, *inputs)

    @torch.inference_mode()
    def decide(self, asked: dict[Hashable, RoundAsk]) -> dict[Hashable, RowVerdict | Overflowed | Exception]:
        """Every row's round: whole on the device where every row's round runs in the captured program (in_program),
        else the pass and the eager rule (CachedModel.decide). A row whose candidates' chain rows are not all in one
        group takes the pass and the eager rule beside the program."""
        if not all(self.in_program(ask) for ask in asked.values()):
            return super().decide(asked)
        asked = dict(asked)
        with graphs.DEVICE_WORK, self.lock:
            requests = {key: RowRequest(a.trunk_ids, _fed(a), "all", a.capacity) for key, a in asked.items()}
            synced: list[_Sync] = []
            read = {key: self._prepare(key, request, synced) for key, request in requests.items()}
            members: dict[Group, list[tuple[Hashable, list[_Chain], RoundAsk]]] = {}
            eager: list[Hashable] = []
            for key, ask in asked.items():
                chains = self.rows[key].chains[: max(1, len(ask.candidates))]
                if all(chain.group is chains[0].group for chain in chains):
                    members.setdefault(chains[0].group, []).append((key, chains, ask))
                else:
                    eager.append(key)
            modes = {group: _round_mode(self.hidden_layers, rows) for group, rows in members.items()}
            decided: dict[Hashable, RowVerdict | Overflowed | Exception] = {}
            eager_seconds = 0.0
            for sync in synced:  # a copy the program does not make (its group's round is eager, or the row's) made here
                if sync.key in eager or sync.group not in members:
                    sync.group.copy(sync.source, sync.group, sync.target, sync.start, sync.stop)
            synced = [sync for sync in synced if sync.key not in eager and sync.group in members]
            modes = {group: (*mode, any(sync.group is group for sync in synced)) for group, mode in modes.items()}
            for key in eager:  # the eager rule reads the candidates on the host
                asked[key] = asked[key].on_host()
                requests[key] = replace(requests[key], branch_ids=list(asked[key].candidates))
            if eager:
                logits = self._chain_logits({key: requests[key] for key in eager}, read)
                decided.update(self.rule_verdicts({key: asked[key] for key in eager}, logits))
                eager_seconds = self.last_forward_seconds
            else:
                self.last_rule_seconds = 0.0  # the rule ran in the program
            started = Clock(self.device)
            landed = [
                (rows, modes[group], *self._round(group, modes[group], rows, [s for s in synced if s.group is group]))
                for group, rows in members.items()
            ]
            seconds = started.wait() if landed else 0.0
            self.forward_seconds += seconds
            self.last_forward_seconds = eager_seconds + seconds
            self.last_input_lengths = {
                key: read[key] + 1 + sum(candidate_lengths(a.candidates)) for key, a in asked.items()
            }
            for rows, mode, staging, hidden in landed:
                hidden = None if hidden is None else hidden.clone()  # the next replay overwrites the program's own
                for key, chains, ask in rows:
                    local = chains[0].local
                    decided[key] = self._verdict(key, ask, staging.read[local], hidden, local, mode[7])
                    for w, (chain, fed) in enumerate(zip(chains, ask.candidates or [[]], strict=True)):
                        chain.start, chain.tail = len(ask.trunk_ids) - 1, [ask.trunk_ids[-1], *fed]
                        chain.seen_valid = mode[3] and w == 0  # a row's seen row is its first chain row's
            return {key: decided[key] for key in asked}

    def in_program(self, ask: RoundAsk) -> bool:
        """The row's round runs in the captured program: the engine's own rule, of token ids in the vocabulary (the
        eager rule says which id is not; a captured drafter's ids still on the device are), and MAX_NUM_CANDIDATES
        candidates, except a coupled row with a sampling drafter's q (the head's or a draft model's beams): one. Over
        several sampled candidates the coupled rule's match chance (match_chance.top_match_probability) takes shapes
        that depend on the data (the tokens that can match, the pieces the others merge into), which a captured
        program cannot hold; fixed tokens (prompt lookup, the suffix drafter) need p(F) alone."""
        sampled_coupled = isinstance(ask.rule, CoupledRule) and ask.draft_probs is not None
        most = 1 if sampled_coupled else MAX_NUM_CANDIDATES
        if isinstance(ask.candidates, DeviceIds):  # a captured drafter's ids, in the vocabulary
            known = len(ask.eos_token_ids) <= EOS_COLUMNS
        else:
            known = all(0 <= token < self.vocab_size for candidate in ask.candidates for token in candidate)
        return ask.rule.captured and len(ask.candidates) <= most and known

    def _verdict(
        self, key: Hashable, ask: RoundAsk, packed: np.ndarray, hidden: torch.Tensor | None, local: int, width: int
    ) -> RowVerdict | Overflowed | Exception:
        """The row's verdict from its packed row (core/chain_round.chain_verdict, for a program of rows of up to
        `width` candidates), with the tokens the pass read and its hidden states where the next round's logits were
        read; the exception reading it raised, if any."""
        if isinstance(ask.candidates, DeviceIds):  # the ids the round read, cut after an EOS as the program cut them
            ask.candidates.known(drafted_ids(packed, width, ask.candidates.lengths))
            ask = ask.on_host()
        try:
            verdict = chain_verdict(packed, ask, width)
        except Exception as error:  # this row's alone: the others' verdicts stand
            return error
        if isinstance(verdict, Overflowed):
            return verdict
        state = None if hidden is None else hidden[local]
        return replace(verdict, num_input_tokens=self.last_input_lengths[key], hidden_state=state)

    def _round(
        self, group: Group, mode: tuple, rows: list[tuple[Hashable, list[_Chain], RoundAsk]], synced: list[_Sync]
    ) -> tuple[Staging, torch.Tensor | None]:
        """One group's round queued on the device: inputs in, the program, the packed outputs out (asynchronously
        on CUDA); returns where they land and the hidden states, on the device."""
        staging = group.staging.get(mode)
        if staging is None:
            staging = group.staging[mode] = staging_for(group, packed_columns(PASS_COLUMNS, mode[7]), self.device)
        staging.write[:] = staging.blank
        if mode[3] and group.seen is None:
            group.seen = torch.zeros(PASS_ROWS, self.vocab_size, dtype=torch.bool, device=self.device)
        for _, chains, ask in rows:
            if mode[7] > 1:
                write_tree(staging.write, [chain.local for chain in chains], ask)
            else:
                write_row(staging.write[chains[0].local], ask)
            first = chains[0]
            if mode[3] and group.seen is not None and not first.seen_valid:  # its first round with a penalty
                group.seen[first.local] = False
                group.seen[first.local, ask.trunk_ids] = True
        for sync in synced:
            write_sync(staging.write[sync.target], sync.source, sync.start, sync.stop)
        program = group.programs.get((mode, self.replays_graphs))
        if program is None:
            given = [staging.inputs]
            if mode[4]:
                given.append(torch.zeros(PASS_ROWS, PASS_COLUMNS - 1, self.vocab_size, device=self.device))  # [R, K, V]
            if mode[8]:
                given.append(torch.zeros(PASS_ROWS, PASS_COLUMNS - 1, device=self.device))  # [R, K] float32
            _given_on_device(given, mode, rows)
            program = self._program(group, mode, given)
        _given_on_device(program.inputs, mode, rows)
        program.inputs[0].copy_(staging.inputs, non_blocking=True)
        outputs = program.replay()
        staging.outputs.copy_(outputs[0], non_blocking=True)
        return staging, outputs[1] if len(outputs) > 1 else None


def _round_mode(hidden_layers: tuple[int, ...], rows: list[tuple[Hashable, list[_Chain], RoundAsk]]) -> tuple:
    """A group's round program: ("round", hidden layers, some row samples, has a penalty, sampled its draft, reads
    the inspector's entries, runs the coupled rule, the most candidates of a row, has a draft still on the
    device); decide adds whether the program copies slots between chain rows first (sync_chains)."""
    asks = [ask for _, _, ask in rows]
    return (
        "round",
        hidden_layers,
        any(not ask.sampling.is_greedy for ask in asks),
        any(ask.sampling.repetition_penalty != 1.0 for ask in asks),
        any(ask.draft_probs is not None for ask in asks),
        any(ask.views for ask in asks),  # the inspector's entries, computed where a row reads them
        any(isinstance(ask.rule, CoupledRule) for ask in asks),
        max(max(1, len(ask.candidates)) for ask in asks),
        any(isinstance(ask.candidates, DeviceIds) for ask in asks),
    )


def _fed(ask: RoundAsk) -> list[list[int]]:
    """The candidates as a pass is asked for them: ids still on the device as their lengths alone (the program reads
    the ids where they are)."""
    if isinstance(ask.candidates, DeviceIds):
        return [[HOLE] * length for length in ask.candidates.lengths]
    return list(ask.candidates)


def _given_on_device(
    inputs: list[torch.Tensor], mode: tuple, rows: list[tuple[Hashable, list[_Chain], RoundAsk]]
) -> None:
    """The rows' sampled drafts' q ([R, K, V], where mode[4]) and ids still on the device ([R, K], where mode[8])
    written into a round's inputs, each candidate's at its chain row: one copy a row for each, on the device."""
    for _, chains, ask in rows:
        targets = []
        if mode[4] and ask.draft_probs is not None:
            targets.append((inputs[1], ask.draft_probs))
        if mode[8] and isinstance(ask.candidates, DeviceIds):
            targets.append((inputs[-1], ask.candidates.tensor))
        locals_ = [chain.local for chain in chains[: len(ask.candidates)]]
        for target, given in targets:
            depth = min(given.shape[1], target.shape[1])
            if locals_ == list(range(locals_[0], locals_[0] + len(locals_))):  # consecutive: one slice
                target[locals_[0] : locals_[0] + len(locals_), :depth] = given[:, :depth]
            else:
                index = torch.tensor(locals_, device=target.device)
                target[:, :depth].index_copy_(0, index, given[:, :depth].to(target.dtype))


def _arranged(found: dict, key: Hashable, request: RowRequest) -> torch.Tensor:  # [W, K+1, V] (or [W, K+1, H])
    """A row's chains' outputs side by side, zeros past a shorter candidate's end."""
    chains = [found[key, w] for w in range(max(1, len(request.branch_ids)))]
    depth = max(chain.shape[0] for chain in chains)
    arranged = chains[0].new_zeros(len(chains), depth, chains[0].shape[-1])
    for w, chain in enumerate(chains):
        arranged[w, : chain.shape[0]] = chain
    return arranged
