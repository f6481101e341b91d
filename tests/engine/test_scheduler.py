"""The scheduler shares one model between runs: each run gets exactly its own rows' rounds, whoever else decodes
beside it; a stopped or failing row leaves alone; rows beyond the batch wait for a place."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

import specdemo.core.eager_round
import specdemo.engine.scheduler
from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.core.stats import emitted_ids
from specdemo.drafters import ModelDrafter, NgramDrafter, NoDrafter
from specdemo.engine.decoding import autoregressive_generate, speculative_generate
from specdemo.engine.scheduler import DecodeRequest, Scheduler, measure_for_sharing
from tests.engine.test_batch import EOS, PROMPTS, SETTINGS
from tests.helpers import (
    HANG_GUARD_SECONDS,
    TINY_VOCAB,
    assert_stopped_runs_leave_at_the_next_round,
    count_rounds,
    wait_for_rounds,
    wait_until,
)

FAR = 1e12  # a deadline that never comes


@pytest.fixture(autouse=True)
def no_shared_pass_cuts(monkeypatch) -> None:
    """Rows here must equal the rows decoded alone, so their drafts are never cut for shared passes, whatever costs an
    earlier test measured for the tiny model (a cut row is another draw: tests/test_sharing.py)."""
    monkeypatch.setattr(specdemo.engine.scheduler, "shared_costs", lambda target: None)


def requests(num_candidates: int = 2) -> list[DecodeRequest]:
    """The four ragged rows of the batch tests, and a target-alone row beside them."""
    rows = [
        DecodeRequest(prompt, sampling, SpeculativeConfig(num_draft_tokens=3, max_new_tokens=limit, num_candidates=w))
        for prompt, (sampling, limit), w in zip(PROMPTS, SETTINGS, [1, num_candidates, 1, num_candidates], strict=True)
    ]
    alone = DecodeRequest(PROMPTS[2], SETTINGS[2][0], SpeculativeConfig(max_new_tokens=20), drafting=False)
    return [*rows, alone]


def expected(target, make_drafter, request: DecodeRequest, eos: frozenset[int] = EOS) -> list[int]:
    """The row's tokens decoded alone."""
    prompt, sampling, spec = torch.tensor([list(request.prompt_ids)]), request.sampling, request.speculative
    if request.drafting:
        return emitted_ids(list(speculative_generate(target, make_drafter(), prompt, sampling, spec, eos)))
    return emitted_ids(list(autoregressive_generate(target, prompt, sampling, spec.max_new_tokens, eos)))


class Consumers:
    """Rows submitted each from its own thread, as each user's page submits its run, and the rounds each receives."""

    def __init__(self, scheduler: Scheduler, rows: list[DecodeRequest]) -> None:
        self.scheduler, self.rows = scheduler, rows
        self.results: list[list] = [[] for _ in rows]
        self.submitted: set[int] = set()
        self.threads: list[threading.Thread] = []

    def start(self, *indices: int) -> None:
        """Rows `indices`, each submitted from a thread of its own; returns once all are in the scheduler."""
        for index in indices:
            self.threads.append(threading.Thread(target=self._consume, args=(index,)))
            self.threads[-1].start()
        wait_until(lambda: self.submitted >= set(indices), f"rows {indices} submitted")

    def _consume(self, index: int) -> None:
        stream = self.scheduler.submit([self.rows[index]], FAR)
        self.submitted.add(index)
        for batch in stream.rounds(0.01):
            self.results[index].extend(batch)

    def join(self) -> list[list]:
        for thread in self.threads:
            thread.join(timeout=HANG_GUARD_SECONDS)
            assert not thread.is_alive(), "hang guard, not a speed bound: a row's run never ended"
        return self.results


def run_concurrently(scheduler: Scheduler, rows: list[DecodeRequest], models_lock: threading.Lock) -> list[list]:
    """Each row submitted from its own thread (as each user's page does); their rounds. No pass runs (the scheduler's
    `models_lock` is held) before every row is in, so the rows share passes however slowly the threads start."""
    consumers = Consumers(scheduler, rows)
    with models_lock:
        consumers.start(*range(len(rows)))
    return consumers.join()


