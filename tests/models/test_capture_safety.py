"""Captures that are safe and loud, on the CPU with the GPU's path forced: under strict graphs a program that cannot
be captured fails the run naming it, and every program kind the CPU can exercise is captured; no device work of
another thread meets a capture (graphs.DEVICE_WORK); a capture that runs out of memory lets idle memory go, tries once
more, and then runs that group's mode eagerly (docs/how-it-works.md, "A round on a GPU")."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import pytest
import torch

from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.core.stats import emitted_ids
from specdemo.drafters.base import Draft, Drafter, DraftRequest, NoDrafter
from specdemo.drafters.head_steps import steps_for
from specdemo.engine import scheduler
from specdemo.engine.decoding import BatchDecoder
from specdemo.engine.scheduler import DecodeRequest, Scheduler, Schedulers, measure_for_sharing
from specdemo.models import fixed_pass, graphs, loading, passes
from specdemo.models.graphs import DEVICE_WORK, CaptureFailed, CheckedProgram
from specdemo.models.loading import LoadedModel
from specdemo.models.pools import Group, pools_for
from tests.engine.test_batch import PROMPTS
from tests.helpers import HANG_GUARD_SECONDS, TINY_VOCAB, StandIn, tiny_drafter, tiny_model, tiny_recurrent_head

EOS: frozenset[int] = frozenset()
GREEDY = SamplingConfig()
NEW_TOKENS = 3


def decoded(target: torch.nn.Module, drafter: Drafter, sampling: SamplingConfig, candidates: int = 1) -> list[int]:
    """One request's tokens, decoded alone."""
    decoder = BatchDecoder(target, drafter, EOS)
    decoder.add(0, PROMPTS[0], sampling, SpeculativeConfig(3, max_new_tokens=NEW_TOKENS, num_candidates=candidates))
    rounds = []
    while decoder.rows:
        for _, outcome in decoder.step():
            assert not isinstance(outcome, Exception), outcome
            rounds.append(outcome)
    return emitted_ids(rounds)


def first_failure(target: torch.nn.Module, drafter: Drafter, sampling: SamplingConfig) -> Exception | None:
    """A request's first failure, raised by a round (CaptureFailed) or its row's outcome (a drafter's failure)."""
    decoder = BatchDecoder(target, drafter, EOS)
    decoder.add(0, PROMPTS[0], sampling, SpeculativeConfig(3, max_new_tokens=NEW_TOKENS))
    try:
        while decoder.rows:
            for _, outcome in decoder.step():
                if isinstance(outcome, Exception):
                    return outcome
    except CaptureFailed as error:
        return error
    return None


@pytest.fixture
def fixed(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None]:
    """Fixed-shape passes; the returned function sets SPECDEMO_CUDA_GRAPHS."""
    monkeypatch.setenv(passes.PASS_SHAPE_VARIABLE, "fixed")
    return lambda value: monkeypatch.setenv(graphs.GRAPHS_VARIABLE, value)


def plant_a_host_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """The round program reads a value back to the host (`.item()`), which no CUDA graph can capture."""
    original = fixed_pass.decide_chains

    def reading(*args, **kwargs):
        found = original(*args, **kwargs)
        found[0].sum().item()
        return found

    monkeypatch.setattr(fixed_pass, "decide_chains", reading)


def test_under_strict_graphs_an_uncapturable_round_fails_the_run_naming_its_program(fixed, monkeypatch):
    """SPECDEMO_CUDA_GRAPHS=strict: a round program that reads a value back to the host fails the run with
    CaptureFailed, whose message names the program's key."""
    fixed("strict")
    plant_a_host_read(monkeypatch)
    with pytest.raises(
        CaptureFailed, match=r"\(\('round', \(\), False, False, False, True, False, 1, False, False\), 256\)"
    ) as failure:
        decoded(tiny_model(1, num_layers=1), NoDrafter(), GREEDY)
    assert "item() reads a value back to the host" in str(failure.value)


