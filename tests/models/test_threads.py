"""Fewer threads while the cores are crowded (models/threads.py): the governor drops a thread when its passes waited
for a core, takes it back when they did not, after a wait that doubles when a climb is undone; the rule runs on one
thread; a pass's logits on one thread are those on two, and a model whose are not keeps torch's count for its passes;
a sampled coupled run whose passes change their count writes the text of one that does not."""

from __future__ import annotations

import math
import weakref

import pytest
import torch

from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.core.rules import CoupledRule
from specdemo.drafters import NoDrafter
from specdemo.engine.decoding import BatchDecoder
from specdemo.engine.drafting import build_drafter
from specdemo.models import threads, tree_cache
from specdemo.models.threads import CROWDED, FIRST_WAIT, FREE, WINDOW_SECONDS, ThreadGovernor
from specdemo.models.tree_cache import TreeCachedModel, keeps_bits
from tests.helpers import tiny_model


class Machine:
    """A clock and a thread's wait for a core that the test moves: each pass lasts `seconds` and waits `share` of it."""

    def __init__(self) -> None:
        self.now = self.waited = 0.0
        self.share = 0.0
        self.seconds = 2 ** math.ceil(math.log2(WINDOW_SECONDS))  # a window a pass, in sums exact in binary

    def clock(self) -> float:
        return self.now

    def wait(self) -> float:
        return self.waited

    def run(self, governor: ThreadGovernor, share: float, passes: int = 1) -> list[int]:
        """Each pass's thread count, as torch reports it inside the pass."""
        seen = []
        for _ in range(passes):
            with governor.governing():
                seen.append(torch.get_num_threads())
                self.now += self.seconds
                self.waited += share * self.seconds
        return seen


@pytest.fixture
def two_threads(monkeypatch):
    """Torch on two threads for the test (a test worker runs on one), and no governor in this thread: both as they
    were after."""
    before = torch.get_num_threads()
    monkeypatch.setattr(threads._local, "governor", None, raising=False)
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_crowded_passes_drop_a_thread_and_free_ones_take_it_back_after_a_wait(two_threads):
    """Planted: a climb without the wait after a drop (the first free run climbs)."""
    machine = Machine()
    governor = ThreadGovernor(2, machine.wait, machine.clock)
    assert machine.run(governor, 2 * CROWDED, 2) == [2, 1]
    assert machine.run(governor, 0.0, 3) == [1, 1, 1]  # free, but within the wait after a drop
    machine.now += FIRST_WAIT
    assert machine.run(governor, 0.0, 2) == [1, 2]


def test_a_thread_crowded_a_little_stays_where_it_is(two_threads):
    machine = Machine()
    governor = ThreadGovernor(2, machine.wait, machine.clock)
    machine.run(governor, 1.0)
    machine.now += FIRST_WAIT
    assert machine.run(governor, (FREE + CROWDED) / 2, 30) == [1] * 30


def test_an_undone_climb_doubles_the_wait_and_a_held_one_resets_it(two_threads):
    """Planted: a wait that never doubles (the climb in the second free run), or that never resets (no climb in the
    last)."""
    machine = Machine()
    governor = ThreadGovernor(2, machine.wait, machine.clock)
    machine.run(governor, 1.0)  # dropped: a climb after FIRST_WAIT
    machine.now += FIRST_WAIT
    assert machine.run(governor, 0.0) == [1]  # climbs at its end
    assert machine.run(governor, 1.0) == [2]  # undone: the next climb after 2 * FIRST_WAIT
    machine.now += FIRST_WAIT
    assert machine.run(governor, 0.0, 2) == [1, 1]
    machine.now += FIRST_WAIT
    assert machine.run(governor, 0.0, 3) == [1, 2, 2]  # climbed, and held a window
    machine.run(governor, 1.0)  # dropped again: the first wait
    machine.now += FIRST_WAIT
    assert machine.run(governor, 0.0, 2) == [1, 2]


def test_a_window_is_passes_time_and_one_thread_is_the_floor(two_threads):
    """No decision before WINDOW_SECONDS of passes; never below one thread; no decision where the wait is unknown."""
    machine = Machine()
    machine.seconds = 1 / 32  # exact in binary: the window ends with the pass that reaches WINDOW_SECONDS
    first = math.ceil(WINDOW_SECONDS / machine.seconds)
    governor = ThreadGovernor(2, machine.wait, machine.clock)
    assert machine.run(governor, 1.0, first + 2) == [2] * first + [1, 1]
    assert machine.run(governor, 1.0, 20) == [1] * 20
    torch.set_num_threads(2)
    unknown = ThreadGovernor(2, lambda: None, machine.clock)
    assert machine.run(unknown, 1.0, 8) == [2] * 8


