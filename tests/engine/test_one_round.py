"""One Round builder: the same rows decoded through tree passes and through fixed-shape passes (the GPU's, forced on
the CPU, its round program run eagerly) give the same Rounds, field by field (timings aside; floats to 1e-5, since
the two passes may sum in other orders), whatever decided them: greedy, sampled and coupled rows, one and three
candidates, an EOS inside a draft, a drafter that fails on one row, a row cut by max_new_tokens. Coupled rows of three
fixed-token candidates (prompt lookup, the suffix drafter) run in the round program on the fixed-shape path, no
round of theirs decided by the eager rule."""

# K = num_draft_tokens, W = num_candidates

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Hashable

import pytest
import torch

from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.core.eager_round import decide_rows
from specdemo.core.rounds import Round
from specdemo.drafters.base import Draft, Drafter, DraftRequest
from specdemo.engine.decoding import BatchDecoder, DrafterFailed
from specdemo.models import graphs, passes, tree_cache
from tests.engine.test_batch import PROMPTS
from tests.helpers import tiny_drafter, tiny_model, tiny_recurrent_head

# Not compared: the timings, and the tokens each pass shape reads (a fixed-shape chain reads its row's last token
# again for each candidate)
UNCOMPARED = {"draft_seconds", "verify_seconds", "other_seconds", "forward_seconds", "num_input_tokens"}
SAMPLED = SamplingConfig(temperature=0.9, top_p=0.9, repetition_penalty=1.2, seed=3)
COUPLED = SamplingConfig(temperature=0.9, top_p=0.9, seed=5, rule="coupled")


class Failing:
    """The drafter it wraps, raising for row 1 once it has emitted four tokens."""

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        if any(r.key == 1 and len(r.sequence_ids) > len(PROMPTS[1]) + 4 for r in requests):
            raise RuntimeError("row 1's drafter broke")
        return self.drafter.propose(requests)

    def forget(self, key: Hashable) -> None:
        self.drafter.forget(key)


@pytest.fixture(scope="module")
def models():
    target, draft = tiny_model(1), tiny_model(2)
    return target, draft, tiny_recurrent_head(target, 3)


def case_drafter(kind: str, models) -> Drafter:
    target, draft, head = models
    if kind == "two":
        return TwoCandidates(target)
    if kind == "self":  # the target as its own draft model: every draft is the target's text, and accepted
        return tiny_drafter("model", tiny_model(1), None)
    if kind == "failing":
        return Failing(tiny_drafter("model", draft, None))
    return tiny_drafter(kind, draft, head)


# id: (drafter kind, sampling, K, W, EOS ids, max_new_tokens)
CASES = {
    "greedy-w1": ("model", SamplingConfig(), 4, 1, frozenset(), 20),
    "sampled-w1": ("model", SAMPLED, 4, 1, frozenset(), 20),
    "coupled-w1": ("model", COUPLED, 4, 1, frozenset(), 20),
    "greedy-w3": ("recurrent", SamplingConfig(), 4, 3, frozenset(), 20),
    "sampled-w3": ("recurrent", SAMPLED, 4, 3, frozenset(), 20),
    "coupled-w3": ("recurrent", COUPLED, 4, 3, frozenset(), 20),
    "coupled-w3-lookup": ("ngram", COUPLED, 4, 3, frozenset(), 20),
    "coupled-w3-suffix": ("suffix", COUPLED, 4, 3, frozenset(), 20),
    "eos-in-draft": ("model", SamplingConfig(), 4, 1, frozenset({1}), 30),  # a row accepts a drafted EOS
    "eos-mid-draft": ("self", SamplingConfig(), 4, 1, frozenset({7}), 20),  # see the test below
    "drafter-fails": ("failing", SAMPLED, 4, 1, frozenset(), 20),
    "max-new-tokens": ("ngram", SamplingConfig(), 8, 1, frozenset(), 7),
    "shorter-path-w2": ("two", SamplingConfig(), 2, 2, frozenset(), 12),  # see the test below
}
IN_PROGRAM = {"coupled-w3-lookup", "coupled-w3-suffix"}  # every fixed-shape round decided in the round program


def rounds_on(
    shape: str, monkeypatch: pytest.MonkeyPatch, make: Callable[[], Drafter], case: tuple
) -> list[tuple[Hashable, Round | Exception]]:
    """Every (row, outcome) of three rows decoded together through `shape` passes."""
    _, sampling, depth, width, eos, new_tokens = case
    monkeypatch.setenv(passes.PASS_SHAPE_VARIABLE, shape)
    monkeypatch.setenv(graphs.GRAPHS_VARIABLE, "0")
    decoder = BatchDecoder(tiny_model(1), make(), eos)
    spec = SpeculativeConfig(num_draft_tokens=depth, num_candidates=width, max_new_tokens=new_tokens)
    for key, prompt in enumerate(PROMPTS[:3]):
        decoder.add(key, prompt, dataclasses.replace(sampling, seed=sampling.seed + key), spec)
    outcomes = []
    while decoder.rows:
        outcomes += decoder.step()
    return outcomes


