"""Token spans and their terminal rendering from hand-built rounds, and from coupled runs of the engine."""

from __future__ import annotations

from dataclasses import replace

import torch

from specdemo.app.views.render import (
    ANSI_STYLES,
    MAX_CANDIDATE_ROUNDS,
    ansi_text,
    candidates_html,
    html_spans,
    round_spans,
    token_spans,
)
from specdemo.app.views.same_text import Divergence, first_difference, greedy_check
from specdemo.app.views.summary import (
    headline_html,
    sharing_note,
    summary_markdown,
)
from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.core.rounds import CandidateTrace
from specdemo.core.stats import Comparison, compare_runs, run_stats
from specdemo.engine.decoding import speculative_generate
from tests.helpers import make_round, tiny_drafter

WORDS = {1: " the", 2: " cat", 3: " sat", 4: " on", 5: " a", 6: " mat", 99: "!"}


def decode(ids: list[int]) -> str:
    return "".join(WORDS[token] for token in ids)


def test_spans_follow_the_rounds():
    rounds = [
        make_round(0, [1, 2], 2, "bonus", 0.1),  # accepts 2, bonus
        make_round(1, [3, 4, 5], 1, "resampled", 0.1),  # accepts 1, rejects 4, discards 5, resamples
    ]
    spans = token_spans(rounds, decode)
    assert [(span.text, span.kind) for span in spans] == [
        (" the", "accepted"),
        (" cat", "accepted"),
        ("!", "bonus"),
        (" sat", "accepted"),
        (" on", "rejected"),
        (" a", "rejected"),
        ("!", "resampled"),
    ]
    assert spans[4].uniform is not None  # the first rejection was tested against its draw
    assert spans[5].uniform is None  # the draft after it was never tested
    assert [span.round_index for span in spans] == [0, 0, 0, 1, 1, 1, 1]


def test_ansi_text_colours_every_kind():
    spans = token_spans([make_round(0, [3, 4], 1, "resampled", 0.1), make_round(1, [6], 1, "bonus", 0.1)], decode)
    text = ansi_text(spans)
    for kind, style in ANSI_STYLES.items():
        assert style in text, kind
    assert f"{ANSI_STYLES['rejected']} on" in text


def test_html_escapes_token_text_and_marks_rounds():
    hostile = {1: "<script>alert(1)</script>", 2: '" onmouseover="x', 99: "</span>"}
    rounds = [make_round(0, [1], 1, "bonus", 0.1), make_round(1, [2], 0, "resampled", 0.1)]
    markup = html_spans(token_spans(rounds, lambda ids: "".join(hostile[t] for t in ids)))
    assert "<script>" not in markup and "&lt;script&gt;" in markup
    assert '" onmouseover' not in markup and "&quot; onmouseover" in markup
    assert markup.count("</span>") == markup.count("<span")  # the token "</span>" stays text
    assert markup.count('class="round-sep"') == 1  # between round 1 and round 2 only


def test_summary_is_honest_when_speculation_is_slower():
    spec_rounds = [make_round(0, [1, 2, 3], 0, "resampled", 0.5), make_round(1, [1, 2, 3], 1, "resampled", 0.5)]
    spec = run_stats(spec_rounds)  # α = 1 / 3: one of three tested drafts accepted
    base = run_stats([make_round(0, [], 0, "bonus", 0.1)])
    comparison = Comparison(
        speedup=0.5,
        tokens_per_pass=1.5,
        round_cost=3.0,
        draft_cost=0.2,
        verify_cost=1.6,
        other_cost=1.2,
        verify_cost_by_k=((3, 1.6),),
        verify_rounds_by_k=((3, 1),),
        predicted_tokens_per_pass=1.44,
        predicted_speedup=0.48,
        prediction_error=-0.04,
        best_num_draft_tokens=1,
        best_speedup=0.7,
        identical=True,
    )
    text = summary_markdown(spec, 3, baseline=base, comparison=comparison, greedy=True)
    assert "**Speedup 0.50×** = 1.50 tokens per target pass ÷ 3.00 target steps per round" in text
    assert "v(3) = 1.60 (1 round)" in text and "identical" in text and "**Best γ**" in text
    assert "It misses because" not in text  # a 4% error needs no excuse
    assert "Speculation was slower here" in text and "1.60× a one-token step" in text and "α = 0.33" in text
    assert "slower" not in summary_markdown(spec, 3, baseline=base, comparison=replace(comparison, speedup=1.4))


def test_greedy_check_says_where_the_texts_differ_and_how_near_a_tie():
    assert first_difference([5, 6, 7, 8], [5, 6, 9, 8]) == 2
    assert first_difference([5, 6], [5, 6, 7]) is None  # one begins the other: no token differs
    near = Divergence(4, " cat", " dog", 0.0007, (0.412, 0.411), "float32")
    assert greedy_check(True, near) == "Greedy check: the two texts are **identical**, token for token."
    assert greedy_check(False, near) == (
        "Greedy check: the two texts **differ** from generated token 4 on (' cat' speculative, ' dog' target alone), "
        "where the target's top two logits are 0.0007 apart (41.2% against 41.1%): in float32, a K+1-token "
        "verification pass and one-token steps round differently, and at such a near-tie that can flip an argmax."
    )
    assert "worth reporting" in greedy_check(False, replace(near, top2_logit_gap=2.5, top2_probs=(0.8, 0.07)))
    assert "near-tie that can flip" in greedy_check(False, replace(near, top2_logit_gap=0.125, dtype="bfloat16"))
    assert "float32" not in greedy_check(False, replace(near, top2_logit_gap=0.125, dtype="bfloat16"))
    assert "**differ** (near-ties" in greedy_check(False, None)