class SwappingScheduler(Scheduler):
    """A broken scheduler: once two rows decode together, it swaps their random streams."""

    def _admit(self) -> None:
        super()._admit()
        rows = list(self.decoder.rows.values())
        if len(rows) >= 3 and not getattr(self, "swapped", False):
            rows[1].generator, rows[2].generator = rows[2].generator, rows[1].generator  # the drafter's draws
            rows[1].seed, rows[2].seed = rows[2].seed, rows[1].seed  # the rule's
            self.swapped = True


def crosstalk(scheduler_class: type[Scheduler], target, make_drafter) -> list[int]:
    """The rows whose tokens differ from the same row decoded alone. Row 0 decodes first; rows 1 and 2 are submitted
    before its first pass and join its batch after it; rows 3 and 4 join once row 1 has had a round."""
    rows = requests()
    models_lock = threading.Lock()
    scheduler = scheduler_class(target, make_drafter(), EOS, models_lock, max_rows=8)
    consumers = Consumers(scheduler, rows)
    with models_lock:  # no pass yet
        consumers.start(0)
        wait_until(lambda: bool(scheduler.decoder.rows), "row 0 admitted")
        consumers.start(1, 2)
    wait_until(lambda: bool(consumers.results[1]), "row 1's first round")
    consumers.start(3, 4)
    results = consumers.join()
    assert max(r.num_rows for rounds in results for r in rounds) >= 3, "the rows should have shared passes"
    return [i for i, row in enumerate(rows) if emitted_ids(results[i]) != expected(target, make_drafter, row)]


@pytest.mark.parametrize("drafter_kind", ["ngram", "model"])
def test_each_run_gets_exactly_its_own_tokens_and_a_swapping_scheduler_is_caught(tiny_target, tiny_draft, drafter_kind):
    """Five rows (greedy and sampled, W = 1 and 2, one target-alone) submitted from five threads, joining a running
    batch: each equals the row decoded alone. The same check catches a scheduler that swaps two rows' generators."""

    def make_drafter():
        return NgramDrafter(3, 1) if drafter_kind == "ngram" else ModelDrafter(tiny_draft, None, TINY_VOCAB)

    assert crosstalk(Scheduler, tiny_target, make_drafter) == []
    assert crosstalk(SwappingScheduler, tiny_target, make_drafter) != []


def test_rows_beyond_the_batch_wait_for_a_place(tiny_target):
    rows = requests()
    lock = threading.Lock()
    scheduler = Scheduler(tiny_target, NgramDrafter(3, 1), EOS, lock, max_rows=2)
    results = run_concurrently(scheduler, rows, lock)
    assert all(results), "every row completes"
    assert max(r.num_rows for rounds in results for r in rounds) == 2
    for i, row in enumerate(rows):
        assert emitted_ids(results[i]) == expected(tiny_target, lambda: NgramDrafter(3, 1), row), f"row {i}"


def test_a_stopped_row_leaves_at_the_next_round_and_the_others_are_unchanged(tiny_target, monkeypatch):
    """No EOS here, so the long row could only end by being stopped; the others decode beside it until it is, and
    after at most the step that began as it was stopped, its row is out of the batch."""
    counter = count_rounds(monkeypatch)
    never = frozenset()
    long = DecodeRequest(PROMPTS[0], SamplingConfig(temperature=1.0, seed=7), SpeculativeConfig(max_new_tokens=2000))
    rows = requests()
    scheduler = Scheduler(tiny_target, NgramDrafter(3, 1), never, threading.Lock())
    batches = scheduler.submit([long], FAR).rounds(0.01)
    next(batches)  # it is decoding
    others = Consumers(scheduler, rows)
    others.start(*range(len(rows)))
    wait_until(lambda: any(others.results), "the other rows' first round")  # a pass they shared with the long row
    batches.close()  # what Stop and a disconnect do
    assert_stopped_runs_leave_at_the_next_round(counter)
    results = others.join()
    assert max(r.num_rows for lane in results for r in lane) >= 2, "the rows should have shared passes"
    for i, row in enumerate(rows):
        assert emitted_ids(results[i]) == expected(tiny_target, lambda: NgramDrafter(3, 1), row, never), f"row {i}"


