"""A recurrent head's drafting steps for a round: beam search (greedy rows) or W sampled beams with their q over the
whole vocabulary (sampled rows). Where the target's rounds replay graphs (models/graphs.uses_graphs) they are
one program for the rows padded to a power of two, captured as a CUDA graph, one per (rows, rule, W, K), and kept with
the head (steps_for): every drafter and request that drafts with one head replays its programs. The drafts' q stay on
the device for the rule, and the host reads the drafted ids once. The steps hold graphs.DEVICE_WORK, as the rounds do:
a program's inputs and outputs are shared by every run using the head."""

# R = rows, W = beams, K = steps, U = the head's sub-vocabulary, V = the target's vocabulary,
# F = states read (layers x H)

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Hashable

import torch

from specdemo.models import graphs
from specdemo.models.graphs import Program, uses_graphs
from specdemo.models.passes import uses_fixed_shape
from specdemo.models.platform import fork_safe


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

    def greedy(
        self, states: torch.Tensor, tokens: torch.Tensor, width: int, depth: int
    ) -> torch.Tensor:  # states [R, F], tokens [R] -> [R, W, K] target ids
        (ids,) = self._run(("greedy", width, depth), [states, tokens])
        return ids

    def sampled(
        self,
        states: torch.Tensor,  # [R, F]
        tokens: torch.Tensor,  # [R] int64
        uniforms: torch.Tensor,  # [R, W, K] float64
        temperatures: torch.Tensor,  # [R]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [R, W, K] target ids, [R, W, K, V] q (0 off the sub-vocabulary)
        ids, probs = self._run(("sampled", *uniforms.shape[1:]), [states, tokens, uniforms, temperatures])
        return ids, probs

    def _run(self, key: tuple, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The steps as a program where the target's rounds replay graphs; elsewhere (the CPU) run as they are."""
        device = inputs[0].device
        if not (uses_fixed_shape(device) and uses_graphs(device)):
            return self._steps(key)(*inputs)
        rows = inputs[0].shape[0]
        bucket = 1 << (rows - 1).bit_length()  # R padded to a power of two: one program serves 5 to 8 rows
        padded = [torch.nn.functional.pad(t, (0, 0) * (t.ndim - 1) + (0, bucket - rows)) for t in inputs]
        with graphs.DEVICE_WORK:
            program = self.programs.get((key, bucket, self.captured)) or self._program(key, bucket, padded)
            for target, source in zip(program.inputs, padded, strict=True):
                target.copy_(source)
            return tuple(output[:rows].clone() for output in program.replay())  # the next replay overwrites them

    def _steps(self, key: tuple) -> Callable[..., tuple[torch.Tensor, ...]]:
        return functools.partial(self._greedy, *key[1:]) if key[0] == "greedy" else self._sampled

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

    def _greedy(self, width: int, depth: int, states: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.head.beam_search(states, tokens, width, depth),)

    def _sampled(
        self, states: torch.Tensor, tokens: torch.Tensor, uniforms: torch.Tensor, temperatures: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ids, probs = self.head.sample_beams(states, tokens, uniforms, temperatures)  # [R, W, K], [R, W, K, U]
        full = probs.new_zeros(*probs.shape[:-1], self.vocab_size)  # [R, W, K, V]
        full[..., self.head.vocabulary] = probs
        return ids, full


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
