"""A draft model's K steps for a round on fixed-shape passes (a GPU, or SPECDEMO_PASS_SHAPE=fixed): for the chains of
each of the draft model's groups, one program, captured as a CUDA graph where the target's rounds replay graphs
(models/graphs.uses_graphs), eager elsewhere, and kept with the group by (K, W, what its rows ask). Each beam of a row
is a chain row of the draft model's own groups (models/fixed_shape.FixedShapeModel.hold). The program's first pass
feeds each chain the tokens it lacks, up to the sequence's last; then each step chooses every chain's token on the
device from q, the row's draft settings applied in fixed shapes (core/fixed_rule.processed_probs, the repetition
penalty on the sequence and the beam's tokens so far), and feeds it in a one-token pass: greedy rows take the first
maximum; sampled rows draw by inverse CDF on the row's drafting draws (core/fixed_rule.draft_uniforms, computed in the
program from the row's seed and length, as tree passes compute them), so a row drafts on either path what it drafts on
the other; the coupled rule's sampled rows take argmax(log q + G) with the row's noise at the token's position
(core/coupled.gumbel_noise), their W first tokens distinct by Gumbel-top-k. The drafted ids and q stay on the device
(core/verdicts.DeviceIds), where the target's round program reads them, so the host waits once a round; a coupled row
of several beams, which may keep fewer, is read back at once. Every token is drawn from the q recorded for it, so the
rule stays exact."""

# R = PASS_ROWS chain rows of a group, n = PASS_COLUMNS, K = steps, W = beams, V = the target's vocab_size,
# V' = the draft model's logits

from __future__ import annotations

import functools
import time
from collections.abc import Hashable
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel

from specdemo.config import SamplingConfig
from specdemo.core.coupled import coupled_choice, coupled_top, gumbel_noise
from specdemo.core.fixed_rule import RowSettings, draft_uniforms, penalised, processed_probs
from specdemo.core.verdicts import DeviceIds
from specdemo.drafters.base import Draft, DraftRequest
from specdemo.models import graphs
from specdemo.models.fixed_pass import PASS_COLUMNS, Staging
from specdemo.models.fixed_shape import FixedShapeModel
from specdemo.models.graphs import Program
from specdemo.models.layout import HOLE
from specdemo.models.pools import PASS_ROWS, Group

# A draft program's input buffer [R, 5n + len(STEP_COLUMNS)] float64: the first pass's ids, positions, write slots
# and real (n each, as models/fixed_pass.py lays them out), the sequence's tokens the group's seen row lacks (n, HOLE
# for none), then one column each for these
FRESH = 4 * PASS_COLUMNS  # where the seen row's missing tokens start
STEP_COLUMNS = ("last", "beam", "seed", "greedy", "temperature", "top_k", "top_p_drop", "top_p_on", "penalty",
                "coupled")  # fmt: skip
SETTINGS = FRESH + PASS_COLUMNS  # where STEP_COLUMNS start

Member = tuple[int, int, Any, int]  # (the request's index, its beam, the beam's chain, the first slot the pass feeds)


