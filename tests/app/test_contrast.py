"""WCAG 2 contrast of the token colours, computed from the page's CSS, in the light and the dark theme; and a second
cue besides colour for each outcome, so greyscale, projectors and colour-blind readers still tell them apart."""

from __future__ import annotations

import re

import pytest

from specdemo.app.views.render import TOKEN_CSS

# The page's text and background where tokens are drawn (Gradio 6.31's default theme, read from the page by
# tests/app/test_browser.py::test_the_token_colours_read_in_greyscale_and_the_themes_are_those_measured)
THEMES = {"light": ((39, 39, 42), (255, 255, 255)), "dark": ((244, 244, 245), (15, 15, 17))}
KINDS = ("accepted", "rejected", "resampled", "bonus")
RGB = r"rgba?\((\d+), (\d+), (\d+)(?:, ([.\d]+))?\)"


def rule(kind: str) -> str:
    return re.search(rf"\.tok-{kind} \{{([^}}]*)\}}", TOKEN_CSS).group(1)


def colour(text: str) -> tuple[tuple[float, float, float], float]:
    r, g, b, alpha = re.search(RGB, text).groups()
    return (float(r), float(g), float(b)), float(alpha or 1)


def over(top: tuple[float, ...], alpha: float, bottom: tuple[float, ...]) -> tuple[float, ...]:
    return tuple(alpha * t + (1 - alpha) * b for t, b in zip(top, bottom, strict=True))


def luminance(rgb: tuple[float, ...]) -> float:
    def linear(channel: float) -> float:
        c = channel / 255
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (linear(c) for c in rgb)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast(first: tuple[float, ...], second: tuple[float, ...]) -> float:
    high, low = sorted((luminance(first), luminance(second)), reverse=True)
    return (high + 0.05) / (low + 0.05)


def test_the_contrast_of_wcag_2_is_computed_as_it_defines():
    assert contrast((0, 0, 0), (255, 255, 255)) == pytest.approx(21.0)
    assert contrast((118, 118, 118), (255, 255, 255)) == pytest.approx(4.54, abs=0.01)  # the classic AA grey


@pytest.mark.parametrize("theme", THEMES)
@pytest.mark.parametrize("kind", KINDS)
def test_token_text_meets_aa_and_its_cue_line_stands_out(theme, kind):
    text, page = THEMES[theme]
    background = over(*colour(rule(kind).split("background-color:")[1]), page)
    assert contrast(text, background) >= 4.5, "AA for text"
    cue = rule(kind).split("text-decoration:" if kind == "rejected" else "border-bottom:")[1]
    line, _ = colour(cue)
    behind = background if kind == "rejected" else page  # a strike-through crosses the token; an underline is below it
    assert contrast(line, behind) >= 3.0, "AA for a graphic that carries meaning (1.4.11)"


def test_each_outcome_has_its_own_cue_besides_colour():
    cues = set()
    for kind in KINDS:
        style = re.sub(RGB, "", rule(kind).split(";", 1)[1]).strip()  # what is left without the colours
        cues.add(style)
    assert len(cues) == len(KINDS), cues
