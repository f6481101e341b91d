"""A row whose numbers overflow (Qwen2 in float16 writes "!!!!", the argmax of NaN logits) ends with one sentence that
names the format and the way forward, and the other rows of the batch go on with exactly the text they write alone:
on tree passes and on the GPU's one-program rounds dry-run on the CPU, for target-only rows, one candidate, three,
the coupled rule and a sampled draft model's q. The overflow is planted: from the pass that feeds position
OVERFLOW_AT on, the row's hidden state there is inf, so its keys and values at that slot, and every logit after, are
NaN, as a float16 overflow leaves them."""

# B = rows, K = num_draft_tokens, W = num_candidates

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from transformers import PreTrainedModel

from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.core.rounds import Round
from specdemo.core.stats import emitted_ids
from specdemo.drafters.base import Drafter
from specdemo.engine.decoding import BatchDecoder, NonFiniteLogits
from specdemo.models import graphs, passes
from tests.helpers import StandIn, tiny_drafter, tiny_model

EOS: frozenset[int] = frozenset()
OVERFLOW_AT = 19  # the position whose hidden state overflows; only the failing row reaches it
FAILING = 2
ROWS = {  # row: prompt, settings, max_new_tokens; rows 0, 1 and 3 never feed a position past 17
    0: ([0, 5, 9, 5, 9, 12, 7, 5, 9], SamplingConfig(), 9),
    1: ([0, 3], SamplingConfig(temperature=1.0, top_k=10, seed=1), 9),
    FAILING: ([0, 10, 19, 5, 21, 5, 13, 13, 21, 4, 4, 7, 4, 4], SamplingConfig(temperature=0.8, seed=2), 20),
    3: ([0, 8, 8, 8], SamplingConfig(temperature=1.2, top_p=0.9, seed=3), 9),  # joins when the failing row has left
}
# The failing row's p is NaN from the generated token after OVERFLOW_AT on, and from the first token of the round that
# feeds OVERFLOW_AT: its other columns meet the NaN values at a masked slot (0 * NaN), as a float16 overflow's do.
LAST_FINITE = OVERFLOW_AT + 1 - len(ROWS[FAILING][0])
CASES = {  # drafter kind, num_candidates, rule
    "target-only": ("none", 1, "standard"),
    "chain": ("ngram", 1, "standard"),
    "three-candidates": ("model", 3, "standard"),
    "coupled": ("model", 3, "coupled"),
}