def test_a_stopped_stream_never_read_again_leaves_at_the_next_round(tiny_target, monkeypatch):
    """Stop set for a page that never reads its stream again (nothing closes it, nothing cancels its rows): the
    scheduler looks at the stop event itself, between rounds."""
    counter = count_rounds(monkeypatch)
    long = DecodeRequest(PROMPTS[0], SamplingConfig(temperature=1.0, seed=7), SpeculativeConfig(max_new_tokens=2000))
    scheduler = Scheduler(tiny_target, NgramDrafter(3, 1), frozenset(), threading.Lock())
    stop = threading.Event()
    scheduler.submit([long], FAR, stop)
    wait_for_rounds(counter, 3)
    stop.set()
    assert_stopped_runs_leave_at_the_next_round(counter)


def test_a_failing_row_fails_only_its_own_run(tiny_target, monkeypatch):
    """A fault injected into one row's probabilities, once it has decoded a few tokens beside the others, reaches
    that row's stream only."""
    real = specdemo.core.eager_round.logits_to_probs
    bad = DecodeRequest(PROMPTS[1], SamplingConfig(temperature=1.0, seed=13), SpeculativeConfig(max_new_tokens=30))
    shared: list[int] = []

    def faulty(logits, contexts, sampling, warpers):
        if sampling.seed == 13 and contexts.shape[-1] > len(bad.prompt_ids) + 4:
            shared.append(len(scheduler.decoder.rows))
            raise RuntimeError("injected fault")
        return real(logits, contexts, sampling, warpers)

    monkeypatch.setattr(specdemo.core.eager_round, "logits_to_probs", faulty)
    rows = requests()
    lock = threading.Lock()
    scheduler = Scheduler(tiny_target, NgramDrafter(3, 1), EOS, lock)
    failure: list[Exception] = []

    def consume_bad() -> None:
        try:
            for _ in scheduler.submit([bad], FAR).rounds(0.01):
                pass
        except RuntimeError as error:
            failure.append(error)

    consumers = Consumers(scheduler, rows)
    failing = threading.Thread(target=consume_bad)
    with lock:  # everyone has joined before the first pass
        failing.start()
        consumers.start(*range(len(rows)))
        wait_until(lambda: len(scheduler.streams) == len(rows) + 1, "the failing row submitted")
    failing.join(timeout=HANG_GUARD_SECONDS)
    assert not failing.is_alive(), "hang guard, not a speed bound: the failing row's run never ended"
    results = consumers.join()
    assert [str(e) for e in failure] == ["injected fault"]
    assert shared and shared[0] >= 3, "the fault should strike while the row shares its passes"
    for i, row in enumerate(rows):
        assert emitted_ids(results[i]) == expected(tiny_target, lambda: NgramDrafter(3, 1), row), f"row {i}"


def test_a_row_past_its_deadline_stops_says_so_and_leaves(tiny_target, monkeypatch):
    """No EOS, so the rows could only end by leaving: at most the step begun as the deadline ended them runs."""
    counter = count_rounds(monkeypatch)
    scheduler = Scheduler(tiny_target, NgramDrafter(3, 1), frozenset(), threading.Lock())
    stream = scheduler.submit(requests()[:2], deadline=time.monotonic())
    assert [r for batch in stream.rounds(0.01) for r in batch] == []
    assert stream.out_of_time
    assert_stopped_runs_leave_at_the_next_round(counter)
    wait_until(lambda: scheduler.worker is None, "the scheduler's thread ending")
    assert scheduler.decoder.rows == {}