class ModelSteps:
    """The draft model's chains and programs for one drafter: its rows' beams as chain rows of the draft model's
    groups, each group's programs made (and captured where graphs are on) at their first use."""

    def __init__(self, model: PreTrainedModel, vocab_size: int) -> None:
        self.chains = FixedShapeModel(model)
        self.vocab_size = vocab_size  # the target's
        self.captured = True  # False once a capture failed: programs run eagerly

    def forget(self, key: Hashable) -> None:
        self.chains.drop(key)

    @torch.inference_mode()
    def propose(
        self, requests: list[DraftRequest], samplings: list[SamplingConfig], sequences: list[list[int]]
    ) -> list[Draft]:
        """Each row's W beams of K tokens (for the rows' sequences as the draft reads them and their draft settings):
        one program per group, then one wait for them all."""
        depth = max(r.num_draft_tokens for r in requests)
        coupled = [r.sampling.is_coupled and not s.is_greedy for r, s in zip(requests, samplings, strict=True)]
        mode = (
            "draft",
            depth,
            max(r.num_candidates for r in requests),
            not all(s.is_greedy for s in samplings),  # some row samples: q is made and kept
            any(coupled),
            any(s.repetition_penalty != 1.0 for s in samplings),
        )
        chains = self.chains
        with graphs.DEVICE_WORK, chains.lock:
            members: dict[Group, list[Member]] = {}
            for i, request in enumerate(requests):
                held = chains.hold(request.key, sequences[i], request.num_candidates, depth)
                for w, (chain, start) in enumerate(held):
                    members.setdefault(chain.group, []).append((i, w, chain, start))
            started = time.perf_counter()
            landed = []
            for group, rows in members.items():
                staging = group.staging.get(mode)
                if not isinstance(staging, Staging):
                    staging = group.staging[mode] = _staging(group, depth, chains.device)
                staging.write[:] = staging.blank
                for i, w, chain, start in rows:
                    row = staging.write[chain.local]
                    _write_row(row, sequences[i][start:], start, w, requests[i].seed)
                    _write_settings(row, samplings[i], coupled[i])
                    if mode[5]:
                        self._fresh(group, chain, sequences[i], row)
                landed.append((rows, staging, *self._replay(group, mode, staging, rows)))
            if mode[4] and mode[2] > 1:  # a coupled row may keep fewer beams: the host reads which
                return self._read(requests, samplings, sequences, landed, depth, started)
            seconds = time.perf_counter() - started
            found: dict[int, list] = {i: [] for i in range(len(requests))}  # per row, its beams' chains and outputs
            for rows, _, drafted, probs in landed:
                for i, _, chain, start in rows:
                    found[i].append((chain, start, drafted, probs))
            greedy = [s.is_greedy for s in samplings]
            return [
                self._left_on_device(r, sequences[i], found[i], depth, greedy[i], seconds)
                for i, r in enumerate(requests)
            ]

    def _left_on_device(
        self, request: DraftRequest, sequence: list[int], beams: list, depth: int, greedy: bool, seconds: float
    ) -> Draft:
        """A row's draft left on the device for the target's round program (core/verdicts.DeviceIds): its chains hold
        the tokens fed before the steps until the round reads the drafted ids back, then the steps' too."""
        count = request.num_draft_tokens
        ids = _rows_of([drafted for _, _, drafted, _ in beams], [chain.local for chain, _, _, _ in beams], count)
        drafted = DeviceIds(ids)
        for w, (chain, start, _, _) in enumerate(beams):
            chain.start, chain.tail, chain.seen_valid = start, list(sequence[start:]), False
            drafted.on_known.append(functools.partial(_fed_since, chain, w, min(count, depth - 1)))
        probs = None if greedy else _rows_of([p for _, _, _, p in beams], [c.local for c, _, _, _ in beams], count)
        return Draft(drafted, probs, seconds)

    def _read(self, requests, samplings, sequences, landed, depth: int, started: float) -> list[Draft]:
        """The rows' drafts read back in one wait: which beams are live, and their ids."""
        graphs.wait(self.chains.device)
        seconds = time.perf_counter() - started
        self.chains.forward_seconds += seconds
        beams: list[list[list[int]]] = [[[] for _ in range(r.num_candidates)] for r in requests]
        probs: list[list[torch.Tensor | None]] = [[None] * r.num_candidates for r in requests]
        live: list[list[bool]] = [[True] * r.num_candidates for r in requests]
        for rows, staging, drafted, group_probs in landed:
            staging.outputs.copy_(drafted)
            for i, w, chain, start in rows:
                packed = staging.read[chain.local]
                ids = [int(token) for token in packed[:depth]]
                chain.start, chain.tail = start, [*sequences[i][start:], *ids[: depth - 1]]
                chain.seen_valid = False
                beams[i][w] = ids[: requests[i].num_draft_tokens]
                live[i][w] = bool(packed[depth])
                if group_probs is not None:
                    probs[i][w] = group_probs[chain.local, : requests[i].num_draft_tokens]
        return [_draft(beams[i], probs[i], live[i], samplings[i].is_greedy, seconds) for i in range(len(requests))]

    def _fresh(self, group: Group, chain: Any, sequence: list[int], row: np.ndarray) -> None:
        """The sequence's tokens the group's seen row lacks, for the program to add: at most n of them; a chain new
        to the seen row, or that lacks more, has its seen row written here."""
        if group.seen is None:
            group.seen = torch.zeros(PASS_ROWS, self.chains.vocab_size, dtype=torch.bool, device=self.chains.device)
        if not chain.seen_length or len(sequence) - chain.seen_length > PASS_COLUMNS:
            group.seen[chain.local] = False
            group.seen[chain.local, [t for t in sequence if t < group.seen.shape[-1]]] = True
            chain.seen_length = len(sequence)
        fresh = sequence[chain.seen_length :]
        row[FRESH : FRESH + len(fresh)] = fresh
        chain.seen_length = len(sequence)

    def _replay(
        self, group: Group, mode: tuple, staging: Staging, rows: list[Member]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The group's program queued, its inputs copied in: the drafted ids packed, and q where made, on the device
        (the program's own: the drafter's next round replays it once this round has read them)."""
        captured = self.captured and self.chains.replays_graphs
        program = group.programs.get((mode, captured)) or self._program(group, mode, [staging.inputs], captured)
        program.inputs[0].copy_(staging.inputs, non_blocking=True)
        outputs = program.replay()
        return outputs[0], outputs[1] if len(outputs) > 1 else None

    def _program(self, group: Group, mode: tuple, first: list[torch.Tensor], captured: bool) -> Program:
        """The group's program for `mode`, made at its first use with that use's inputs (a capture's warm-up runs
        make the writes the first use makes anyway, and add nothing more to the seen rows)."""
        run = functools.partial(self._steps, group, *mode[1:])
        inputs = [tensor.to(self.chains.device, copy=True) for tensor in first]
        program = Program(run, inputs)
        if captured:
            try:
                program = graphs.capture_with_room(run, inputs, self.chains.pools.memory, self._make_room)
            except torch.OutOfMemoryError as error:  # twice: this program runs eagerly, the drafter stays usable
                graphs.capture_failed(("draft", mode, group.slots), error, "the draft model's program")
            except (RuntimeError, AssertionError) as error:  # no CUDA, or a kernel that cannot be captured
                graphs.capture_failed(("draft", mode, group.slots), error, "the draft model's steps")
                self.captured = False
                return self._program(group, mode, first, False)
        group.programs[mode, captured] = program
        return program

    def _make_room(self) -> None:
        """Memory for a capture that ran out of it: the draft model's idle groups, and what the allocator keeps."""
        self.chains.pools.forget_idle()
        graphs.free_cached_memory(self.chains.device)

    def _steps(
        self,
        group: Group,
        depth: int,
        width: int,
        sampled: bool,
        coupled: bool,
        penalty: bool,
        inputs: torch.Tensor,  # [R, SETTINGS + len(STEP_COLUMNS)] float64
    ) -> tuple[torch.Tensor, ...]:  # [R, K + 1] float64, and [R, K, V] float32 where some row samples
        """The program: the first pass, then K steps of choosing and feeding; the drafted ids packed with whether
        the first is live (a coupled row's W first tokens need W ids with q > 0), and q where some row samples."""
        runner, n = self.chains.runner, PASS_COLUMNS
        model = runner.live_model()
        column = dict(zip(STEP_COLUMNS, inputs[:, SETTINGS:].unbind(1), strict=True))  # each [R]
        last, beam, seeds = column["last"].long(), column["beam"].long(), column["seed"].long()
        real = inputs[:, 3 * n] > 0  # [R] a chain of some row
        position = inputs[:, n].long() + last + 1  # [R] the first drafted token's
        settings = RowSettings.from_columns(column)
        seen = None
        if penalty and group.seen is not None:
            ids = torch.arange(group.seen.shape[-1], device=inputs.device)  # [V']
            seen = group.seen | (inputs[:, FRESH:SETTINGS].long()[..., None] == ids).any(dim=1)  # [R, V']
            group.seen.copy_(seen)
        logits, _ = runner.chain_pass(group, inputs)  # [R, n, V']
        step_logits = logits.gather(1, last[:, None, None].expand(-1, 1, logits.shape[-1]))[:, 0]  # [R, V']
        drawn = draft_uniforms(seeds, position, beam, depth) if sampled else None  # [R, K] each chain's draws
        drafted, all_probs, first_live = [], [], torch.ones_like(real)
        for step in range(depth):
            if step:
                at = (position + step - 1)[:, None]  # [R, 1] the previous token's position and slot
                slot = torch.where(real[:, None], at, group.slots - 1)
                step_logits = runner.forward(model, group, 0, drafted[-1][:, None], at, slot, real[:, None], 1)[0][:, 0]
            scores = step_logits[:, None, : self.vocab_size]  # [R, 1, V'] cut to the target's ids
            seen_at = None if seen is None else seen[:, None, : scores.shape[-1]]
            if not sampled:
                drafted.append(penalised(scores, seen_at, settings.penalty).argmax(dim=-1)[:, 0])  # the first maximum
            else:
                probs = processed_probs(scores, seen_at, settings)[:, 0]  # [R, V'] one-hot for greedy rows
                probs = torch.nn.functional.pad(probs, (0, self.vocab_size - probs.shape[-1]))  # [R, V] 0 past V'
                token = _inverse_cdf(probs, drawn[:, step : step + 1])  # [R]
                if coupled:
                    chosen, live = _coupled(probs, seeds, position + step, beam, width, step == 0)
                    token = torch.where(column["coupled"] > 0, chosen, token)
                    first_live = torch.where(column["coupled"] > 0, live, first_live)
                drafted.append(token)
                all_probs.append(probs)
            if seen is not None:
                seen = seen | (drafted[-1][:, None] == torch.arange(seen.shape[-1], device=seen.device))
        packed = torch.cat([torch.stack(drafted, dim=1).double(), first_live[:, None].double()], dim=1)  # [R, K + 1]
        return (packed, torch.stack(all_probs, dim=1)) if sampled else (packed,)


def _coupled(
    probs: torch.Tensor,  # [R, V]
    seeds: torch.Tensor,  # [R] int64
    position: torch.Tensor,  # [R] int64: the token's
    beam: torch.Tensor,  # [R] int64
    width: int,
    first: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # [R] int64 ids, [R] bool: live
    """The coupled rule's tokens, as drafters/model.py's _coupled_tokens: at the first step beam w takes the w-th
    best of log q + G (Gumbel-top-k over a row's chains, whose first q are one), live where q > 0 there; then
    argmax(log q + G), G the noise of the token's position."""
    noise = gumbel_noise(seeds, position[:, None], probs.shape[-1])[:, 0]  # [R, V]
    if not first:
        return coupled_choice(probs, noise), torch.ones_like(beam, dtype=torch.bool)
    top, live = coupled_top(probs, noise, width)  # [R, W] each
    index = beam[:, None].clamp(max=width - 1)
    return top.gather(1, index)[:, 0], live.gather(1, index)[:, 0]


def _rows_of(tensors: list[torch.Tensor], locals_: list[int], count: int) -> torch.Tensor:  # W x [R, K, ...]
    """A row's beams' rows of their groups' outputs, [W, count, ...], copied in one op: the program's next replay
    (another row drafting alone after a failure, or the next round) overwrites its own."""
    first = locals_[0]
    if all(t is tensors[0] for t in tensors) and locals_ == list(range(first, first + len(locals_))):
        return tensors[0][first : first + len(locals_), :count].clone()
    return torch.stack([t[local, :count] for t, local in zip(tensors, locals_, strict=True)])


def _fed_since(chain: Any, beam: int, count: int, ids: list[list[int]]) -> None:
    """The beam's chain also holds the drafted ids the steps fed it, once they are read."""
    chain.tail.extend(ids[beam][:count])


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:  # [R, V], [R, 1] -> [R] int64
    """core/sampling.sample_one for every row: the first id whose cumulative weight exceeds u * total."""
    cdf = probs.double().cumsum(dim=-1)  # [R, V]
    total = cdf[:, -1:]
    threshold = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))
    return (cdf <= threshold).sum(dim=-1)