def test_the_summary_names_the_number_format_and_where_greedy_texts_differ():
    spec_rounds = [make_round(0, [1, 2, 3], 3, "bonus", 0.2)]
    base_rounds = [make_round(i, [], 0, "bonus", 0.1) for i in range(4)]
    spec, base, comparison = run_stats(spec_rounds), run_stats(base_rounds), compare_runs(spec_rounds, base_rounds, 3)
    reason = "float32 (auto: this CPU has no native bfloat16)"
    assert f"Number format: {reason}." in summary_markdown(spec, 3, number_format=reason)
    divergence = Divergence(2, "a", "b", 0.0004, (0.5, 0.5), "float32")
    text = summary_markdown(
        spec, 3, baseline=base, comparison=replace(comparison, identical=False), greedy=True, divergence=divergence
    )
    assert "**differ** from generated token 2 on ('a' speculative, 'b' target alone)" in text


def round_with_candidates(index: int, num_rows: int = 1):
    """Two candidates: the second is the accepted path ([1, 2] accepted, then a bonus); the first was tried at depth
    0 and rejected."""
    first = CandidateTrace([3, 4], [0.2, 0.1], [0.4, 0.3], [0.5, 1 / 3], [0.7, 0.2], [True, False], [False, False])
    second = CandidateTrace([1, 2], [0.5, 0.6], [0.5, 0.6], [1.0, 1.0], [0.3, 0.4], [True, True], [True, True])
    return replace(make_round(index, [1, 2], 2, "bonus", 0.1), candidates=(first, second), path=1, num_rows=num_rows)


def test_candidates_show_the_accepted_path_first_and_every_test():
    html_text = candidates_html([round_with_candidates(0)], decode)
    assert html_text.count('<li class="cand"') + html_text.count('<li class="cand cand-path"') == 2
    path_start, other_start = html_text.index("cand-path"), html_text.index("candidate 1")
    assert path_start < other_start, "the accepted path comes first"
    assert "accepted path 2" in html_text and "then bonus" in html_text
    assert html_text.count("tok tok-accepted") == 2 and html_text.count("tok tok-rejected") == 2
    assert "draft q = 0.4000" in html_text and "uniform draw u = 0.7000" in html_text
    assert "not tested" in html_text  # candidate 1's second token was never tested
    assert "round-sep" not in html_text


def test_candidates_that_share_a_prefix_share_its_tokens_in_a_tree():
    """Candidates [the cat sat], [the cat on] and [the a], as the rule tries them: candidate 1 accepts ' the' and
    ' cat' and is rejected at ' sat'; candidate 2 meets its first test at ' on'; candidate 3 is never tested."""
    first = CandidateTrace([1, 2, 3], [0.9, 0.8, 0.1], [0.5, 0.5, 0.5], [1.0, 1.0, 0.2], [0.1, 0.2, 0.9],
                           [True, True, True], [True, True, False])  # fmt: skip
    second = CandidateTrace([1, 2, 4], [0.9, 0.8, 0.0], [0.5, 0.5, 0.5], [1.0, 1.0, 0.0], [0.3, 0.4, 0.5],
                            [False, False, True], [False, False, False])  # fmt: skip
    third = CandidateTrace([1, 5], [0.9, 0.1], [0.5, 0.5], [1.0, 0.2], [0.6, 0.7], [False, False], [False, False])
    round_ = replace(make_round(0, [1, 2, 3], 2, "resampled", 0.1), candidates=(first, second, third), path=0)
    html_text = candidates_html([round_], decode)
    assert html_text.count("> the<") == 1 and html_text.count("> cat<") == 1  # shared tokens are drawn once
    leaves = [part.split('"')[0] for part in html_text.split('data-candidates="')[1:]]
    assert leaves == ["1", "2", "3"]  # the accepted path first, then in the order they were tried
    assert "accepted path 1" in html_text and "candidate 2" in html_text and "candidate 3" in html_text
    assert "uniform draw u = 0.1000" in html_text and "uniform draw u = 0.3000" not in html_text  # the test it met
    assert html_text.count("tok tok-accepted") == 2 and html_text.count("tok tok-rejected") == 3


def test_candidates_keep_the_latest_rounds_and_say_where_the_rest_are():
    rounds = [round_with_candidates(i) for i in range(MAX_CANDIDATE_ROUNDS + 5)]
    html_text = candidates_html(rounds, decode)
    assert html_text.count('class="cand-round"') == MAX_CANDIDATE_ROUNDS
    assert "Rounds 1 to 5 are in the trace." in html_text
    assert candidates_html([make_round(0, [], 0, "bonus", 0.1)], decode).startswith('<p class="cand-empty">')


