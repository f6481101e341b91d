"""The in-app audit: the verdict passes for the project's sampler and fails for every planted bug, in toy mode and in
model mode; the same seed gives the same counts; toy mode at N = 1,000,000 is quick."""

from __future__ import annotations

import inspect

import pytest
import torch

from specdemo.audit import BUGS, TOY_PRESETS, model_audit, parse_weights, toy_audit, verifier
from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.core.stats import emitted_ids
from specdemo.core.verify import rejection_sample
from specdemo.drafters import ModelDrafter
from specdemo.drafters.recurrent import RecurrentDrafter
from specdemo.engine.decoding import BatchDecoder, autoregressive_generate
from tests.helpers import TINY_VOCAB, tiny_model

PLANTED = [bug for bug in BUGS if bug != "none"]
REDRAFTER = "ReDrafter's rule, as released"


def preset(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    target, draft = TOY_PRESETS[name]
    return parse_weights(" ".join(map(str, target)), "target"), parse_weights(" ".join(map(str, draft)), "draft")


@pytest.mark.parametrize("name", list(TOY_PRESETS))
@pytest.mark.parametrize("num_candidates", [1, 3])
def test_the_projects_sampler_passes_on_every_preset(name, num_candidates):
    result = toy_audit(*preset(name), num_draft_tokens=3, num_samples=100_000, num_candidates=num_candidates, seed=1)
    assert result.passes, result.verdict
    assert result.verdict.startswith("Lossless")


@pytest.mark.parametrize("bug", PLANTED)
@pytest.mark.parametrize("num_candidates", [1, 3])
def test_every_planted_bug_fails_the_toy_audit(bug, num_candidates):
    if bug == REDRAFTER and num_candidates == 1:
        pytest.skip("one beam: ReDrafter's rule is Algorithm 1 (test_redrafters_rule_is_exact_for_one_beam_or_greedy)")
    result = toy_audit(
        *preset("overlapping"), num_draft_tokens=3, num_samples=100_000, num_candidates=num_candidates, bug=bug
    )
    assert not result.passes, (bug, result.verdict)
    assert result.verdict.startswith("Not lossless")


@pytest.mark.parametrize("num_candidates", [1, 3])
def test_redrafters_rule_is_exact_for_one_beam_or_greedy(num_candidates):
    """It fails only with several sampled beams: one beam is Algorithm 1, and under a greedy target (p one-hot) every
    beam's test and residual give the argmax. Here both pass the audit that fails it for W = 3 above."""
    target, draft = preset("overlapping")
    if num_candidates == 3:
        target = torch.nn.functional.one_hot(target.argmax(), len(target)).double()
    result = toy_audit(target, draft, 3, 100_000, num_candidates=num_candidates, bug=REDRAFTER, seed=1)
    assert result.passes, result.verdict


def test_the_control_and_every_planted_bug_wrap_the_rule_the_engine_runs(monkeypatch):
    engine_rule = inspect.signature(BatchDecoder).parameters["verify"].default
    assert rejection_sample.__globals__["verify_rows"] is engine_rule  # what rejection_sample (and the GPU tests) run
    for bug in BUGS:
        assert inspect.unwrap(verifier(bug)) is engine_rule, bug
    calls = []  # and each calls the rule it was given

    def counting_rule(*inputs):
        calls.append(inputs[0].shape)
        return engine_rule(*inputs)

    for bug in BUGS:
        verifier(bug, counting_rule)(*preset_inputs())
    # ReDrafter's released rule runs the rule once per beam (W = 2 here), as a chain
    assert len(calls) == len(BUGS) + 1 and calls.count(torch.Size([4, 1, 3])) == 2


def preset_inputs(rows: int = 4, w: int = 2, k: int = 3) -> tuple[torch.Tensor, ...]:
    p, q = (t.float() for t in preset("overlapping"))
    ids = torch.multinomial(q, rows * w * k, replacement=True, generator=torch.Generator().manual_seed(0))
    uniforms = torch.rand(rows, k * w + 1, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return (
        ids.reshape(rows, w, k),
        torch.full((rows, w), k),
        q.expand(rows, w, k, -1),
        p.expand(rows, w, k + 1, -1),
        uniforms,
    )


def test_the_same_seed_gives_the_same_counts():
    first, again, other = (toy_audit(*preset("overlapping"), 4, 20_000, 2, seed=seed) for seed in (5, 5, 6))
    assert first.counts == again.counts and first.counts != other.counts


def test_a_million_toy_samples_at_32_tokens_pass_with_tv_at_every_scale():
    result = toy_audit(*preset("32 tokens, peaked target"), num_draft_tokens=4, num_samples=1_000_000)
    assert sum(result.counts[0]) == 1_000_000 and result.passes, result.verdict
    assert result.tv_curve[0][0] == 1_000 and result.tv_curve[-1][0] == 1_000_000  # TV at every scale of N


@pytest.mark.parametrize(
    "text, message",
    [
        ("0.5, -0.1, 0.6", "negative or non-finite weight"),
        ("0, 0, 0", "all zeros"),
        ("1", "has 1 weights"),
        (", ".join(["1"] * 33), "has 33 weights; give between 2 and 32"),
        ("a, b", "must be numbers separated by commas"),
        ("1, nan", "negative or non-finite"),
    ],
)
def test_a_malformed_toy_distribution_is_one_sentence(text, message):
    with pytest.raises(ValueError, match=message):
        parse_weights(text, "target")


@pytest.fixture(scope="module")
def tiny_pairs() -> dict[str, tuple[torch.nn.Module, torch.nn.Module]]:
    target = tiny_model(0)
    return {"two models": (target, tiny_model(1)), "self": (target, target)}


def tiny_audit(pair, bug: str, num_samples: int = 1_500, seed: int = 0):
    """Tiny random Llamas (V = 32): the target samples at temperature 1, the drafter at 1.5 (its raw and sampled
    distributions differ, and drafts are often rejected); the first token of each sample, K = 2."""
    target, draft = pair
    return model_audit(
        target,
        ModelDrafter(draft, SamplingConfig(temperature=1.5), TINY_VOCAB),
        frozenset(),
        [3, 7, 11, 5],
        SamplingConfig(temperature=1.0, seed=seed),
        SpeculativeConfig(num_draft_tokens=2),
        1,
        num_samples,
        bug,
    )


@pytest.mark.parametrize("kind", ["two models", "self"])
def test_the_model_audit_passes_for_the_projects_sampler(tiny_pairs, kind):
    result = tiny_audit(tiny_pairs[kind], "none")
    assert result.passes, result.verdict
    assert sum(result.speculative) == sum(result.target_only) == 1_500
    assert result.tv <= result.noise_tv


@pytest.mark.parametrize(
    "bug, kind, num_samples",
    [
        ("resample from p", "two models", 1_500),
        ("always accept", "two models", 1_500),
        ("shared uniform", "two models", 1_500),
        # The target drafting for itself: its raw distribution is p, so a wrong q accepts every draft from the hot q.
        # With a second model the raw and the sampled q differ too little for 1,500 samples to tell.
        ("wrong q", "self", 4_000),
    ],
)
def test_every_planted_bug_fails_the_model_audit(tiny_pairs, bug, kind, num_samples):
    result = tiny_audit(tiny_pairs[kind], bug, num_samples)
    assert not result.passes, (bug, result.verdict)
    assert result.verdict.startswith("Not lossless")


def test_the_model_audit_repeats_with_its_seed(tiny_pairs):
    pair = tiny_pairs["two models"]
    first, again = tiny_audit(pair, "none", 200, seed=3), tiny_audit(pair, "none", 200, seed=3)
    assert (first.sequences, first.speculative, first.target_only) == (
        again.sequences,
        again.speculative,
        again.target_only,
    )


# --- the app: /audit by name ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("bug", "passes"), [("none", True), (REDRAFTER, False)])
def test_with_recurrent_beams_the_model_audit_passes_the_rule_and_fails_redrafters(
    tiny_target, tiny_trained_head, bug, passes
):
    """The head's W = 3 sampled beams from the second token on (the first round has no hidden state yet): the
    engine's rule passes, ReDrafter's released rule is caught over the first two tokens."""
    drafter = RecurrentDrafter(tiny_trained_head, TINY_VOCAB)
    spec = SpeculativeConfig(num_draft_tokens=2, num_candidates=3)
    result = model_audit(
        tiny_target, drafter, frozenset(), [0, 3, 4], SamplingConfig(temperature=1.0), spec, 2, 1_500, bug
    )
    assert result.passes == passes, result.verdict


def test_redrafters_rule_gives_the_targets_greedy_text_with_recurrent_beams(tiny_target, tiny_trained_head):
    spec = SpeculativeConfig(num_draft_tokens=3, max_new_tokens=30, num_candidates=3)
    decoder = BatchDecoder(tiny_target, RecurrentDrafter(tiny_trained_head, TINY_VOCAB), frozenset([1]),
                           verifier(REDRAFTER))  # fmt: skip
    decoder.add(0, [0, 5, 9, 5, 9], SamplingConfig(), spec)
    rounds = [round_ for _ in range(30) if decoder.rows for _, round_ in decoder.step()]
    alone = list(autoregressive_generate(tiny_target, torch.tensor([[0, 5, 9, 5, 9]]), SamplingConfig(), 30,
                                         frozenset([1])))  # fmt: skip
    assert emitted_ids(rounds) == emitted_ids(alone)
    assert sum(r.num_accepted for r in rounds) > 0