def test_a_slow_consumer_still_receives_every_round(tiny_target):
    """A busy server or a slow network: the consumer reads its first rounds, then nothing until the row has been
    decoded to its end. The scheduler keeps the rounds; it does not take the wait for a Stop."""
    row = requests()[0]
    scheduler = Scheduler(tiny_target, NgramDrafter(3, 1), EOS, threading.Lock())
    received = []
    for batch in scheduler.submit([row], FAR).rounds(0.01):
        received.extend(batch)
        wait_until(lambda: not scheduler.streams, "the row decoded to its end")
    assert emitted_ids(received) == expected(tiny_target, lambda: NgramDrafter(3, 1), row)


@pytest.mark.parametrize("num_rows", [1, 3])
def test_a_streams_first_rounds_go_out_at_once_and_later_ones_wait_for_the_interval(tiny_target, num_rows):
    """Time to first token is not stretched: the first batch holds each row's first round, however long the interval;
    the rounds after it wait for the interval (here longer than the run, so they come as one batch). Planted: the
    first batch collecting rounds for its interval like the others (one batch), or going out with the first round
    alone (three rows: one round)."""
    row = DecodeRequest(PROMPTS[0], SamplingConfig(), SpeculativeConfig(num_draft_tokens=2, max_new_tokens=12))
    scheduler = Scheduler(tiny_target, NoDrafter(), EOS, threading.Lock())
    batches = list(scheduler.submit([row] * num_rows, FAR).batches(HANG_GUARD_SECONDS))
    assert sorted(index for index, _ in batches[0]) == list(range(num_rows))
    assert [len(batch) for batch in batches] == [num_rows, 11 * num_rows]


def test_a_run_on_a_measured_model_does_not_wait_for_the_round_in_flight(tiny_target, monkeypatch):
    """measure_for_sharing takes DEVICE_WORK, which every round holds, only to measure: once a model's costs are
    known, a run that joins is not held until the round in flight ends (and then often misses the next one). Planted:
    the lock taken every time."""
    measured: dict[int, SimpleNamespace] = {}

    def measure(model, rows: int) -> SimpleNamespace:
        return measured.setdefault(id(model), SimpleNamespace(full_rows=rows))

    held = Held()
    monkeypatch.setattr(specdemo.engine.scheduler, "DEVICE_WORK", held)
    monkeypatch.setattr(specdemo.engine.scheduler, "batch_costs", measure)
    monkeypatch.setattr(specdemo.engine.scheduler, "shared_costs", lambda model: measured.get(id(model)))
    loaded = SimpleNamespace(model=tiny_target, name="tiny")
    for _ in range(3):
        measure_for_sharing(loaded, print)
    assert held.entered == 1


class Held:
    """DEVICE_WORK as a round in flight holds it: each entry counted."""

    entered = 0

    def __enter__(self) -> None:
        self.entered += 1

    def __exit__(self, *exception: object) -> None:
        return None


def test_schedulers_of_different_models_never_run_a_pass_at_once(tiny_target, tiny_draft):
    """Two schedulers (two models) with one shared lock: no forward pass starts while another is running."""
    lock = threading.Lock()
    passes = {"started": 0, "running": 0, "most_at_once": 0}
    counting = threading.Lock()

    def entering(module, *_):
        with counting:
            passes["started"] += 1
            passes["running"] += 1
            passes["most_at_once"] = max(passes["most_at_once"], passes["running"])

    def leaving(module, *_):
        with counting:
            passes["running"] -= 1

    hooks = [m.register_forward_pre_hook(entering) for m in (tiny_target, tiny_draft)]
    hooks += [m.register_forward_hook(leaving) for m in (tiny_target, tiny_draft)]
    try:
        first = Scheduler(tiny_target, NgramDrafter(3, 1), EOS, lock)
        second = Scheduler(tiny_draft, NgramDrafter(3, 1), EOS, lock)
        runs = [Consumers(scheduler, requests()) for scheduler in (first, second)]
        for consumers in runs:
            consumers.start(*range(len(consumers.rows)))
        for consumers in runs:
            consumers.join()
    finally:
        for hook in hooks:
            hook.remove()
    assert passes["started"] > 20
    assert passes["most_at_once"] == 1, passes