def _staging(group: Group, depth: int, device: torch.device) -> Staging:
    pinned = device.type == "cuda"
    width = SETTINGS + len(STEP_COLUMNS)
    inputs = torch.zeros(PASS_ROWS, width, dtype=torch.float64, device="cpu", pin_memory=pinned)
    outputs = torch.zeros(PASS_ROWS, depth + 1, dtype=torch.float64, device="cpu", pin_memory=pinned)
    blank = np.zeros(width)
    n = PASS_COLUMNS
    blank[:n], blank[2 * n : 3 * n], blank[FRESH:SETTINGS] = HOLE, group.slots - 1, HOLE
    for name in ("greedy", "temperature", "penalty"):
        blank[SETTINGS + STEP_COLUMNS.index(name)] = 1.0
    return Staging(inputs, outputs, blank)


def _write_row(row: np.ndarray, fed: list[int], start: int, beam: int, seed: int) -> None:  # row float64
    """One chain's inputs: the tokens it lacks at their canonical slots from `start`, its beam and its row's seed."""
    n, count = PASS_COLUMNS, len(fed)
    row[:count] = fed
    row[n : n + count] = row[2 * n : 2 * n + count] = range(start, start + count)
    row[3 * n : 3 * n + count] = 1.0
    row[SETTINGS : SETTINGS + 3] = count - 1, beam, seed


def _write_settings(row: np.ndarray, sampling: SamplingConfig, coupled: bool) -> None:  # row float64
    """A chain's draft settings in fixed shapes, and whether it draws with the coupled rule's noise."""
    row[SETTINGS + 3 :] = (*RowSettings.columns_of(sampling), coupled)


def _draft(
    beams: list[list[int]], probs: list[torch.Tensor | None], live: list[bool], greedy: bool, seconds: float
) -> Draft:
    """A row's draft from its beams: the live ones (a coupled row keeps fewer where q allows fewer first tokens)."""
    kept = [w for w, alive in enumerate(live) if alive]
    chosen = [p for p in (probs[w] for w in kept) if p is not None]
    if greedy or len(chosen) < len(kept):
        return Draft([beams[w] for w in kept], None, seconds)
    return Draft([beams[w] for w in kept], chosen[0][None] if len(chosen) == 1 else torch.stack(chosen), seconds)