def test_without_strict_an_uncapturable_round_runs_eagerly_with_one_line_and_the_same_text(fixed, monkeypatch, caplog):
    """SPECDEMO_CUDA_GRAPHS=1, captures checked as strict checks them on a CPU: the same planted read falls back to
    eager rounds, with exactly one line in the log, and gives the text of eager rounds."""
    plant_a_host_read(monkeypatch)
    target = tiny_model(1, num_layers=1)
    fixed("0")
    eager = decoded(target, NoDrafter(), GREEDY)
    fixed("1")
    with graphs.standing_in(lambda run, inputs, memory: CheckedProgram(run, inputs)), caplog.at_level(logging.INFO):
        found = decoded(target, NoDrafter(), GREEDY)
    lines = [record.getMessage() for record in caplog.records if "without CUDA graphs" in record.getMessage()]
    assert found == eager
    assert len(lines) == 1 and "('round', (), False, False, False, True, False, 1, False, False)" in lines[0], lines
    assert pools_for(target).graphs_failed


class TwoCandidates:
    """Two deterministic candidates a round: W > 1, a round program of rows of several candidates."""

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        return [Draft([[5, 9], [3, 11]], None) for _ in requests]

    def forget(self, key: object) -> None:
        pass


def test_under_strict_graphs_every_program_kind_is_captured_once_and_replays(fixed):
    """Under strict graphs every program kind the CPU exercises is captured (checked: no read back to the host) at its
    first use and replayed after: the rounds greedy, sampled with top-k and top-p, with a repetition penalty, with a
    sampled draft's q (a draft model), with hidden states (the recurrent head, greedy and sampled), the head's greedy
    and sampled steps, the coupled rule's rounds (target-only, and a draft model's q with the match chances of its
    choices), and the round of rows of two candidates. A second request captures nothing more."""
    fixed("strict")
    target, draft = tiny_model(1, num_layers=1), tiny_model(2, num_layers=1)
    head = tiny_recurrent_head(target, 3)
    layers = head.shape.layers
    sampled = SamplingConfig(temperature=0.9, top_k=8, top_p=0.9, seed=3)
    penalty = SamplingConfig(temperature=0.9, repetition_penalty=1.3, seed=4)
    coupled = SamplingConfig(temperature=0.9, top_p=0.9, rule="coupled", seed=5)
    requests = [
        (NoDrafter, GREEDY, 1),
        (NoDrafter, sampled, 1),
        (NoDrafter, penalty, 1),
        (lambda: tiny_drafter("model", draft, None), sampled, 1),
        (lambda: tiny_drafter("recurrent", None, head), GREEDY, 1),
        (lambda: tiny_drafter("recurrent", None, head), sampled, 1),
        (NoDrafter, coupled, 1),
        (lambda: tiny_drafter("model", draft, None), coupled, 1),
        (TwoCandidates, GREEDY, 2),
    ]

    def all_requests() -> None:
        for make, sampling, candidates in requests:
            decoded(target, make(), sampling, candidates)

    all_requests()
    pools, steps = pools_for(target), steps_for(head, TINY_VOCAB)
    assert {mode for mode, _ in pools.captures} == {  # ..., width, drafts on the device, chains synced first
        ("round", (), False, False, False, True, False, 1, False, False),
        ("round", (), True, False, False, True, False, 1, False, False),
        ("round", (), True, True, False, True, False, 1, False, False),
        ("round", (), True, False, True, True, False, 1, True, False),  # the draft model's q and ids
        ("round", layers, False, False, False, True, False, 1, False, False),  # a row's first round: no hidden state
        ("round", layers, False, False, False, True, False, 1, True, False),  # the head's ids
        ("round", layers, True, False, False, True, False, 1, False, False),
        ("round", layers, True, False, True, True, False, 1, True, False),  # the head's q and ids
        ("round", (), True, False, False, True, True, 1, False, False),  # coupled
        ("round", (), True, False, True, True, True, 1, True, False),
        ("round", (), False, False, False, True, False, 2, False, False),  # two candidates a row
        ("round", (), False, False, False, True, False, 2, False, True),  # a chain row copying its path's slots
    }
    assert {(key[0], bucket, captured) for key, bucket, captured in steps.programs} == {
        ("greedy", 1, True),
        ("sampled", 1, True),
    }
    programs = [p for group in pools.groups for p in group.programs.values()] + list(steps.programs.values())
    assert all(isinstance(program, CheckedProgram) for program in programs)
    captures, head_programs = len(pools.captures), len(steps.programs)
    assert captures == 12 and not pools.graphs_failed
    all_requests()
    assert (len(pools.captures), len(steps.programs)) == (captures, head_programs)


