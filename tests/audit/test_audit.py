"""The in-app audit: the verdict passes for the project's sampler and fails for every planted bug, in toy mode and in
model mode; the same seed gives the same counts; toy mode at N = 1,000,000 is quick. Under the coupled rule: the
Gumbel-max draw with the rule's noise is exact, the rule passes the toy and model audits (its distribution, and each
seed's text the target alone's), and each planted noise bug is caught by the check meant for it."""

from __future__ import annotations

import inspect

import pytest
import torch

from specdemo.audit import (
    BUGS,
    COUPLED_BUGS,
    TOY_PRESETS,
    batch_noise,
    chi_square_pvalue,
    model_audit,
    noise_for,
    parse_weights,
    toy_audit,
    tv_distance,
    verifier,
)
from specdemo.audit.statistics import MIN_P_VALUE
from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.core.coupled import NoiseAsk, coupled_choice, gumbel_noise, position_noise
from specdemo.core.rules import StandardRule
from specdemo.core.stats import emitted_ids
from specdemo.core.verify import rejection_sample
from specdemo.drafters import ModelDrafter, NoDrafter
from specdemo.drafters.recurrent import RecurrentDrafter
from specdemo.engine.decoding import BatchDecoder, autoregressive_generate
from tests.helpers import TINY_VOCAB, tiny_drafter, tiny_model

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
    engine_rule = BatchDecoder(tiny_model(1), NoDrafter(), frozenset()).rules["standard"].verify
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


def tiny_audit(pair, bug: str, num_samples: int, seed: int = 0):
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
    result = tiny_audit(tiny_pairs[kind], "none", 1_000)  # p = 0.37 and 0.61
    assert result.passes, result.verdict
    assert sum(result.speculative) == sum(result.target_only) == 1_000
    assert result.tv <= result.noise_tv


