"""Many runs, one model: a Scheduler decodes the rows of every run that uses its target and drafter in one
BatchDecoder, in its own thread. Runs join at a round boundary and leave when they finish, are stopped or fail;
each run receives only its own rows' rounds. Schedulers of different models take turns round by round."""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

from transformers import PreTrainedModel

from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.core.rounds import Round
from specdemo.core.rules import Rule
from specdemo.drafters.base import Drafter
from specdemo.drafters.registry import NGRAM, is_model_free
from specdemo.engine.costs import batch_costs, shared_costs
from specdemo.engine.decoding import BatchDecoder
from specdemo.engine.drafting import build_drafter
from specdemo.engine.resources import release_freed_memory
from specdemo.models.graphs import DEVICE_WORK
from specdemo.models.loading import LoadedModel, Progress
from specdemo.models.platform import fork_safe

MAX_BATCH_ROWS = 8  # rows decoded together; a run that finds the batch full waits for a place
STOP_POLL_SECONDS = 0.05  # how often a stream waiting for rounds looks at its stop event
IDLE_RELEASE_SECONDS = 1.0  # after the models go idle, freed memory goes back to the system after this
_END = object()  # a row's last item: it finished, was cancelled, or failed (the exception came just before)


@dataclass(frozen=True)
class DecodeRequest:
    """One row to decode: a prompt with its own settings and seed."""

    prompt_ids: Sequence[int]
    sampling: SamplingConfig
    speculative: SpeculativeConfig
    drafting: bool = True  # False: the target alone


class RowStream:
    """The rounds of one run's rows as they arrive, tagged with the row's index in the run. Setting `stop` (Stop, a
    disconnect), closing `batches()` or reaching the deadline takes the rows out of the batch at the next round
    boundary; other runs' rows go on."""

    def __init__(
        self, scheduler: Scheduler, keys: list[Hashable], deadline: float, stop: threading.Event | None = None
    ) -> None:
        self.scheduler, self.keys, self.deadline = scheduler, keys, deadline
        self.stop = stop or threading.Event()
        self.arrived: queue.Queue = queue.Queue()  # (row index, Round | Exception | _END)
        self.out_of_time = False  # True when the deadline, not the engine, ended the rounds
        self.delivered = False  # True once a batch went out; the first goes with every row's first round

    def batches(self, interval: float) -> Iterator[list[tuple[int, Round]]]:
        """The rounds that arrived, at most every `interval` seconds per row decoding in the batch (so eight pages
        ask no more of the server than one), until every row is done; raises the first row failure."""
        try:
            ended: set[int] = set()
            while len(ended) < len(self.keys):
                batch = self._next_batch(interval, ended)
                if batch:
                    self.delivered = True
                    yield batch
        finally:
            for key in self.keys:
                self.scheduler.cancel(key)  # a no-op for a row that has left on its own

    def rounds(self, interval: float) -> Iterator[list[Round]]:
        """The rounds of a run of one row."""
        for batch in self.batches(interval):
            yield [round_ for _, round_ in batch]

    def _get(self, timeout: float) -> tuple[int, object]:
        """The next item within `timeout` (queue.Empty if none came); every row ends once the deadline has passed or
        `stop` is set, which is looked at every STOP_POLL_SECONDS."""
        until = time.monotonic() + timeout
        while True:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                self.out_of_time = True
                return -1, _END
            if self.stop.is_set():
                return -1, _END
            try:
                return self.arrived.get(timeout=max(0.0, min(until - time.monotonic(), remaining, STOP_POLL_SECONDS)))
            except queue.Empty:
                if time.monotonic() >= until:
                    raise

    def _next_batch(self, interval: float, ended: set[int]) -> list[tuple[int, Round]]:
        """The rounds that arrive within `interval` of the first one (which may wait for a place in the batch). The
        first batch goes out once every row has sent its first round or ended, at most `interval` after the first:
        time to first token is not stretched."""
        batch: list[tuple[int, Round]] = []
        until = None
        while len(ended) < len(self.keys):
            try:
                wait = 1.0 if until is None else max(0.0, until - time.monotonic())
                index, item = self._get(wait)
            except queue.Empty:
                if until is None:
                    continue
                return batch
            if item is _END:
                ended.update(range(len(self.keys)) if index < 0 else [index])
            elif isinstance(item, Exception):
                raise item
            else:
                batch.append((index, item))  # type: ignore[arg-type]
                if not self.delivered and len(ended | {i for i, _ in batch}) == len(self.keys):
                    return batch  # every row's first round is here
                stretch = max(1, self.scheduler.num_rows) if self.delivered else 1
                until = until or time.monotonic() + interval * stretch
        return batch