def assert_same(tree: object, fixed: object, where: str) -> None:
    """Equal field by field: numbers within 1e-5, everything else exactly."""
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        assert type(tree) is type(fixed), where
        for spec in dataclasses.fields(tree):
            if spec.name not in UNCOMPARED:
                assert_same(getattr(tree, spec.name), getattr(fixed, spec.name), f"{where}.{spec.name}")
    elif isinstance(tree, list | tuple):
        assert isinstance(fixed, list | tuple) and len(tree) == len(fixed), f"{where}: {tree} against {fixed}"
        for i, (a, b) in enumerate(zip(tree, fixed, strict=True)):
            assert_same(a, b, f"{where}[{i}]")
    elif isinstance(tree, float) and not isinstance(fixed, bool):
        assert math.isclose(tree, fixed, rel_tol=1e-5, abs_tol=1e-6), f"{where}: {tree} against {fixed}"
    elif isinstance(tree, Exception):
        assert type(tree) is type(fixed) and str(tree) == str(fixed), f"{where}: {tree!r} against {fixed!r}"
    else:
        assert tree == fixed, f"{where}: {tree!r} against {fixed!r}"


@pytest.mark.parametrize("name", list(CASES))
def test_tree_and_fixed_shape_passes_build_the_same_rounds(models, monkeypatch, name):
    """Planted: the old fixed-shape "resampled" rule (accepted < len(the path's tokens)) in the fixed-shape path alone,
    which names a rejection past the end of a shorter accepted candidate a bonus, fails shorter-path-w2;
    FixedShapeModel.in_program refusing coupled rows of several candidates fails coupled-w3-lookup and -suffix (their
    rounds then go to the eager rule); a draft left on the device (the draft model's, on the fixed-shape path) not cut
    after its EOS in the round program (fixed_pass.with_device_ids) fails eos-mid-draft, where row 2 drafts its greedy
    text, EOS (7) second of four."""
    case = CASES[name]
    make = functools.partial(case_drafter, case[0], models)  # a fresh drafter for each run
    tree = rounds_on("tree", monkeypatch, make, case)
    eager: list[int] = []  # rows the fixed-shape path decided by the eager rule, per call

    def counted(asks: list, logits: list) -> list:
        eager.append(len(asks))
        return decide_rows(asks, logits)

    monkeypatch.setattr(tree_cache, "decide_rows", counted)
    fixed = rounds_on("fixed", monkeypatch, make, case)
    assert [key for key, _ in tree] == [key for key, _ in fixed]
    assert_same(tree, fixed, name)
    rounds = [o for _, o in tree if isinstance(o, Round)]
    if name in IN_PROGRAM:
        assert not eager and max(c.num_alive for r in rounds for c in r.coupled) > 1, (eager, rounds)
    kinds = {r.next_kind for r in rounds}
    unrejected = {"max-new-tokens", "eos-mid-draft"}  # every draft accepted to its end
    assert len(rounds) > 6 and "resampled" in kinds | ({"resampled"} if name in unrejected else set())
    if name == "drafter-fails":
        assert sum(isinstance(o, DrafterFailed) for _, o in tree) == 1
    if name == "eos-in-draft":
        assert any(r.next_token_id is None for r in rounds)  # an accepted EOS ended a row
    if name == "eos-mid-draft":  # cut after its EOS and accepted to it: no next token
        assert any(r.draft_token_ids == [0, 7] and r.num_accepted == 2 and r.next_token_id is None for r in rounds)
    if name == "max-new-tokens":
        assert all(sum(len(r.emitted_token_ids) for k2, r in tree if k2 == key) == 7 for key in range(3))


class TwoCandidates:
    """Candidates [a] and [a, b]: a the target's greedy token, b never its next one."""

    def __init__(self, target: torch.nn.Module) -> None:
        self.target = target

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        drafts = []
        for request in requests:
            with torch.no_grad():
                logits = self.target(torch.tensor([request.sequence_ids])).logits[0, -1]
            first = int(logits.argmax())
            drafts.append(Draft([[first], [first, int(logits.argmin())]], None))
        return drafts

    def forget(self, key: Hashable) -> None:
        pass


def test_a_rejection_past_the_end_of_the_accepted_candidate_is_a_resample(monkeypatch):
    """W = 2 greedy: [a] and [a, b] both accept a, then b is tested and rejected. The path is [a] (the first of the
    longest), accepted to its end, yet the next token answers a rejection: "resampled". Planted: the old
    fixed-shape rule (accepted < len(the path's tokens)) names it "bonus"."""
    monkeypatch.setenv(passes.PASS_SHAPE_VARIABLE, "tree")
    target = tiny_model(1)
    decoder = BatchDecoder(target, TwoCandidates(target), frozenset())
    decoder.add(0, PROMPTS[0], SamplingConfig(), SpeculativeConfig(num_draft_tokens=2, num_candidates=2))
    [(_, round_)] = decoder.step()
    assert (round_.path, round_.num_accepted, round_.next_kind) == (0, 1, "resampled")