def test_no_speedup_is_claimed_for_shared_passes():
    alone, shared = [make_round(i, [1], 1, "bonus", 0.1) for i in range(4)], [round_with_candidates(0, num_rows=3)]
    assert sharing_note(alone, alone) is None
    note = sharing_note(shared + alone, alone)
    assert "No speedup shown" in note and "1 of 5 speculative rounds" in note and "up to 3 rows" in note
    assert "1 of 1 target-alone rounds" in sharing_note(alone, shared)  # the baseline shared, the run did not


def test_the_headline_leads_with_the_speedup_tokens_per_pass_and_alpha():
    spec_rounds = [make_round(0, [1, 2, 3], 3, "bonus", 0.2), make_round(1, [1, 2], 1, "resampled", 0.2)]
    base_rounds = [make_round(i, [], 0, "bonus", 0.1) for i in range(6)]
    spec, comparison = run_stats(spec_rounds), compare_runs(spec_rounds, base_rounds, 3)
    headline = headline_html(spec, comparison)
    assert f"{comparison.speedup:.2f}×" in headline and f"{spec.mean_tokens_per_round:.2f}" in headline
    assert f">{spec.alpha:.2f}<" in headline and headline.count('class="big"') == 3
    assert ">…<" in headline_html(spec, None)  # while it streams
    assert ">—<" in headline_html(spec, None, "not measured: the comparison was off")
    assert headline_html(None, None) == ""


def coupled_rounds(target, draft, num_candidates: int) -> list:
    """A coupled run of the engine on the tiny models: its rounds carry Round.coupled, and its noise G."""
    sampling = SamplingConfig(temperature=1.0, rule="coupled", seed=3)
    spec = SpeculativeConfig(num_draft_tokens=4, num_candidates=num_candidates, max_new_tokens=16)
    drafter = tiny_drafter("model", draft, None)
    return list(speculative_generate(target, drafter, torch.tensor([[0, 5, 9]]), sampling, spec, frozenset()))


def tiny_words(ids: list[int]) -> str:
    return "".join(f" t{token}" for token in ids)


def test_coupled_spans_carry_y_x_and_the_noise_and_show_no_u(tiny_target, tiny_draft):
    """Each tested draft x carries its G and log p + G and the target's choice y there (itself when accepted); the
    token the round emits after its drafts is y, with y's G; the hover text names them, never u or min(1, p/q)."""
    rounds = coupled_rounds(tiny_target, tiny_draft, 1)
    emitted: list[int] = []
    for round_ in rounds:
        spans = round_spans(round_, tiny_words, emitted)
        for span in spans:
            assert span.uniform is None and span.acceptance_prob is None
            if span.position is None:  # an untested draft: nothing decided it
                assert span.noise is None and span.kind == "rejected"
                continue
            choice = round_.coupled[span.position]
            if span.kind in ("accepted", "rejected"):
                x = (span.token_id, span.noise, span.score)
                assert x == (choice.draft_id, choice.draft_noise, choice.draft_score)
                assert (span.choice_id, span.choice_score) == (choice.target_id, choice.target_score)
                assert (span.token_id == span.choice_id) == (span.kind == "accepted")
                assert span.choice_text == f" t{choice.target_id}"
            else:  # resampled or bonus: y itself
                y = (span.token_id, span.noise, span.score)
                assert y == (choice.target_id, choice.target_noise, choice.target_score)
    page = html_spans(token_spans(rounds, tiny_words))
    assert "uniform draw u" not in page and "min(1, p/q)" not in page
    assert "matched the target&#x27;s choice: log p + G = " in page and ", its noise G = " in page
    assert "not the target&#x27;s choice: log p + G = " in page
    assert "the target&#x27;s choice: log p + G = " in page  # a resampled or bonus token


def test_coupled_candidates_show_the_noise_of_each_test_and_no_u(tiny_target, tiny_draft):
    rounds = coupled_rounds(tiny_target, tiny_draft, 3)
    page = candidates_html(rounds, tiny_words)
    assert "uniform draw u" not in page and "min(1, p/q)" not in page
    tested = sum(sum(candidate.tested) for round_ in rounds for candidate in round_.candidates)
    assert page.count("log p + G = ") >= tested > 0
    assert "not the target&#x27;s choice" in page and "matched the target&#x27;s choice" in page


def test_a_standard_spans_hover_text_is_unchanged():
    round_ = replace(make_round(0, [1, 2], 1, "resampled", 0.1), uniforms=[0.25, 0.75])
    spans = token_spans([round_], decode)
    assert all(span.noise is None and span.choice_id is None for span in spans)
    assert html_spans(spans[:1]) == (
        '<span class="tok tok-accepted" title="accepted, round 1 · token id 1 · target p = 0.5000 · draft q = 1.0000 · '
        'accept with min(1, p/q) = 0.5000 · uniform draw u = 0.2500"> the</span>'
    )
