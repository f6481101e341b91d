"""A race: one prompt decoded at once by the target alone and by several drafters, each lane a row of one batch with
the same settings and seed, so the lanes share the target's passes (one clock, one GPU call) and, under greedy
decoding or the coupled rule, write the same text. core/race.py prices each lane as it would run alone."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch

from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.core.planning import PassCosts
from specdemo.core.race import TARGET_LANE, LaneFigures, RaceCosts, lane_figures
from specdemo.core.rounds import Round
from specdemo.drafters.base import Draft, Drafter, DraftRequest, NoDrafter, hidden_layers, reads_hidden_state
from specdemo.drafters.head_file import head_path
from specdemo.drafters.registry import DRAFTER_KINDS, HYBRID, RECURRENT
from specdemo.engine.costs import MEASURED_SIZES, measure_pass_seconds
from specdemo.engine.decoding import BatchDecoder, DrafterFailed
from specdemo.engine.drafting import build_drafter
from specdemo.models.loading import LoadedModel
from specdemo.pairs import Pair

DRAFT_LANE = "draft"  # the pair's draft model
MAX_LANES = 6  # the target lane and up to five drafters: every kind here and a draft model
HEAD_KINDS = (RECURRENT, HYBRID)  # kinds that need a recurrent head trained for the target


def lane_choices(pair: Pair) -> list[str]:
    """Every lane the pair's target can race: the target alone, each model-free kind it has what it needs for, and
    the pair's draft model if it has one."""
    kinds = [kind for kind in DRAFTER_KINDS if kind not in HEAD_KINDS or head_path(pair.target).is_file()]
    return [TARGET_LANE, *kinds, *([DRAFT_LANE] if pair.uses_draft_model else [])]


def check_lanes(lanes: str | Sequence[str], pair: Pair) -> list[str]:
    """The race's lanes, the target lane first (added if missing), from a list or a comma-separated string; a
    ValueError names the problem in one sentence, before any model loads."""
    names = [name.strip() for name in lanes.split(",")] if isinstance(lanes, str) else [str(n).strip() for n in lanes]
    names = [name for name in names if name]
    choices = lane_choices(pair)
    drafters = [name for name in names if name != TARGET_LANE]
    if not drafters:
        raise ValueError(
            f"The race has no drafter lanes: name at least one of {', '.join(choices[1:])} (comma-separated), to "
            "race against the target alone."
        )
    if len(drafters) + 1 > MAX_LANES:
        raise ValueError(
            f"The race has {len(drafters) + 1} lanes with the target's; at most {MAX_LANES} race at once: drop "
            f"{len(drafters) + 1 - MAX_LANES}."
        )
    for name in drafters:
        if name in choices:
            continue
        if name in HEAD_KINDS:
            raise ValueError(
                f"The lane '{name}' needs a recurrent head trained for {pair.target}, and none is here: drop it, "
                f"or train one with `python -m specdemo train-drafter --target {pair.target}`."
            )
        if name == DRAFT_LANE:
            raise ValueError(
                f"The lane '{DRAFT_LANE}' races the pair's draft model, and {pair.key} has none: drop it, or pick a "
                "pair with a draft model (smollm2-135m-self offline)."
            )
        raise ValueError(f"'{name}' is not a lane this pair can race: choose among {', '.join(choices)}.")
    if len(set(drafters)) < len(drafters):
        raise ValueError("A lane is named twice: name each drafter once.")
    return [TARGET_LANE, *drafters]


class LaneDrafter:
    """Each row drafts with its own lane's drafter (the target lane's row drafts nothing). Each lane's drafting time
    is kept apart, since the engine times a round's drafting for all rows at once; a lane whose drafter fails drafts
    nothing that round and is kept in `failed`, so the other lanes' drafters are asked once, as alone."""

    def __init__(self, drafters: Mapping[Hashable, Drafter]) -> None:
        self.drafters = dict(drafters)
        layers = {hidden_layers(d) for d in self.drafters.values() if reads_hidden_state(d)}
        assert len(layers) <= 1, f"lanes read different hidden layers: {layers}"
        self.reads_hidden_state = bool(layers)
        self.hidden_layers = next(iter(layers), ())
        self.seconds: dict[Hashable, float] = dict.fromkeys(self.drafters, 0.0)
        self.failed: dict[Hashable, Exception] = {}

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        drafts = []
        for request in requests:
            started = time.perf_counter()
            try:
                [draft] = self.drafters[request.key].propose([request])
            except torch.OutOfMemoryError:
                raise  # the device's, not the lane's
            except Exception as error:
                self.failed[request.key], draft = DrafterFailed(error), Draft([], None)
            self.seconds[request.key] += time.perf_counter() - started
            drafts.append(draft)
        return drafts

    def forget(self, key: Hashable) -> None:
        if key in self.drafters:
            self.drafters[key].forget(key)


