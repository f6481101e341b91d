"""The recurrent head's programs are kept per head, not per drafter: every drafter and request drafting with one head
replays the programs its first use captured (drafters/head_steps.py's steps_for)."""

from __future__ import annotations

import pytest

from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.core.stats import emitted_ids
from specdemo.drafters.head_steps import HeadSteps, steps_for
from specdemo.engine.decoding import BatchDecoder
from specdemo.models import graphs, passes
from tests.engine.test_batch import PROMPTS
from tests.helpers import TINY_VOCAB, StandIn, tiny_drafter, tiny_model, tiny_recurrent_head


class HeadCaptures(StandIn):
    """A stand-in capture that counts the head's programs among the captures."""

    count = 0

    def __init__(self, run, inputs, memory) -> None:
        super().__init__(run, inputs, memory)
        HeadCaptures.count += isinstance(getattr(getattr(run, "func", run), "__self__", None), HeadSteps)


def test_two_hybrid_runs_of_two_requests_capture_the_heads_programs_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two hybrid drafters on one head (two runs), each decoding two requests, greedy and sampled, on the GPU's path
    with stand-in captures: the head's programs are captured during the first run's requests, and the second run,
    with a drafter of its own, captures none and gives the same text. Planted: a HeadSteps per drafter."""
    monkeypatch.setenv(passes.PASS_SHAPE_VARIABLE, "fixed")
    monkeypatch.setenv(graphs.GRAPHS_VARIABLE, "1")
    target = tiny_model(1, num_layers=1)
    head = tiny_recurrent_head(target, 3)
    settings = [SamplingConfig(), SamplingConfig(temperature=1.0, seed=5)]

    def run() -> list[list[int]]:
        drafter = tiny_drafter("hybrid", None, head)
        texts = []
        for sampling in settings:
            decoder = BatchDecoder(target, drafter, frozenset())
            decoder.add(0, PROMPTS[0], sampling, SpeculativeConfig(3, max_new_tokens=5))
            rounds = []
            while decoder.rows:
                rounds += [round_ for _, round_ in decoder.step()]
            texts.append(emitted_ids(rounds))
        return texts

    HeadCaptures.count = 0
    with graphs.standing_in(HeadCaptures):
        first = run()
        captured = HeadCaptures.count
        again = run()
    assert HeadCaptures.count == captured, f"the second run captured {HeadCaptures.count - captured} head programs"
    kinds = {key[0] for key, _, _ in steps_for(head, TINY_VOCAB).programs}
    assert kinds == {"greedy", "sampled"} and captured == len(steps_for(head, TINY_VOCAB).programs)
    assert again == first
