"""Token spans and their terminal rendering from hand-built rounds."""

from __future__ import annotations

from dataclasses import replace

from specdemo.render import ANSI_STYLES, ansi_text, html_spans, summary_markdown, token_spans
from specdemo.stats import Comparison, run_stats
from tests.conftest import make_round

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
        predicted_tokens_per_pass=1.44,
        predicted_speedup=0.48,
        prediction_error=-0.04,
        best_num_draft_tokens=1,
        best_speedup=0.7,
        identical=True,
    )
    text = summary_markdown(spec, 3, baseline=base, comparison=comparison, greedy=True)
    assert "**Speedup 0.50×** = 1.50 tokens per target pass ÷ 3.00 target steps per round" in text
    assert "v(3) = 1.60" in text and "identical" in text and "**Best γ**" in text
    assert "It misses because" not in text  # a 4% error needs no excuse
    assert "Speculation was slower here" in text and "1.60× a one-token step" in text and "α = 0.33" in text
    assert "slower" not in summary_markdown(spec, 3, baseline=base, comparison=replace(comparison, speedup=1.4))
