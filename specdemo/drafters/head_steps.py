"""A recurrent head's drafting steps for a round: beam search (greedy rows) or W sampled beams with their q over the
whole vocabulary (sampled rows), drawn with the row's drafting draws (core/fixed_rule.draft_uniforms, the same on
every path). Where the target's rounds replay graphs (models/graphs.uses_graphs) they are one program for the rows
padded to a power of two, captured as a CUDA graph, one per (rows, rule, W, K), and kept with the head (steps_for):
every drafter and request that drafts with one head replays its programs. A program's inputs are the rows' states
and one buffer of their settings; its drafted ids and q stay on the device (core/verdicts.DeviceIds), where the
target's round program reads them, so the host never waits for a draft. The steps hold graphs.DEVICE_WORK, as the
rounds do: a program's inputs and outputs are shared by every run using the head, so a run's drafts are copied out of
them."""

# R = rows, W = beams, K = steps, U = the head's sub-vocabulary, V = the target's vocabulary,
# F = states read (layers x H)

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Hashable

import numpy as np
import torch

from specdemo.core.fixed_rule import draft_uniforms
from specdemo.drafters.base import DraftRequest
from specdemo.models import graphs
from specdemo.models.graphs import Program, uses_graphs
from specdemo.models.passes import uses_fixed_shape
from specdemo.models.platform import fork_safe

SETTINGS = ("token", "temperature", "seed", "start")  # a program's input buffer: a row's last token, its draft
# temperature, its stream seed and its length (where its drafting draws start)


