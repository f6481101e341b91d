"""Each round's sentence, from hand-built rounds whose numbers are known."""

from __future__ import annotations

from dataclasses import replace

from specdemo.app.views.narrate import round_sentence, round_sentences
from specdemo.core.planning import Plan
from tests.helpers import make_round

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