class Scheduler:
    """A BatchDecoder for one target and drafter, run by one thread while it has rows. At most `max_rows` rows decode
    at once; later rows wait, in arrival order, for a place. Every round holds `models_lock`, which all schedulers
    share (graphs.DEVICE_WORK in the app), so the models run one pass at a time and never beside a capture."""

    def __init__(
        self,
        target: PreTrainedModel,
        drafter: Drafter,
        eos_token_ids: frozenset[int],
        models_lock: AbstractContextManager[object],
        max_rows: int = MAX_BATCH_ROWS,
        on_idle: Callable[[Scheduler], None] = lambda scheduler: None,
        rule: Rule | None = None,  # a rule in place of the engine's own of its name (an audit's planted bug)
        cut_drafts: bool = True,  # with the target's measured round costs, drafts are cut when a shared pass pays
    ) -> None:
        costs = shared_costs(target) if cut_drafts else None
        self.decoder = BatchDecoder(target, drafter, eos_token_ids, costs=costs, rule=rule)
        self.models_lock, self.max_rows, self.on_idle = models_lock, max_rows, on_idle
        self.condition = fork_safe(threading.Condition())
        self.waiting: list[tuple[Hashable, DecodeRequest]] = []
        self.streams: dict[Hashable, tuple[RowStream, int]] = {}  # each row's stream and index in its run
        self.cancelled: set[Hashable] = set()
        self.keys = itertools.count()
        self.worker: threading.Thread | None = None

    def submit(
        self, requests: Sequence[DecodeRequest], deadline: float, stop: threading.Event | None = None
    ) -> RowStream:
        """The rows join the batch at the next round boundary (or wait for a place); their rounds arrive on the
        stream, until `stop` is set."""
        with self.condition:
            keys = [next(self.keys) for _ in requests]
            stream = RowStream(self, keys, deadline, stop)
            for index, (key, request) in enumerate(zip(keys, requests, strict=True)):
                self.streams[key] = (stream, index)
                self.waiting.append((key, request))
            if self.worker is None:
                self.worker = threading.Thread(target=self._work, name="specdemo-scheduler", daemon=True)
                self.worker.start()
            self.condition.notify()
        return stream

    def cancel(self, key: Hashable) -> None:
        """The row leaves at the next round boundary (at once if it is still waiting)."""
        with self.condition:
            if key in self.streams:
                self.cancelled.add(key)
                self.condition.notify()

    @property
    def num_rows(self) -> int:
        return len(self.decoder.rows)

    def _work(self) -> None:
        """Rounds while there are rows; the thread ends when none are left or waiting."""
        while True:
            with self.condition:
                self._admit()
                if not (self.decoder.rows or self.waiting):
                    self.worker = None  # the next submit starts a new thread
                    self.on_idle(self)
                    return
            self._round()

    def _admit(self) -> None:
        """Between rounds: cancelled rows and rows whose stream was stopped leave (a stopped page may never read its
        stream again), waiting rows join while there is room."""
        self.cancelled |= {key for key, (stream, _) in self.streams.items() if stream.stop.is_set()}
        for key in self.cancelled:
            self.waiting = [(k, r) for k, r in self.waiting if k != key]
            self.decoder.remove(key)
            self._end(key)
        self.cancelled.clear()
        while self.waiting and len(self.decoder.rows) < self.max_rows:
            key, request = self.waiting.pop(0)
            self.decoder.add(
                key, list(request.prompt_ids), request.sampling, request.speculative, drafting=request.drafting
            )

    def _round(self) -> None:
        """One round for every row; each stream gets its own row's round, or its failure."""
        keys = list(self.decoder.rows)
        try:
            with self.models_lock:
                outcomes = self.decoder.step()
        except Exception as error:  # a shared pass failed: every row in it fails, the scheduler goes on
            for key in keys:
                self.decoder.remove(key)
            outcomes = [(key, error) for key in keys]
        with self.condition:
            for key, outcome in outcomes:
                if key in self.streams:
                    stream, index = self.streams[key]
                    stream.arrived.put((index, outcome))
                if key not in self.decoder.rows:  # finished, or failed
                    self._end(key)

    def _end(self, key: Hashable) -> None:
        if key in self.streams:
            stream, index = self.streams.pop(key)
            stream.arrived.put((index, _END))


