"""Each round's sentence, from hand-built rounds whose numbers are known, and from a coupled run of the engine."""

from __future__ import annotations

from dataclasses import replace

import torch

from specdemo.app.views.narrate import round_sentence, round_sentences
from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.core.planning import Plan
from specdemo.core.rounds import CoupledChoice
from specdemo.engine.decoding import speculative_generate
from tests.helpers import make_round, tiny_drafter

WORDS = {1: " the", 2: " cat", 3: " sat", 4: " on", 5: " a", 6: " mat", 7: " ran", 99: "!"}


def decode(ids: list[int]) -> str:
    return "".join(WORDS[token] for token in ids)


def test_a_rejection_names_what_was_accepted_the_test_that_failed_and_the_token_drawn_instead():
    round_ = replace(
        make_round(0, [1, 2, 3, 4, 5], 2, "resampled", 0.1),
        target_probs=[0.6, 0.2, 0.1, 0.3, 0.3],
        draft_probs=[0.5, 0.4, 0.48, 0.3, 0.3],
        acceptance_probs=[1.0, 0.5, 0.21, 1.0, 1.0],
        uniforms=[0.9, 0.3, 0.64, 0.1, 0.1],
        next_token_id=7,
    )
    assert round_sentence(round_, decode, []) == (
        "The draft proposed five tokens. The target accepted ' the' (p ≥ q) and ' cat' (u = 0.30 < p/q = 0.50), "
        "rejected ' sat' (p/q = 0.21 < u = 0.64) and drew ' ran' from what the draft under-weighted, max(0, p − q). "
        "The two drafts after it were never tested."
    )


def test_all_accepted_gives_the_bonus_and_a_greedy_refusal_says_the_target_would_never_pick_it():
    bonus = replace(make_round(0, [1, 2], 2, "bonus", 0.1), acceptance_probs=[1.0, 1.0])
    assert round_sentence(bonus, decode, []) == (
        "The draft proposed two tokens. The target accepted all of them: ' the' (p ≥ q) and ' cat' (p ≥ q), and the "
        "same pass gave the bonus token '!' from its own p."
    )
    greedy = replace(make_round(1, [3], 0, "resampled", 0.1), target_probs=[0.0], acceptance_probs=[0.0])
    assert "rejected ' sat' (p = 0: the target would never pick it)" in round_sentence(greedy, decode, [1])


def test_rounds_that_draft_nothing_end_the_run_or_carry_several_candidates_say_so():
    plan = Plan(0, 1, 1.0, 1.0, 3, 0.01)
    nothing = replace(make_round(0, [], 0, "bonus", 0.1), plan=plan)
    assert round_sentence(nothing, decode, []) == (
        "The drafter had three tokens to offer but expected drafting to lose here, so nothing was drafted. The target "
        "took one plain step and drew '!' from its own p."
    )
    ended = replace(make_round(0, [1], 1, None, 0.1), acceptance_probs=[1.0])
    assert round_sentence(ended, decode, []).endswith(
        "accepted ' the' (p ≥ q), and the run ended at the end-of-text token."
    )
    wide = replace(make_round(0, [1], 1, "bonus", 0.1), candidates=(None, None, None), path=2)  # type: ignore[arg-type]
    assert round_sentence(wide, decode, []).startswith(
        "The drafter proposed three candidates; the target followed candidate 3, which proposed one token."
    )


def test_each_sentence_is_decoded_after_the_rounds_before_it():
    rounds = [make_round(0, [1], 1, "bonus", 0.1), make_round(1, [2], 0, "resampled", 0.1)]
    sentences = round_sentences(rounds, decode, [6])
    assert len(sentences) == 2 and "' cat'" in sentences[1] and "'!'" in sentences[1]


def test_a_greedy_round_speaks_of_argmaxes_not_of_u():
    round_ = replace(
        make_round(0, [1, 2, 3], 1, "resampled", 0.1),
        target_probs=[1.0, 0.0, 0.0],
        draft_probs=[1.0, 1.0, 1.0],
        acceptance_probs=[1.0, 0.0, 0.0],
        next_token_id=7,
    )
    assert round_sentence(round_, decode, [], greedy=True) == (
        "The draft proposed three tokens. The target accepted ' the' (its argmax), rejected ' cat' (not its argmax) "
        "and took its argmax ' ran' instead. The one draft after it was never tested."
    )
    plain = replace(make_round(1, [], 0, "bonus", 0.1), next_token_id=7)
    assert round_sentence(plain, decode, [], greedy=True).endswith("The target took one plain step: its argmax ' ran'.")


