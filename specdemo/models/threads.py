"""How many threads a CPU decoding thread runs on: all of torch's while the cores are free, fewer while another process
keeps them busy.

A decoding thread's OpenMP workers spin between parallel regions (libgomp's GOMP_SPINCOUNT, 300,000 times unless set),
which is what makes an idle machine fast: a one-token step of SmolLM2 runs over a hundred regions, and a worker that
slept must be woken for each. On the AMD EPYC of docs/serving.md ("A busy machine"), the CLI's target-only decoding ran
at 27 tokens/s at 2,000 spins and at 32 from 10,000 up. Beside a process that keeps the cores busy, every region waits
on a worker the system has descheduled instead (3 tokens/s on two threads); one thread waits on nobody (21;
`python -m benchmarks.busy`, docs/serving.md).

So each thread that runs passes governs its OpenMP team (libgomp keeps a team's size per thread): it reads how long it
waited for a core while its passes ran (the kernel's run-queue wait, /proc/thread-self/schedstat), and every
WINDOW_SECONDS of passes it drops a thread when it waited more than CROWDED of that time, and takes one back when it
waited less than FREE. A climb that crowds the cores again is undone, and the next waits twice as long (a neighbour
that keeps one core busy leaves this thread one).

The count must change no token. The rule runs on one thread whatever the count (`one_thread`, models/tree_cache.py):
a sum over one row of a vocabulary is split among the threads, and its last bits depend on their number. A pass's
logits must not depend on it either: as a model's first TreeCachedModel starts, `check` has `keeps_bits`
(models/tree_cache.py) compare two of its passes on one thread with the same on torch's count, and a model whose bits
differ, or that was not checked, runs its passes on torch's count. Where the kernel does not say (not Linux), or
SPECDEMO_ADAPTIVE_THREADS=0, the count stays torch's."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator

import torch

VARIABLE = "SPECDEMO_ADAPTIVE_THREADS"  # "0": every pass on torch's thread count
WINDOW_SECONDS = 0.1  # of passes' wall time, between decisions
CROWDED = 0.25  # the share of a window this thread waited for a core above which it drops a thread
FREE = 0.05  # the share below which it takes one back
FIRST_WAIT = 2.0  # seconds after a drop before a climb; doubled after each climb that was undone
LONGEST_WAIT = 64.0
SCHEDSTAT = "/proc/thread-self/schedstat"  # nanoseconds on a core, nanoseconds waiting for one, slices

log = logging.getLogger(__name__)
_local = threading.local()
_keeps_bits: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def waited_seconds() -> float | None:
    """The calling thread's seconds waiting for a core since it started; None where the kernel does not say."""
    try:
        with open(SCHEDSTAT) as stat:
            return int(stat.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


class ThreadGovernor:
    """One thread's count for its passes (the module's docstring), from what its passes waited for a core."""

    def __init__(
        self,
        most: int,
        waited: Callable[[], float | None] = waited_seconds,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.most = most  # torch's count when the thread first ran a pass
        self.threads = most  # the thread's count now
        self._waited, self._clock = waited, clock
        self._window_wall = self._window_waited = 0.0
        self._climb_after = 0.0  # no climb before this clock reading
        self._wait = FIRST_WAIT  # before the next climb, after a drop
        self._climbed = False  # the latest change was a climb, not yet held through a window

    @contextlib.contextmanager
    def governing(self) -> Iterator[None]:
        """A pass; its time and its wait for a core count towards the window, at whose end the count may change for
        what the thread runs next."""
        waited, started = self._waited(), self._clock()
        try:
            yield
        finally:
            after = self._waited()
            if waited is not None and after is not None:
                self._window_wall += self._clock() - started
                self._window_waited += after - waited
                if self._window_wall >= WINDOW_SECONDS:
                    self._decide(self._window_waited / self._window_wall)
                    self._window_wall = self._window_waited = 0.0

    def _decide(self, share: float) -> None:
        now = self._clock()
        if share > CROWDED and self.threads > 1:
            self._wait = min(2 * self._wait, LONGEST_WAIT) if self._climbed else self._wait
            self._climb_after, self._climbed = now + self._wait, False
            self._change(self.threads - 1, share)
        elif self._climbed:  # the climb held a window: the next drop waits the first wait again
            self._wait, self._climbed = FIRST_WAIT, False
        elif share < FREE and self.threads < self.most and now >= self._climb_after:
            self._climbed = True
            self._change(self.threads + 1, share)

    def _change(self, threads: int, share: float) -> None:
        log.info("Decoding on %d threads: this thread waited %.0f%% of its passes for a core.", threads, 100 * share)
        self.threads = threads
        torch.set_num_threads(threads)


@contextlib.contextmanager
def governed(model: torch.nn.Module) -> Iterator[None]:
    """A pass of `model`, on the count its thread governs where it runs on the CPU (the module's docstring); a model
    that `check` did not find keeping its bits on one thread runs its passes on torch's count."""
    if model.device.type != "cpu" or os.environ.get(VARIABLE) == "0" or getattr(_local, "checking", False):
        yield
        return
    governor = getattr(_local, "governor", None)
    if governor is None or governor.threads != torch.get_num_threads():  # new here, or someone set the count
        governor = _local.governor = ThreadGovernor(torch.get_num_threads())
    if governor.threads < governor.most and not _keeps_bits.get(model, False):
        torch.set_num_threads(governor.most)
        try:
            yield
        finally:
            torch.set_num_threads(governor.threads)
        return
    with governor.governing():
        yield


def check(model: torch.nn.Module, keeps_bits: Callable[[torch.nn.Module], bool]) -> None:
    """Ask keeps_bits(model) (whether its passes' logits on one thread are those on torch's count) once, where its
    passes may run on fewer threads: a CPU model, torch on more than one. TreeCachedModel asks as it starts, on a
    machine not yet known to be busy (on a busy one each pass it compares would wait on descheduled workers)."""
    if model.device.type != "cpu" or os.environ.get(VARIABLE) == "0" or torch.get_num_threads() == 1:
        return
    if getattr(_local, "checking", False):  # keeps_bits's own cache starting
        return
    with _lock:
        if model in _keeps_bits:
            return
        _keeps_bits[model] = keeps_bits(model)
        if not _keeps_bits[model]:
            log.info("Passes of this model keep torch's thread count: its logits differ on one thread.")


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """What runs inside on one thread (the rule: the module's docstring), the count restored after."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def ungoverned() -> Iterator[None]:
    """Passes inside run on the count they find, and count towards no window (keeps_bits's)."""
    before = getattr(_local, "checking", False)
    _local.checking = True
    try:
        yield
    finally:
        _local.checking = before