def measure_for_sharing(target: LoadedModel, progress: Progress) -> None:
    """At load, not in a run's time: the round costs by which a shared batch cuts its drafts, with one row and with
    MAX_BATCH_ROWS rows (seconds, once per model), holding graphs.DEVICE_WORK as rounds do."""
    known = shared_costs(target.model)
    if known is not None and known.full_rows == MAX_BATCH_ROWS:
        return  # measured: a run does not wait for the round in flight, which holds DEVICE_WORK
    progress(f"Measuring {target.name}'s round costs on this device, for shared batches (once, seconds)...")
    with DEVICE_WORK:
        batch_costs(target.model, MAX_BATCH_ROWS)


class Schedulers:
    """A Scheduler per target model and drafter, made on first use and let go when idle (so an evicted model is not
    kept); all share one lock on the models, the process's lock for device work (graphs.DEVICE_WORK)."""

    def __init__(self, max_rows: int = MAX_BATCH_ROWS) -> None:
        self.models_lock = DEVICE_WORK
        self.max_rows = max_rows
        self.active: dict[tuple[int, object], Scheduler] = {}
        self.lock = fork_safe(threading.Lock())

    def get(
        self,
        target: LoadedModel,
        draft: LoadedModel | None,
        drafter_name: str = NGRAM,
        options: object | None = None,  # the kind's options: runs that ask for other options get a drafter of their own
    ) -> Scheduler:
        """The scheduler of rows decoded by `target` with the model-free drafter `drafter_name` and its `options`, or
        with the draft model (draft not None)."""
        drafter_key = (drafter_name, options) if is_model_free(drafter_name) else id(draft.model)
        key = (id(target.model), drafter_key)
        with self.lock:
            if key not in self.active:
                drafter = build_drafter(drafter_name, target, draft, options)
                self.active[key] = Scheduler(
                    target.model,
                    drafter,
                    target.eos_token_ids,
                    self.models_lock,
                    self.max_rows,
                    on_idle=lambda scheduler, key=key: self._forget(key, scheduler),
                )
            return self.active[key]

    def _forget(self, key: tuple[int, object], scheduler: Scheduler) -> None:
        with self.lock:
            if self.active.get(key) is scheduler:
                del self.active[key]
            if not self.active:  # nothing decodes: what the runs freed goes back to the system, a second later
                later = threading.Timer(IDLE_RELEASE_SECONDS, self._release_if_idle)
                later.daemon = True
                later.start()

    def _release_if_idle(self) -> None:
        """The pages render their last rounds after the models go idle: release after that, if nothing decodes."""
        with self.lock:
            if not self.active:
                release_freed_memory()
