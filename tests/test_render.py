"""Token spans and their terminal rendering from hand-built rounds."""

from __future__ import annotations

from specdemo.render import ANSI_STYLES, ansi_text, token_spans
from tests.test_stats import make_round

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
