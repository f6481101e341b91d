"""The scheduler shares one model between runs: each run gets exactly its own rows' rounds, whoever else decodes
beside it; a stopped or failing row leaves alone; rows beyond the batch wait for a place."""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import torch

import specdemo.engine.decoding
import specdemo.engine.scheduler
from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.core.stats import emitted_ids
from specdemo.drafters import ModelDrafter, NgramDrafter
from specdemo.engine.decoding import autoregressive_generate, speculative_generate
from specdemo.engine.scheduler import DecodeRequest, Scheduler
from tests.engine.test_batch import EOS, PROMPTS, SETTINGS
from tests.helpers import TINY_VOCAB

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


def run_concurrently(scheduler: Scheduler, rows: list[DecodeRequest], stagger: float = 0.0) -> list[list]:
    """Each row submitted from its own thread (as each user's page does), `stagger` seconds apart; their rounds."""
    results: list[list] = [[] for _ in rows]

    def consume(index: int) -> None:
        time.sleep(stagger * index)
        for batch in scheduler.submit([rows[index]], FAR).rounds(0.01):
            results[index].extend(batch)

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(rows))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return results


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
    """The rows whose tokens differ from the same row decoded alone."""
    rows = requests()
    models_lock = threading.Lock()
    scheduler = scheduler_class(target, make_drafter(), EOS, models_lock, max_rows=8)
    models_lock.acquire()  # the first pass waits 50 ms, so rows 1 and 2 (20 and 40 ms) join a batch still running
    threading.Timer(0.05, models_lock.release).start()  # on a slow machine row 0 could otherwise end alone first
    results = run_concurrently(scheduler, rows, stagger=0.02)
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
    scheduler = Scheduler(tiny_target, NgramDrafter(3, 1), EOS, threading.Lock(), max_rows=2)
    results = run_concurrently(scheduler, rows)
    assert all(results), "every row completes"
    assert max(r.num_rows for rounds in results for r in rounds) == 2
    for i, row in enumerate(rows):
        assert emitted_ids(results[i]) == expected(tiny_target, lambda: NgramDrafter(3, 1), row), f"row {i}"


def test_a_stopped_row_leaves_within_a_second_and_the_others_are_unchanged(tiny_target):
    """No EOS here, so the long row could only end by being stopped."""
    never = frozenset()
    long = DecodeRequest(PROMPTS[0], SamplingConfig(temperature=1.0, seed=7), SpeculativeConfig(max_new_tokens=2000))
    rows = requests()
    scheduler = Scheduler(tiny_target, NgramDrafter(3, 1), never, threading.Lock())
    stream = scheduler.submit([long], FAR)
    batches = stream.rounds(0.01)
    next(batches)  # it is decoding
    results: list[list] = []
    others = threading.Thread(target=lambda: results.extend(run_concurrently(scheduler, rows)))
    others.start()
    time.sleep(0.2)
    stopped = time.monotonic()
    batches.close()  # what Stop and a disconnect do
    while stream.keys[0] in scheduler.decoder.rows:
        assert time.monotonic() - stopped < 1.0, "the stopped row should leave within a second"
        time.sleep(0.005)
    others.join(timeout=120)
    assert max(r.num_rows for lane in results for r in lane) >= 2, "the rows should have shared passes"
    for i, row in enumerate(rows):
        assert emitted_ids(results[i]) == expected(tiny_target, lambda: NgramDrafter(3, 1), row, never), f"row {i}"


def test_a_failing_row_fails_only_its_own_run(tiny_target, monkeypatch):
    """A fault injected into one row's probabilities, once it has decoded a few tokens beside the others, reaches
    that row's stream only."""
    real = specdemo.engine.decoding.logits_to_probs
    bad = DecodeRequest(PROMPTS[1], SamplingConfig(temperature=1.0, seed=13), SpeculativeConfig(max_new_tokens=30))
    shared: list[int] = []

    def faulty(logits, contexts, sampling, warpers):
        if sampling.seed == 13 and contexts.shape[-1] > len(bad.prompt_ids) + 4:
            shared.append(len(scheduler.decoder.rows))
            raise RuntimeError("injected fault")
        return real(logits, contexts, sampling, warpers)

    monkeypatch.setattr(specdemo.engine.decoding, "logits_to_probs", faulty)
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

    results: list[list] = []
    with lock:  # everyone has joined before the first pass
        threads = [
            threading.Thread(target=consume_bad),
            threading.Thread(target=lambda: results.extend(run_concurrently(scheduler, rows))),
        ]
        for thread in threads:
            thread.start()
        time.sleep(0.2)
    for thread in threads:
        thread.join(timeout=60)
    assert [str(e) for e in failure] == ["injected fault"]
    assert shared and shared[0] >= 3, "the fault should strike while the row shares its passes"
    for i, row in enumerate(rows):
        assert emitted_ids(results[i]) == expected(tiny_target, lambda: NgramDrafter(3, 1), row), f"row {i}"


def test_a_row_past_its_deadline_stops_says_so_and_leaves(tiny_target):
    scheduler = Scheduler(tiny_target, NgramDrafter(3, 1), EOS, threading.Lock())
    stream = scheduler.submit(requests()[:2], deadline=time.monotonic())
    assert [r for batch in stream.rounds(0.01) for r in batch] == []
    assert stream.out_of_time
    time.sleep(0.2)
    assert scheduler.decoder.rows == {} and scheduler.worker is None


def test_a_slow_consumer_still_receives_every_round(tiny_target):
    """A busy server or a slow network: the scheduler keeps the rounds, it does not take the wait for a Stop."""
    row = requests()[0]
    scheduler = Scheduler(tiny_target, NgramDrafter(3, 1), EOS, threading.Lock())
    received = []
    for batch in scheduler.submit([row], FAR).rounds(0.01):
        received.extend(batch)
        time.sleep(0.3)
    assert emitted_ids(received) == expected(tiny_target, lambda: NgramDrafter(3, 1), row)


def test_schedulers_of_different_models_never_run_a_pass_at_once(tiny_target, tiny_draft):
    """Two schedulers (two models) with one shared lock: their forward passes never overlap in time."""
    passes: list[tuple[float, float]] = []

    def timed(module, *_):
        module.started = time.perf_counter()

    def record(module, *_):
        passes.append((module.started, time.perf_counter()))

    hooks = [m.register_forward_pre_hook(timed) for m in (tiny_target, tiny_draft)]
    hooks += [m.register_forward_hook(record) for m in (tiny_target, tiny_draft)]
    lock = threading.Lock()
    try:
        first = Scheduler(tiny_target, NgramDrafter(3, 1), EOS, lock)
        second = Scheduler(tiny_draft, NgramDrafter(3, 1), EOS, lock)
        threads = [
            threading.Thread(target=run_concurrently, args=(scheduler, requests())) for scheduler in (first, second)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    finally:
        for hook in hooks:
            hook.remove()
    passes.sort()
    assert len(passes) > 20
    assert all(end <= next_start for (_, end), (next_start, _) in itertools.pairwise(passes))