class Watch:
    """While one capture is held open in its thread, the device work any other thread does: model forwards (a global
    forward pre-hook), host waits, captures."""

    def __init__(self) -> None:
        self.capturing: int | None = None  # the thread holding the capture open
        self.captured = threading.Event()  # the capture is held open
        self.intrusions: list[str] = []
        self.intruders: set[int] = set()  # threads that did device work beside the capture

    def saw(self, what: str) -> None:
        here = threading.get_ident()
        if self.capturing is not None and here != self.capturing:
            with DEVICE_WORK.changed:
                self.intrusions.append(f"{what} in {threading.current_thread().name}")
                self.intruders.add(here)
                DEVICE_WORK.changed.notify_all()

    def hold(self, others: int) -> None:
        """Keep the capture open until each of the `others` threads is blocked on DEVICE_WORK or has intruded."""
        self.capturing = threading.get_ident()
        self.captured.set()
        with DEVICE_WORK.changed:
            settled = DEVICE_WORK.changed.wait_for(
                lambda: DEVICE_WORK.waiting + len(self.intruders) >= others, timeout=HANG_GUARD_SECONDS
            )
        self.capturing = None
        assert settled, "hang guard, not a speed bound: the other threads neither waited for the lock nor intruded"


def watching(watch: Watch, monkeypatch: pytest.MonkeyPatch, others: int) -> type[StandIn]:
    """Host waits and captures reported to `watch`; the stand-in that holds the first capture open."""
    for module in (graphs, loading):
        for name in ("synchronize", "wait"):
            if hasattr(module, name):
                original = getattr(module, name)
                monkeypatch.setattr(module, name, lambda *a, _o=original, _n=name: (watch.saw(_n), _o(*a))[1])

    class HeldCapture(StandIn):
        def __init__(self, run, inputs, memory) -> None:
            watch.saw("a capture")
            super().__init__(run, inputs, memory)
            if not watch.captured.is_set():
                watch.hold(others)

    return HeldCapture


def test_no_other_threads_device_work_meets_a_capture(fixed, monkeypatch):
    """Thread 1's round captures its program and holds the capture open while a model is set up on the device (kernels
    warmed, round programs captured: what load_model and a ZeroGPU worker do), a scheduler's rounds run, and the pass
    costs for shared batches are measured, each in a thread of its own. Each of them waits for DEVICE_WORK: no forward,
    host wait or capture of theirs runs until the capture is done. Planted: warm_up without the lock."""
    fixed("1")
    watch = Watch()
    others = 3
    monkeypatch.setattr(scheduler, "batch_costs", lambda model, rows: model(torch.tensor([[5, 9]])))  # a pass
    hook = torch.nn.modules.module.register_module_forward_pre_hook(lambda module, args: watch.saw("a forward"))
    try:
        with graphs.standing_in(watching(watch, monkeypatch, others)):
            capturing = threading.Thread(
                target=decoded, args=(tiny_model(1, num_layers=1), NoDrafter(), GREEDY), name="capturing"
            )
            capturing.start()
            assert watch.captured.wait(HANG_GUARD_SECONDS), "hang guard: the first round did not capture"
            shared = Scheduler(tiny_model(3), NoDrafter(), EOS, Schedulers().models_lock)
            stream = shared.submit([DecodeRequest(PROMPTS[1], GREEDY, SpeculativeConfig(max_new_tokens=2))], 1e12)
            measured = LoadedModel("tiny", tiny_model(4), None, torch.device("cpu"))  # type: ignore[arg-type]
            set_up = tiny_model(2)
            workers = [
                threading.Thread(target=loading.set_up_on_device, args=(set_up, print), name="set-up"),
                threading.Thread(target=measure_for_sharing, args=(measured, print), name="pass costs"),
            ]
            for worker in workers:
                worker.start()
            for worker in [capturing, *workers]:
                worker.join(HANG_GUARD_SECONDS)
            assert sum(len(rounds) for rounds in stream.rounds(0.0)) == 2
    finally:
        hook.remove()
    assert watch.intrusions == [], f"device work beside a capture: {sorted(set(watch.intrusions))}"
    assert len(pools_for(set_up).captures) == 4  # its greedy and sampled rounds (views on, off), after the held one