@pytest.mark.parametrize(
    "bug, kind, num_samples",
    [  # few samples that still fail each bug clearly (p at seed 0; p <= 1e-4 fails); the toy audit tests the statistics
        ("resample from p", "two models", 1_000),  # p = 6.3e-7
        ("always accept", "two models", 300),  # p = 2.7e-18
        ("shared uniform", "two models", 1_000),  # p = 5.2e-10
        # The target drafting for itself: its raw distribution is p, so a wrong q accepts every draft from the hot q.
        # With a second model the raw and the sampled q differ too little for 1,500 samples to tell.
        ("wrong q", "self", 3_000),  # p = 6.8e-10
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
    engine's rule passes, ReDrafter's released rule is caught over the first two tokens (1,500 samples: p = 0.265
    and 1.1e-9; at 1,000, ReDrafter's p is 1.4e-4 and passes)."""
    drafter = RecurrentDrafter(tiny_trained_head, TINY_VOCAB)
    spec = SpeculativeConfig(num_draft_tokens=2, num_candidates=3)
    result = model_audit(
        tiny_target, drafter, frozenset(), [0, 3, 4], SamplingConfig(temperature=1.0), spec, 2, 1_500, bug
    )
    assert result.passes == passes, result.verdict


def test_redrafters_rule_gives_the_targets_greedy_text_with_recurrent_beams(tiny_target, tiny_trained_head):
    spec = SpeculativeConfig(num_draft_tokens=3, max_new_tokens=30, num_candidates=3)
    drafter = RecurrentDrafter(tiny_trained_head, TINY_VOCAB)
    decoder = BatchDecoder(tiny_target, drafter, frozenset([1]), rule=StandardRule(verifier(REDRAFTER)))
    decoder.add(0, [0, 5, 9, 5, 9], SamplingConfig(), spec)
    rounds = [round_ for _ in range(30) if decoder.rows for _, round_ in decoder.step()]
    alone = list(autoregressive_generate(tiny_target, torch.tensor([[0, 5, 9, 5, 9]]), SamplingConfig(), 30,
                                         frozenset([1])))  # fmt: skip
    assert emitted_ids(rounds) == emitted_ids(alone)
    assert sum(r.num_accepted for r in rounds) > 0


# --- the coupled rule ("same text for any drafter"): its noise, and the bugs planted in it --------------------------

COUPLED_PLANTED = [bug for bug in COUPLED_BUGS if bug != "none"]
CAUGHT_BY = {  # each coupled bug and the check meant for it
    "noise by round": "same text",  # each round is exact, but the text changes with K
    "one noise vector": "distribution",  # the same text whatever drafts, but tokens at two positions are correlated
    "noise from the draft": "same text",  # the drafted token moves the noise
}


def test_target_only_coupled_sampling_follows_p():
    """Gumbel-max with the rule's noise: argmax(log p + G_t) over 200,000 seeds is a sample of p at each position t
    (never a token p gives 0), and two positions' tokens are independent (p × p)."""
    probs = parse_weights("30 20 15 10 10 8 5 2 1 0.5 0.3 0", "target")  # V = 12, the last token impossible
    vocab_size, seeds = len(probs), torch.arange(200_000)
    positions = torch.tensor([[0, 7]]).expand(len(seeds), -1)  # [N, 2]
    tokens = coupled_choice(probs, gumbel_noise(seeds, positions, vocab_size))  # [N, 2]
    for column in tokens.T:
        counts = torch.bincount(column, minlength=vocab_size)
        assert int(counts[-1]) == 0
        assert tv_distance(counts, probs) < 0.01 and chi_square_pvalue(counts, probs) > MIN_P_VALUE
    pairs = torch.bincount(tokens[:, 0] * vocab_size + tokens[:, 1], minlength=vocab_size**2)
    assert chi_square_pvalue(pairs, torch.outer(probs, probs).flatten()) > MIN_P_VALUE


def test_the_toy_audit_runs_the_noise_the_engine_runs():
    """The engine's default noise is the control's, and batch_noise gives each row what noise_for gives its NoiseAsk
    (drafts short of K, and none at all as the target alone asks), for the control and every bug."""
    engine_noise = BatchDecoder(tiny_model(1), NoDrafter(), frozenset()).rules["coupled"].noise
    assert engine_noise is position_noise is noise_for("none")
    cpu = torch.device("cpu")
    asks = [  # (seed, start, count, round, the first candidate's draft, V)
        NoiseAsk(5, 9, 4, 2, (3, 0, 7), 16, cpu),
        NoiseAsk(2**40, 4, 3, 0, (11,), 16, cpu),  # a draft shorter than K
        NoiseAsk(1, 6, 1, 6, (), 16, cpu),  # the target alone: one token, no draft
    ]
    for bug in COUPLED_BUGS:
        for ask in asks:
            padded = list(ask.draft) + [-1] * (ask.count - 1 - len(ask.draft))
            draft = torch.tensor([padded], dtype=torch.int64).reshape(1, ask.count - 1)  # [1, n-1]
            rows = [torch.tensor([value]) for value in (ask.seed, ask.start, ask.round_index)]
            batched = batch_noise(bug, rows[0], rows[1], ask.count, rows[2], draft, ask.vocab_size)[0]
            assert torch.equal(noise_for(bug)(ask), batched), (bug, ask)


@pytest.mark.parametrize("name", ["overlapping", "disjoint supports", "32 tokens, peaked target"])
@pytest.mark.parametrize("num_candidates", [1, 3])
def test_the_coupled_rule_passes_the_toy_audit(name, num_candidates):
    result = toy_audit(*preset(name), 4, 20_000, num_candidates, seed=1, rule="coupled")
    assert result.passes and result.differing == 0, result.verdict
    assert result.verdict.startswith("Lossless") and "Same text for any drafter: for all 20,000 seeds" in result.verdict
    assert len(result.counts) == 6 and sum(result.counts[5]) == 20_000  # K + 2 tokens a text


@pytest.mark.parametrize("bug", COUPLED_PLANTED)
def test_each_coupled_bug_fails_the_toy_audit_by_its_check(bug):
    result = toy_audit(*preset("overlapping"), 4, 20_000, bug=bug, seed=1, rule="coupled")
    assert not result.passes, result.verdict
    if CAUGHT_BY[bug] == "same text":
        assert result.differing > 10_000 and "Not the same text for any drafter" in result.verdict
    else:  # the same text for every seed, but the first two tokens are not p × p
        assert result.differing == 0 and result.pair is not None and not result.pair.passes
        assert result.verdict.startswith("Not lossless: at positions 1 and 2 together")


def test_noise_by_round_is_exact_and_changes_nothing_where_no_draft_is_accepted():
    """Each round reads fresh noise, so every check of the distribution passes; with disjoint supports every round
    emits one token, round r's at position r alike for any K, so the text is the target alone's too."""
    overlapping = toy_audit(*preset("overlapping"), 4, 20_000, bug="noise by round", seed=1, rule="coupled")
    assert all(f.passes for f in [*overlapping.fits, overlapping.pair]), overlapping.verdict
    disjoint = toy_audit(*preset("disjoint supports"), 4, 20_000, bug="noise by round", seed=1, rule="coupled")
    assert disjoint.passes and disjoint.differing == 0, disjoint.verdict


def test_the_coupled_toy_audit_repeats_with_its_seed():
    first, again, other = (toy_audit(*preset("overlapping"), 3, 5_000, 2, seed=s, rule="coupled") for s in (5, 5, 6))
    assert first.counts == again.counts and first.counts != other.counts


def test_a_bug_of_the_other_rule_is_one_sentence(tiny_pairs):
    with pytest.raises(ValueError, match="Unknown bug 'shared uniform' for the coupled rule: pick one of 'none'"):
        toy_audit(*preset("overlapping"), 2, 1_000, bug="shared uniform", rule="coupled")
    with pytest.raises(ValueError, match="Unknown bug 'one noise vector': pick one of 'none'"):
        tiny_audit(tiny_pairs["self"], "one noise vector", 100)


def coupled_audit(target, drafter, bug: str, num_samples: int, num_tokens: int, temperature: float = 1.0):
    """The model audit under the coupled rule: the first `num_tokens` tokens of each sample, K = 2, seeds from 0."""
    sampling = SamplingConfig(temperature=temperature, rule="coupled")
    spec = SpeculativeConfig(num_draft_tokens=2)
    return model_audit(target, drafter, frozenset(), [3, 7, 11, 5], sampling, spec, num_tokens, num_samples, bug)


def test_the_coupled_rule_passes_the_model_audit(tiny_pairs):
    """Two tiny models, the drafter hotter (temperature 1.5): drafts are often rejected, the text must not care."""
    target, draft = tiny_pairs["two models"]
    drafter = ModelDrafter(draft, SamplingConfig(temperature=1.5), TINY_VOCAB)
    result = coupled_audit(target, drafter, "none", 500, 2)  # p = 0.98
    assert result.passes and result.differing == 0, result.verdict
    assert result.tv <= result.noise_tv
    assert "Same text for any drafter: for all 500 seeds" in result.verdict


@pytest.mark.parametrize("bug", COUPLED_PLANTED)
def test_each_coupled_bug_fails_the_model_audit_by_its_check(tiny_pairs, bug):
    """The target drafting for itself at its own temperature, the first three tokens of 300 samples: "noise by round"
    writes another text wherever a draft is accepted, "noise from the draft" wherever a drafted token moves the noise
    (46 and 299 seeds of 300); "one noise vector" writes the target alone's text, and its tokens are correlated."""
    target, _ = tiny_pairs["self"]
    result = coupled_audit(target, tiny_drafter("model", target, None), bug, 300, 3, temperature=0.7)
    assert not result.passes, result.verdict
    if CAUGHT_BY[bug] == "same text":
        assert result.differing is not None and result.differing >= 30, result.verdict  # 10% of the seeds or more
    else:
        assert result.differing == 0 and result.p_value <= MIN_P_VALUE, result.verdict