@pytest.fixture
def alternating(two_threads, monkeypatch):
    """This thread's governor on a machine where every pass ends a window, crowded and free in turn, and climbs never
    wait: passes alternate between one thread and two."""
    state = {"readings": 0, "waited": 0.0, "now": 0.0}

    def waited() -> float:
        state["readings"] += 1
        if state["readings"] % 2 == 0 and state["readings"] % 4 == 2:  # the end of every other pass
            state["waited"] += 900.0  # of the pass's 1,000 s
        return state["waited"]

    def clock() -> float:
        state["now"] += 1000.0
        return state["now"]

    monkeypatch.setattr(threads._local, "governor", ThreadGovernor(2, waited, clock), raising=False)
    return threads._local


def test_passes_change_their_count_and_the_rule_runs_on_one_thread(offline_bfloat16, alternating, monkeypatch):
    """The coupled rule's text on passes that alternate between one thread and two is the text of passes on two, and
    the rule always runs on one. Planted: the rule on the thread's count (it sees two)."""
    model = offline_bfloat16.model
    counts: dict[str, list[int]] = {"pass": [], "rule": []}
    handle = model.register_forward_pre_hook(lambda *_: counts["pass"].append(torch.get_num_threads()))
    decide_rows = tree_cache.decide_rows

    def counted(*args: object) -> object:
        counts["rule"].append(torch.get_num_threads())
        return decide_rows(*args)

    monkeypatch.setattr(tree_cache, "decide_rows", counted)
    prompt = offline_bfloat16.tokenizer("Name three rivers of Europe and one fact about each.")["input_ids"]
    sampling, spec = SamplingConfig(temperature=1.0, rule="coupled", seed=5), SpeculativeConfig(max_new_tokens=24)
    try:
        governed = text(model, build_drafter("suffix", offline_bfloat16), prompt, sampling, spec)
    finally:
        handle.remove()
    monkeypatch.setenv(threads.VARIABLE, "0")
    assert text(model, NoDrafter(), prompt, sampling, spec) == governed
    assert set(counts["pass"]) == {1, 2} and set(counts["rule"]) == {1}


def text(model: torch.nn.Module, drafter, prompt: list[int], sampling: SamplingConfig, spec) -> list[int]:
    decoder = BatchDecoder(model, drafter, frozenset(), rule=CoupledRule())
    decoder.add(0, prompt, sampling, spec)
    out: list[int] = []
    while decoder.rows:
        for _key, outcome in decoder.step():
            assert not isinstance(outcome, Exception), outcome
            out.extend(outcome.emitted_token_ids)
    return out


def test_a_pass_on_one_thread_gives_the_logits_it_gets_on_two(invariant_model, two_threads, monkeypatch):
    """keeps_bits holds for the offline model in both formats that keep a row's bits, and catches a model whose logits
    depend on the thread count (a planted head that adds it)."""
    assert keeps_bits(invariant_model.model)
    head = invariant_model.model.lm_head
    forward = head.forward

    def summing(x: torch.Tensor) -> torch.Tensor:  # as a row's sum split among the threads would, in every bit
        return forward(x) + torch.get_num_threads()

    monkeypatch.setattr(head, "forward", summing)
    assert not keeps_bits(invariant_model.model)


def test_a_model_whose_bits_differ_keeps_torchs_count(tiny_target, tiny_draft, two_threads, monkeypatch):
    """Each model is asked once; one whose bits differ, or that was never asked, runs its passes on torch's count beside
    one whose do not. Planted: the answer ignored (its passes run on one thread), and a model not asked taken as one
    that keeps its bits."""
    asked: list[torch.nn.Module] = []
    monkeypatch.setattr(threads, "_keeps_bits", weakref.WeakKeyDictionary())  # other tests' answers kept apart
    machine = Machine()
    monkeypatch.setattr(threads._local, "governor", ThreadGovernor(2, machine.wait, machine.clock), raising=False)

    def keeps(model: torch.nn.Module) -> bool:
        asked.append(model)
        return model is tiny_draft

    for model in (tiny_target, tiny_draft, tiny_target):
        threads.check(model, keeps)
    never_asked = tiny_model(seed=3)
    seen = []
    for model in (tiny_target, tiny_target, tiny_draft, tiny_target, tiny_draft, never_asked):
        with threads.governed(model):
            seen.append(torch.get_num_threads())
            machine.now += machine.seconds
            machine.waited += machine.seconds  # crowded: a drop after the first pass
    assert seen == [2, 2, 1, 2, 1, 2]
    assert asked == [tiny_target, tiny_draft]


def test_a_model_is_checked_as_its_first_cache_starts_where_its_passes_may_drop(tiny_target, two_threads, monkeypatch):
    """On two threads TreeCachedModel asks once; on one, or with the governor off, never."""
    monkeypatch.setattr(threads, "_keeps_bits", weakref.WeakKeyDictionary())
    asked = []
    monkeypatch.setattr(tree_cache, "keeps_bits", lambda model: asked.append(model) or True)
    TreeCachedModel(tiny_target)
    TreeCachedModel(tiny_target)
    assert asked == [tiny_target]
    other = tiny_model(seed=4)
    monkeypatch.setenv(threads.VARIABLE, "0")
    TreeCachedModel(other)
    monkeypatch.delenv(threads.VARIABLE)
    torch.set_num_threads(1)
    TreeCachedModel(other)
    assert asked == [tiny_target]