@contextmanager
def overflowing(model: PreTrainedModel, position: int) -> Iterator[None]:
    """Every pass that feeds `position` writes inf as its hidden state there (the embedding's output): what a float16
    overflow leaves, NaN in that slot's keys and values and in every logit read after it."""
    fed: dict[str, torch.Tensor] = {}

    def positions(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        fed["positions"] = kwargs["position_ids"]

    def embedded(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return output.masked_fill((fed["positions"] == position)[..., None], float("inf"))

    hooks = [
        model.register_forward_pre_hook(positions, with_kwargs=True),
        model.get_input_embeddings().register_forward_hook(embedded),
    ]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


@pytest.fixture(params=["tree", "fixed"])
def pass_shape(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Tree passes (the CPU's), or the GPU's path: fixed shapes, one-candidate rounds one program (a stand-in)."""
    monkeypatch.setenv(passes.PASS_SHAPE_VARIABLE, request.param)
    monkeypatch.setenv(graphs.GRAPHS_VARIABLE, "1")
    with graphs.standing_in(StandIn):
        yield request.param


def settings(row: int, num_candidates: int, rule: str) -> tuple[list[int], SamplingConfig, SpeculativeConfig]:
    prompt, sampling, limit = ROWS[row]
    sampling = SamplingConfig(**{**vars(sampling), "rule": rule})
    return prompt, sampling, SpeculativeConfig(num_draft_tokens=4, max_new_tokens=limit, num_candidates=num_candidates)


def batched(
    target: PreTrainedModel, drafter: Callable[[], Drafter], num_candidates: int, rule: str
) -> dict[int, list[Round | Exception]]:
    """Rows 0, 1 and the failing row together; row 3 joins at the round after the failing row leaves."""
    decoder = BatchDecoder(target, drafter(), EOS)
    for row in (0, 1, FAILING):
        decoder.add(row, *settings(row, num_candidates, rule))
    outcomes: dict[int, list[Round | Exception]] = {row: [] for row in ROWS}
    while decoder.rows:
        for row, outcome in decoder.step():
            outcomes[row].append(outcome)
        if FAILING not in decoder.rows and 3 not in decoder.rows and not outcomes[3]:
            decoder.add(3, *settings(3, num_candidates, rule))
    return outcomes


def alone(target: PreTrainedModel, drafter: Drafter, row: int, num_candidates: int, rule: str) -> list[int]:
    decoder = BatchDecoder(target, drafter, EOS)
    decoder.add(row, *settings(row, num_candidates, rule))
    rounds = []
    while decoder.rows:
        rounds += [outcome for _, outcome in decoder.step()]
    return emitted_ids(rounds)


@pytest.mark.parametrize("case", CASES)
def test_an_overflowing_row_ends_with_the_sentence_and_the_others_write_their_own_text(
    pass_shape: str, case: str
) -> None:
    """The failing row's last outcome is the sentence, at the generated token whose p was NaN, after the tokens it
    writes without the overflow; rows 0 and 1 beside it, and row 3 in the place it left, write what they write alone.
    Planted: the device's check or the eager one removed, the device's read from the wrong row; a chain row or a tree
    cache row let go with its NaN (row 3 ends with the sentence at its first token)."""
    kind, num_candidates, rule = CASES[case]
    target, draft = tiny_model(1), tiny_model(2, num_layers=1)

    def drafter() -> Drafter:
        return tiny_drafter(kind, draft, None)

    clean = alone(target, drafter(), FAILING, num_candidates, rule)
    with overflowing(target, OVERFLOW_AT):
        outcomes = batched(target, drafter, num_candidates, rule)
    *rounds, last = outcomes[FAILING]
    written = emitted_ids(rounds)
    assert isinstance(last, NonFiniteLogits), last
    assert str(last) == (
        f"The target's logits overflowed to inf or NaN in float64 at generated token {len(written) + 1}: "
        "choose another pair."
    )
    assert len(written) <= LAST_FINITE and written == clean[: len(written)]
    assert outcomes[3], "row 3 joined"
    for row in (0, 1, 3):
        assert all(isinstance(outcome, Round) for outcome in outcomes[row]), (row, outcomes[row][-1])
        assert emitted_ids(outcomes[row]) == alone(target, drafter(), row, num_candidates, rule), f"row {row}"


@pytest.mark.parametrize("num_candidates", [1, 3])
def test_a_sampled_drafts_nan_q_ends_its_row_and_names_the_drafter(pass_shape: str, num_candidates: int) -> None:
    """The draft model overflows: its q is NaN, which the rule cannot test a token against (u * NaN < p is false,
    max(0, p - NaN) is NaN), so the row ends, naming the drafter; the other rows write their own text."""
    target, draft = tiny_model(1), tiny_model(2, num_layers=1)

    def drafter() -> Drafter:
        return tiny_drafter("model", draft, None)

    with overflowing(draft, OVERFLOW_AT):
        outcomes = batched(target, drafter, num_candidates, "standard")
    *rounds, last = outcomes[FAILING]
    written = emitted_ids(rounds)
    assert isinstance(last, NonFiniteLogits), last
    assert str(last).startswith("The drafter's probabilities overflowed to inf or NaN in float64 at generated token ")
    # q is NaN for the token after OVERFLOW_AT, or earlier where the draft model fed OVERFLOW_AT beside earlier tokens
    assert len(written) < last.token <= LAST_FINITE + 1, (written, last)
    for row in (0, 1, 3):
        assert emitted_ids(outcomes[row]) == alone(target, drafter(), row, num_candidates, "standard"), f"row {row}"


def test_in_float16_the_sentence_says_float16_and_the_way_out_of_it(pass_shape: str) -> None:
    """The format the pair runs in, as the visitor chose it: float16, the one whose range Qwen2 overflows."""
    target = tiny_model(1).to(torch.float16)
    with overflowing(target, OVERFLOW_AT):
        outcomes = batched(target, lambda: tiny_drafter("none", None, None), 1, "standard")
    last = outcomes[FAILING][-1]
    assert str(last) == (
        f"The target's logits overflowed to inf or NaN in float16 at generated token {LAST_FINITE + 1}: choose "
        "float32 or bfloat16 in Number format (--dtype), or another pair."
    )
    assert all(isinstance(outcome, Round) for row in (0, 1, 3) for outcome in outcomes[row])


def test_the_sentence_names_the_format_and_the_way_forward() -> None:
    """What a visitor reads, per format (float16 to float32 or bfloat16, bfloat16 to float32), with the pair's name
    where the app gives it."""
    assert str(NonFiniteLogits("target's logits", torch.float16, 12)) == (
        "The target's logits overflowed to inf or NaN in float16 at generated token 12: choose float32 or bfloat16 "
        "in Number format (--dtype), or another pair."
    )
    assert str(NonFiniteLogits("target's logits", torch.bfloat16, 3)).endswith(
        "in bfloat16 at generated token 3: choose float32 in Number format (--dtype), or another pair."
    )
    assert NonFiniteLogits("target's logits", torch.float16, 7).sentence("Qwen2.5 0.5B → 1.5B") == (
        "With Qwen2.5 0.5B → 1.5B, the target's logits overflowed to inf or NaN in float16 at generated token 7: "
        "choose float32 or bfloat16 in Number format (--dtype), or another pair."
    )
    assert isinstance(NonFiniteLogits("target's logits", torch.float16, 1), ValueError)