@dataclass
class LaneRun:
    """One lane as the race goes: its rounds, its drafting time and, if its drafter failed, the sentence."""

    name: str
    rounds: list[Round] = field(default_factory=list)
    drafting_seconds: float = 0.0
    error: str | None = None
    done: bool = False

    def figures(self, costs: RaceCosts) -> LaneFigures:
        return lane_figures(self.name, self.rounds, costs, self.drafting_seconds, self.error)


def race_costs(
    target: LoadedModel, prompt_ids: Sequence[int], speculative: SpeculativeConfig, sampling: SamplingConfig
) -> RaceCosts:
    """What a lane's passes cost alone, measured as the race starts, on rows with its sampling settings (a sampled
    round also computes probabilities and draws): t(n) for passes up to the widest draft a lane reads, and the first
    pass of the prompt alone, the fastest of two after a warm-up. The machine's speed now, not at load (a machine that
    slowed since would price every lane low): about two seconds on this CPU."""
    widest = speculative.num_candidates * speculative.num_draft_tokens + 1
    largest = next((size for size in MEASURED_SIZES if size >= widest), MEASURED_SIZES[-1])
    sizes = tuple(size for size in MEASURED_SIZES if size <= largest)
    passes = PassCosts.from_seconds(measure_pass_seconds(target.model, sizes, sampling=sampling))
    return RaceCosts(passes, len(prompt_ids), first_pass_seconds(target, prompt_ids, sampling))


def first_pass_seconds(
    target: LoadedModel, prompt_ids: Sequence[int], sampling: SamplingConfig, repeats: int = 2
) -> float:
    """The first round of the prompt's row alone, which reads the prompt: the fastest of `repeats` after a warm-up."""
    seconds = []
    for _ in range(repeats + 1):
        decoder = BatchDecoder(target.model, NoDrafter(), target.eos_token_ids)
        decoder.add(0, list(prompt_ids), sampling, SpeculativeConfig(max_new_tokens=1))  # it leaves after its round
        started = time.perf_counter()
        outcomes = decoder.step()
        seconds.append(time.perf_counter() - started)
        assert not any(isinstance(outcome, Exception) for _, outcome in outcomes), outcomes
    return min(seconds[1:])


def race(
    target: LoadedModel,
    draft: LoadedModel | None,
    lanes: Sequence[str],
    prompt_ids: Sequence[int],
    sampling: SamplingConfig,
    speculative: SpeculativeConfig,
    options: Mapping[str, object] | None = None,  # a kind's options by kind; a kind not named takes its defaults
    each_round: Callable[[], AbstractContextManager] = contextlib.nullcontext,  # held around each round: a lock
) -> Iterator[list[LaneRun]]:
    """Decode the prompt in every lane (check_lanes' names) as rows of one batch, one round of every unfinished lane
    per target pass; yields the lanes after each pass. A lane whose drafter fails stops with its sentence and the
    others go on, as does one whose drafter cannot be built for the target; a failure of the shared target pass is
    raised. No lane's draft is cut for the shared pass, so each drafts as it would alone."""
    options = options or {}
    runs = [LaneRun(name) for name in lanes]
    drafters = {}
    for index, name in enumerate(lanes):
        if name == TARGET_LANE:
            continue
        try:  # DRAFT_LANE, no kind's name, builds the draft model's drafter
            drafters[index] = build_drafter(name, target, draft, options.get(name))
        except ValueError as error:  # a head trained for other weights, say: the lane stops before it starts
            runs[index].error, runs[index].done = str(error), True
    router = LaneDrafter(drafters)
    decoder = BatchDecoder(target.model, router, target.eos_token_ids)
    for index, name in enumerate(lanes):
        if not runs[index].done:
            decoder.add(index, list(prompt_ids), sampling, speculative, drafting=name != TARGET_LANE)
    while decoder.rows:
        with each_round():
            outcomes = decoder.step()
        for index, outcome in outcomes:
            failure = router.failed.pop(index, None) or (outcome if isinstance(outcome, Exception) else None)
            if failure is not None:  # the round it drafted nothing in is not its own: it stops before it
                if index in decoder.rows:
                    decoder.remove(index)
                runs[index].error = str(failure)
            else:
                runs[index].rounds.append(outcome)
        for index, run in enumerate(runs):
            run.drafting_seconds = router.seconds.get(index, 0.0)
            run.done = run.done or index not in decoder.rows
        yield runs