class HeadSteps:
    """The head's programs, made at their first use with that use's inputs (a capture's warm-up runs them). It refers
    to its head weakly: kept per head (steps_for), it goes with the head."""

    def __init__(self, head: torch.nn.Module, vocab_size: int) -> None:
        self._head, self.vocab_size = weakref.ref(head), vocab_size
        self.programs: dict[Hashable, Program] = {}
        self.memory: object = None
        self.captured = True  # False once a capture failed: programs run eagerly

    @property
    def head(self) -> torch.nn.Module:
        head = self._head()
        assert head is not None, "a head's steps outlived their head"
        return head

    def on_device(self, device: torch.device) -> bool:
        """The steps run as programs, whose drafts stay on the device for the target's round program."""
        return uses_fixed_shape(device) and uses_graphs(device)

    def greedy(
        self, states: list[torch.Tensor], settings: torch.Tensor, width: int, depth: int
    ) -> torch.Tensor:  # states R x [F], settings [R, SETTINGS] float64 -> [R, W, K] float32 target ids
        (ids,) = self._run(("greedy", width, depth), states, settings)
        return ids

    def sampled(
        self, states: list[torch.Tensor], settings: torch.Tensor, width: int, depth: int
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [R, W, K] float32 target ids, [R, W, K, V] q (0 off the sub-vocabulary)
        (drafted,) = self._run(("sampled", width, depth), states, settings)
        return drafted[..., -1], drafted[..., :-1]

    def _run(self, key: tuple, states: list[torch.Tensor], settings: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The steps as a program where the target's rounds replay graphs; elsewhere (the CPU) run as they are. A
        program's inputs take the rows' states and settings in one copy each (rows past them keep the last use's:
        each row's steps are its own)."""
        device = states[0].device
        if not self.on_device(device):
            return self._steps(key)(torch.stack(states), settings.to(device))
        rows = len(states)
        bucket = 1 << (rows - 1).bit_length()  # R padded to a power of two: one program serves 5 to 8 rows
        with graphs.DEVICE_WORK:
            program = self.programs.get((key, bucket, self.captured))
            if program is None:
                first = torch.stack(states)
                padded = [torch.nn.functional.pad(t, (0, 0, 0, bucket - rows)) for t in (first, settings.to(device))]
                program = self._program(key, bucket, padded)
            given, buffer = program.inputs
            given[:rows].copy_(states[0][None] if rows == 1 else torch.stack(states))
            buffer[:rows].copy_(settings, non_blocking=True)
            return tuple(output[:rows].clone() for output in program.replay())  # the next replay overwrites them

    def _steps(self, key: tuple) -> Callable[..., tuple[torch.Tensor, ...]]:
        return functools.partial(self._greedy if key[0] == "greedy" else self._sampled, *key[1:])

    def _program(self, key: tuple, bucket: int, first: list[torch.Tensor]) -> Program:
        run = self._steps(key)
        inputs = [tensor.clone() for tensor in first]
        program = Program(run, inputs)
        if self.captured:
            device = inputs[0].device
            try:
                self.memory = self.memory or graphs.memory_pool(device)
                program = graphs.capture_with_room(run, inputs, self.memory, lambda: graphs.free_cached_memory(device))
            except torch.OutOfMemoryError as error:  # twice: this program runs eagerly, the head stays usable
                graphs.capture_failed(("head", key, bucket), error, "the head's program")  # strict: raised
            except (RuntimeError, AssertionError) as error:  # no CUDA, or a kernel that cannot be captured
                graphs.capture_failed(("head", key, bucket), error, "the recurrent head drafts")  # strict: raised
                self.captured = False
                return self._program(key, bucket, first)
        self.programs[key, bucket, self.captured] = program
        return program

    def _greedy(self, width: int, depth: int, states: torch.Tensor, settings: torch.Tensor) -> tuple[torch.Tensor]:
        tokens = settings[:, SETTINGS.index("token")].long()
        return (self.head.beam_search(states.to(self.head.output_rows.dtype), tokens, width, depth).float(),)

    def _sampled(self, width: int, depth: int, states: torch.Tensor, settings: torch.Tensor) -> tuple[torch.Tensor]:
        """W beams drawn with the row's drafting draws (core/fixed_rule.draft_uniforms), the same on every path;
        [R, W, K, V + 1]: q over the target's vocabulary, then the id."""
        column = dict(zip(SETTINGS, settings.unbind(1), strict=True))  # each [R]
        rows = settings.shape[0]
        beams = torch.arange(width, device=settings.device).repeat(rows)  # [R*W]
        seeds, starts = (column[name].long().repeat_interleave(width) for name in ("seed", "start"))
        uniforms = draft_uniforms(seeds, starts, beams, depth).view(rows, width, depth)  # [R, W, K]
        states = states.to(self.head.output_rows.dtype)
        ids, probs = self.head.sample_beams(states, column["token"].long(), uniforms, column["temperature"].float())
        drafted = probs.new_zeros(*probs.shape[:-1], self.vocab_size + 1)  # [R, W, K, V + 1]
        drafted[..., self.head.vocabulary] = probs
        drafted[..., -1] = ids.float()
        return (drafted,)


def step_settings(requests: list[DraftRequest]) -> torch.Tensor:  # [R, SETTINGS] float64, on the host
    """The rows' columns of a head program's input buffer."""
    rows = [(r.sequence_ids[-1], r.sampling.temperature, r.seed, len(r.sequence_ids)) for r in requests]
    return torch.from_numpy(np.array(rows, dtype=np.float64))


_STEPS: weakref.WeakKeyDictionary[torch.nn.Module, HeadSteps] = weakref.WeakKeyDictionary()
_STEPS_LOCK = fork_safe(threading.Lock())


def steps_for(head: torch.nn.Module, vocab_size: int) -> HeadSteps:
    """The head's steps and programs, made once per head and kept while it lives (as models/pools.py keeps a
    model's groups): every drafter using the head shares them."""
    with _STEPS_LOCK:
        steps = _STEPS.get(head)
        if steps is None:
            steps = _STEPS[head] = HeadSteps(head, vocab_size)
        assert steps.vocab_size == vocab_size, f"a head drafts for one vocabulary: {steps.vocab_size}, {vocab_size}"
        return steps