class OutOfMemoryAtCapture(StandIn):
    """A capture that runs out of device memory `failures` times, then succeeds; only programs of `kind`."""

    failures = 0
    kind = "round"

    def __init__(self, run, inputs, memory) -> None:
        owner = getattr(getattr(run, "func", run), "__self__", None)  # a bound method, or a partial of one
        kind = "head" if type(owner).__name__ == "HeadSteps" else "round"
        if kind == OutOfMemoryAtCapture.kind and OutOfMemoryAtCapture.failures > 0:
            OutOfMemoryAtCapture.failures -= 1
            raise torch.OutOfMemoryError("CUDA out of memory (planted at capture)")
        super().__init__(run, inputs, memory)


def test_a_capture_out_of_memory_lets_idle_groups_go_and_tries_again(fixed):
    """A capture that runs out of memory once: the model's idle groups go, the capture is made on the second try, and
    the text is the eager text. Planted: the error re-raised (the row leaves with the memory sentence)."""
    target = tiny_model(1, num_layers=1)
    fixed("0")
    eager = decoded(target, NoDrafter(), GREEDY)
    fixed("1")
    idle = Group(1024)
    pools_for(target).give_back(idle)
    OutOfMemoryAtCapture.kind, OutOfMemoryAtCapture.failures, StandIn.captures = "round", 1, 0
    with graphs.standing_in(OutOfMemoryAtCapture):
        assert decoded(target, NoDrafter(), GREEDY) == eager
    assert StandIn.captures == 1 and len(pools_for(target).captures) == 1
    assert idle not in pools_for(target).idle


@pytest.mark.parametrize("kind", ["round", "head"])
def test_a_capture_out_of_memory_twice_runs_that_program_eagerly(fixed, caplog, kind: str):
    """A capture that always runs out of memory (a round's, or the recurrent head's steps'): after one retry each such
    program runs eagerly, with one line in the log for it, the run finishes with the eager text and the model stays
    usable; under strict graphs, CaptureFailed names the program and says out of memory (a round's fails the run; the
    head's, as any failure of a drafter, its row). Planted: the error re-raised."""
    target = tiny_model(1, num_layers=1)
    head = tiny_recurrent_head(target, 3)
    fixed("0")
    eager = decoded(target, tiny_drafter("recurrent", None, head), GREEDY)
    fixed("1")
    OutOfMemoryAtCapture.kind, OutOfMemoryAtCapture.failures = kind, 10**6
    with graphs.standing_in(OutOfMemoryAtCapture), caplog.at_level(logging.INFO):
        assert decoded(target, tiny_drafter("recurrent", None, head), GREEDY) == eager
        fixed("strict")
        failure = first_failure(target, tiny_drafter("recurrent", None, head), SamplingConfig(temperature=1.0, seed=1))
    lines = [record.getMessage() for record in caplog.records if "without CUDA graphs" in record.getMessage()]
    assert lines and len(set(lines)) == len(lines), lines  # one line for each program, which then runs eagerly
    assert all(f"capturing (('{kind}'" in line or f"capturing ('{kind}'" in line for line in lines), lines
    assert all("out of memory twice" in line for line in lines), lines
    assert not pools_for(target).graphs_failed
    assert f"Could not capture the program ('{kind}'" in str(failure) or f"(('{kind}'" in str(failure), failure
    assert "out of memory twice" in str(failure), failure
