"""A new drafter kind is one module and one registry line: this file's RepeatDrafter stands in for the module, and the
registry line below is all it takes for its options to become command-line flags and page controls, for the
scheduler to build it with the options a run asked for, and for runs to decode with it. The diff of adding it for real:

    specdemo/drafters/repeat.py   (new: RepeatOptions and RepeatDrafter, as below)
    specdemo/drafters/registry.py
    +        DrafterKind("repeat", "repeat", "repeats the last token", RepeatOptions,
    +                    lambda options, context: RepeatDrafter(options.repeat_times)),
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass

import pytest
import torch

from specdemo.app import form
from specdemo.cli.main import build_parser
from specdemo.config import SamplingConfig, SpeculativeConfig, check_settings, setting
from specdemo.core.stats import emitted_ids
from specdemo.drafters.base import Draft, DrafterKind, DraftRequest
from specdemo.drafters.registry import DRAFTER_KINDS, drafter_options, option_kinds
from specdemo.engine.scheduler import DecodeRequest, Schedulers
from specdemo.models.loading import LoadedModel


@dataclass(frozen=True)
class RepeatOptions:
    repeat_times: int = setting(
        2,
        "repeat-times",
        low=1,
        high=6,
        whole=True,
        label="Copies of the last token",
        help="repeat: how many copies of the last token",
    )

    def __post_init__(self) -> None:
        check_settings(self)


class RepeatDrafter:
    """Proposes the last token again, `times` times (a one-hot draft, so the rule stays exact)."""

    def __init__(self, times: int) -> None:
        self.times = times

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        return [Draft([[r.sequence_ids[-1]] * min(self.times, r.num_draft_tokens)], None) for r in requests]

    def forget(self, key: Hashable) -> None:
        pass


REPEAT = DrafterKind(  # the registry line
    "repeat",
    "repeat",
    "repeats the last token",
    RepeatOptions,
    lambda options, context: RepeatDrafter(options.repeat_times),
)


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(DRAFTER_KINDS, "repeat", REPEAT)


def test_its_options_become_flags_and_page_controls(registered):
    assert option_kinds()["repeat_times"] is REPEAT
    args = build_parser().parse_args(["generate", "--prompt", "hi", "--draft", "repeat", "--repeat-times", "4"])
    assert args.repeat_times == 4
    control = form.run_setting("repeat_times")
    assert (control.name, control.default, control.high, control.kind, control.section) == (
        "repeat_times",
        2,
        6,
        "repeat",
        "drafter",
    )
    assert drafter_options("repeat", {"repeat_times": 3}) == RepeatOptions(3)
    with pytest.raises(ValueError, match="repeat-times must be between 1 and 6, got 9"):
        drafter_options("repeat", {"repeat_times": 9})


def test_the_scheduler_builds_it_with_the_options_a_run_asked_for(registered, tiny_target):
    target = LoadedModel("tiny", tiny_target, None, torch.device("cpu"))  # no tokenizer: the ids are the text
    schedulers = Schedulers()
    prompt = [0, 5, 9, 9, 9, 9]
    spec = SpeculativeConfig(num_draft_tokens=4, max_new_tokens=12)
    outputs = {}
    for times in (1, 3):
        scheduler = schedulers.get(target, None, "repeat", RepeatOptions(times))
        assert isinstance(scheduler.decoder.drafter, RepeatDrafter) and scheduler.decoder.drafter.times == times
        stream = scheduler.submit([DecodeRequest(prompt, SamplingConfig(), spec)], time.monotonic() + 60)
        rounds = [round_ for batch in stream.rounds(0.01) for round_ in batch]
        assert all(len(r.draft_token_ids) <= times for r in rounds)
        outputs[times] = emitted_ids(rounds)
    assert outputs[1] == outputs[3]  # greedy: the drafter changes the rounds, never the tokens