def test_a_coupled_rejection_names_the_targets_choice_and_its_noise_not_u_or_the_residual():
    """The coupled rule: ' the' is the target's choice at position 1 (accepted); at position 2 the target's choice is
    ' ran' (log p + G = 1.08, the largest there), the draft's ' sat' scores -0.86, so ' ran' is emitted."""
    round_ = replace(
        make_round(0, [1, 3, 4], 1, "resampled", 0.1),
        acceptance_probs=[1.0, 0.0, 0.0],
        uniforms=[],
        noise=[4.19, 3.25, 2.2],
        next_token_id=7,
        coupled=(
            CoupledChoice(1, -0.31, 4.19, 1, -0.31, 4.19, 0.48, 0.42, 0.42),
            CoupledChoice(7, 1.08, 3.39, 3, -0.86, 3.25, 0.52, 0.44, 0.45),
        ),
    )
    assert round_sentence(round_, decode, []) == (
        "The draft proposed three tokens. The target accepted ' the', which matched the target's choice. The target's "
        "choice at the next position is ' ran' (log p + G = 1.08, its noise G = 3.39); the draft proposed ' sat' "
        "(log p + G = −0.86), so the draft stops here and the target's choice is emitted. The one draft after it was "
        "never tested."
    )


def test_a_coupled_bonus_and_a_coupled_plain_step_name_the_targets_choice():
    choices = (CoupledChoice(1, 0.2, 1.5, 1, 0.2, 1.5, 0.5, 0.4, 0.4), CoupledChoice(2, 0.9, 2.25, None, *[None] * 5))
    bonus = replace(make_round(0, [1], 1, "bonus", 0.1), next_token_id=2, coupled=choices)
    assert round_sentence(bonus, decode, []) == (
        "The draft proposed one token. The target accepted it: ' the', which matched the target's choice; the same "
        "pass gave the bonus token ' cat' (log p + G = 0.90, its noise G = 2.25), the target's choice at the next "
        "position."
    )
    plain = replace(make_round(1, [], 0, "bonus", 0.1), next_token_id=2, coupled=choices[1:])
    assert round_sentence(plain, decode, []).endswith(
        "The target took one plain step: its choice ' cat' (log p + G = 0.90, its noise G = 2.25)."
    )


def tiny_words(ids: list[int]) -> str:
    return "".join(f" t{token}" for token in ids)


def test_every_coupled_round_of_a_run_is_told_by_its_choices(tiny_target, tiny_draft):
    """Coupled runs of the engine (one candidate, three): each sentence names y at the round's stop with its
    log p + G and G (and x's log p + G where x was rejected), and none speaks of u, p/q or the residual; the standard
    run of the same seed still does."""
    prompt = [0, 5, 9]

    def run(rule: str, num_candidates: int) -> list:
        sampling = SamplingConfig(temperature=1.0, rule=rule, seed=3)
        spec = SpeculativeConfig(num_draft_tokens=4, num_candidates=num_candidates, max_new_tokens=16)
        drafter = tiny_drafter("model", tiny_draft, None)
        return list(speculative_generate(tiny_target, drafter, torch.tensor([prompt]), sampling, spec, frozenset()))

    rejected = 0
    for rounds in (run("coupled", 1), run("coupled", 3)):
        for round_, sentence in zip(rounds, round_sentences(rounds, tiny_words, prompt), strict=True):
            assert round_.coupled and not any(word in sentence for word in ("u =", "p/q", "p ≥ q", "max(0, p − q)"))
            choice = round_.coupled[round_.num_accepted]
            score, noise = choice.target_score, choice.target_noise
            said = f"' t{choice.target_id}' (log p + G = {score:.2f}, its noise G = {noise:.2f})"
            assert said.replace("-", "−") in sentence, (said, sentence)
            if round_.num_accepted < len(round_.draft_token_ids):
                rejected += 1
                drafted = f"the draft proposed ' t{choice.draft_id}' (log p + G = {choice.draft_score:.2f})"
                assert drafted.replace("-", "−") in sentence, (drafted, sentence)
            if round_.num_accepted:
                assert "matched the target's choice" in sentence
    assert rejected > 0
    standard = round_sentences(run("standard", 1), tiny_words, prompt)
    assert any("u = " in sentence for sentence in standard)
    assert not any("target's choice" in sentence for sentence in standard)
