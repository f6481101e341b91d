"""A real browser (Debian's Chromium, driven by playwright) uses the page as a person would."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.app_helpers import CHROMIUM
from tests.helpers import (
    HANG_GUARD_SECONDS,
    assert_stopped_runs_leave_at_the_next_round,
    count_rounds,
    wait_for_rounds,
)

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (make chromium)")
# Screenshots go here (gitignored) only: the README's assets/screenshot.png is refreshed deliberately, by hand.
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
# How long a test waits for the page to end a run, an audit or a round, or to do anything else (a note, a chart, a
# toast), before it gives up: the hang guard, not a speed bound (a fresh clone's run beside another job on both cores
# took 5 minutes for the six lessons).
RUN_ENDS_MS = HANG_GUARD_SECONDS * 1000
REACTS_MS = HANG_GUARD_SECONDS * 1000
COMPARE = "Then run the target alone, to compare"  # the checkbox's label: a test that reads no comparison unticks it


def open_page(browser, url: str, theme: str = "light"):
    page = browser.new_page(viewport={"width": 1400, "height": 1300})
    page.set_default_timeout(REACTS_MS)
    page.goto(f"{url}?__theme={theme}", wait_until="domcontentloaded")
    page.wait_for_selector("#prompt textarea")
    return page


def screenshot_light_and_dark(page, name: str) -> None:
    """Screenshots of the page as it is, in the light theme, then in the dark one. The dark theme is the `dark` class
    that ?__theme=dark puts on body at load (gradio's frontend, `_e` in Index-*.js), and the charts are transparent
    with grey text, so one run gives both; token text must not stay black on the dark background."""
    page.screenshot(path=str(ARTIFACTS / f"{name}-light.png"), full_page=True)
    page.evaluate("document.body.classList.add('dark')")
    for span in page.locator(".tok").all()[:1]:
        assert span.evaluate("span => getComputedStyle(span).color") != "rgb(0, 0, 0)", "token text stayed black"
    page.screenshot(path=str(ARTIFACTS / f"{name}-dark.png"), full_page=True)
    page.evaluate("document.body.classList.remove('dark')")


def set_numbers(page, **numbers: int | float | str) -> None:
    """Set numeric settings by name (#num-draft-tokens for num_draft_tokens=...), as a person types them."""
    for name, value in numbers.items():
        field = page.locator(f"#{name.replace('_', '-')} input[type=number]")
        field.fill(str(value))
        field.press("Enter")


# A run has ended when the headline's three numbers are drawn anew (a run's first update clears the cells marked
# before it started) and final (while the run streams, and while the target alone runs after it, the speedup reads '…').
HEADLINE_DRAWN_ANEW = "[...document.querySelectorAll('#headline .big')].every(c => !c.dataset.old)"
RUN_ENDED = """() => { const cells = [...document.querySelectorAll('#headline .big')];
    return cells.length === 3 && !cells.some(c => c.dataset.old) && cells[0].textContent !== '…'; }"""


def mark_the_headline_old(page) -> None:
    page.eval_on_selector_all("#headline .big", "cells => cells.forEach(c => c.dataset.old = '1')")


def run_to_its_end(page, button: str = "#run") -> None:
    """Click `button` (Run, or a lesson's) and wait until the run it starts has ended, compared or not."""
    mark_the_headline_old(page)
    page.click(button)
    page.wait_for_function(RUN_ENDED, timeout=RUN_ENDS_MS)


def choose_first_example(page, **numbers: int | float) -> None:
    """The spelling example (its prompt, the default pair, temperature 0), then `numbers` (e.g. max_new_tokens=32)."""
    page.get_by_text("Correct the spelling mistakes", exact=False).first.click()
    page.wait_for_function("document.querySelector('#prompt textarea').value.includes('quartely')")
    set_numbers(page, **numbers)


def run_first_example(page, **numbers: int) -> None:
    choose_first_example(page, **numbers)
    page.click("#run")
    page.wait_for_function("document.querySelector('#summary')?.textContent.includes('Speedup')", timeout=RUN_ENDS_MS)


def test_a_run_shows_coloured_tokens_tooltips_and_charts(browser, app):
    ARTIFACTS.mkdir(exist_ok=True)
    page = open_page(browser, app)
    for chart in ("#acceptance-chart", "#latency-chart", "#positions-chart", "#throughput-chart"):
        # drawn empty at load, so plotly's first drawing does not take the cores during a timed run
        page.wait_for_selector(f"{chart} .js-plotly-plot .main-svg")
    page.screenshot(path=str(ARTIFACTS / "before-a-run.png"), full_page=True)
    run_first_example(page, max_new_tokens=32)  # compared with the target alone: the summary and the fold read it
    kinds = page.eval_on_selector_all("#tokens .tok", "spans => [...new Set(spans.map(s => s.classList[1]))]")
    assert "tok-accepted" in kinds and ("tok-bonus" in kinds or "tok-resampled" in kinds)
    for kind in kinds:  # each outcome that occurred has its own visible colour
        colour = page.eval_on_selector(f"#tokens .{kind}", "span => getComputedStyle(span).backgroundColor")
        assert colour not in ("rgba(0, 0, 0, 0)", "transparent"), kind
    title = page.get_attribute("#tokens .tok-accepted", "title")
    assert "target p =" in title and "uniform draw u =" in title
    for chart in ("#acceptance-chart", "#latency-chart"):
        page.wait_for_selector(f"{chart} .js-plotly-plot .main-svg")
    assert "identical" in page.text_content("#summary")
    assert page.inner_text("#tokens details.alone summary").startswith("The target alone: ")  # its text, folded
    screenshot_light_and_dark(page, "run")
    page.close()


def test_a_sampled_run_under_the_coupled_rule_writes_the_target_alones_text(browser, app):
    """A person picks "same text for any drafter" and a temperature above 0: the sampled run, compared with the target
    alone, is the same text token for token, and the summary says so."""
    page = open_page(browser, app)
    choose_first_example(page, temperature=0.8, max_new_tokens=16)  # then sampled
    page.locator("#rule label", has_text="same text for any drafter").click()
    assert page.get_by_label("same text for any drafter").is_checked()
    assert page.get_by_label(COMPARE).is_checked()
    page.click("#run")
    page.wait_for_function("document.querySelector('#summary')?.textContent.includes('Speedup')", timeout=RUN_ENDS_MS)
    summary = page.text_content("#summary")
    assert "Same-text check (coupled rule, seed 0): the two texts are identical, token for token." in summary, summary
    assert page.inner_text("#tokens details.alone summary").startswith("The target alone: ")
    page.locator("#summary details.numbers summary").click()  # the numbers, with the theory beside the measurement
    page.wait_for_function("document.querySelector('#summary')?.innerText.includes('Theory beside measurement')")
    page.screenshot(path=str(ARTIFACTS / "coupled-light.png"), full_page=True)
    page.locator("#tokens .tok-rejected[data-r]").first.click()  # the inspector: the target's choice, the draft's, G
    page.wait_for_selector("#inspector .js-plotly-plot .main-svg")
    page.wait_for_function("document.querySelector('#inspector-note')?.innerText.includes('rejected')")
    note = page.inner_text("#inspector-note")
    assert "the target's choice is" in note and "log p + G" in note and "u = " not in note, note
    page.locator("#inspector").scroll_into_view_if_needed()
    page.screenshot(path=str(ARTIFACTS / "coupled-inspector-light.png"), full_page=True)
    page.close()


def test_the_dark_theme_is_the_body_class_the_screenshots_add(browser, app):
    page = open_page(browser, app, theme="dark")
    assert page.evaluate("document.body.classList.contains('dark')")
    page.close()


def test_stop_halts_the_stream(browser, app, monkeypatch):
    """Stop ends the run in the engine at the next round; once the page says so, no token comes after."""
    counter = count_rounds(monkeypatch)
    page = open_page(browser, app)
    page.fill("#prompt textarea", "Write a long story about a dragon who learns to bake bread.")
    page.click("#run")
    page.wait_for_function("document.querySelectorAll('#tokens .tok').length >= 10", timeout=RUN_ENDS_MS)
    page.locator("#stop").click(force=True)
    assert_stopped_runs_leave_at_the_next_round(counter)
    page.wait_for_function("document.querySelector('#summary')?.textContent.includes('you pressed Stop')")
    count = page.locator("#tokens .tok").count()
    page.wait_for_timeout(1000)  # a second look: the run has left the engine, so no later update can add tokens
    assert page.locator("#tokens .tok").count() == count, "tokens kept arriving after Stop"
    summary = page.text_content("#summary")
    assert "Speedup" not in summary  # the comparison never ran
    assert "Stopped: you pressed Stop." in summary and "so far" not in summary, summary[-300:]  # says why it ended
    page.close()


@pytest.mark.parametrize("gradio_closes_the_handler", [True, False], ids=["as-gradio-runs", "by-the-unload-alone"])
def test_closing_the_tab_ends_the_run_at_the_next_round(browser, app, monkeypatch, gradio_closes_the_handler):
    """Gradio closes a dead event's handler after its next update; the page's unload stops the run without that."""
    if not gradio_closes_the_handler:
        from gradio.queueing import Queue

        async def leave_it(queue, event_id):
            pass

        monkeypatch.setattr(Queue, "reset_iterators", leave_it)
    counter = count_rounds(monkeypatch)
    page = open_page(browser, app)
    page.fill("#prompt textarea", "Write a long story about a dragon who learns to bake bread.")
    page.click("#run")
    wait_for_rounds(counter, 3)
    page.close()  # the tab goes away mid-run, without pressing Stop
    assert_stopped_runs_leave_at_the_next_round(counter)


HOSTILE = "<img src=x onerror=alert(1)><script>alert(2)</script></span><b>bold?</b>"


def test_markup_in_the_prompt_and_in_model_ids_stays_text(browser, app):
    page = open_page(browser, app)
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    # Prompt lookup copies the prompt, so the hostile markup comes back as tokens.
    page.fill("#prompt textarea", f"Repeat this exactly, then stop: {HOSTILE}")
    set_numbers(page, max_new_tokens=24)
    page.get_by_label(COMPARE).uncheck()
    run_to_its_end(page)
    tokens = page.locator("#tokens")
    assert tokens.locator("img, script, b").count() == 0  # nothing the model wrote became an element
    assert "<" in tokens.inner_text() or "img" in tokens.inner_text()  # the markup is shown as text
    page.click("#pair input")
    page.locator("li.item", has_text="Custom: any two Hub ids").click()
    page.locator("#custom-target textarea, #custom-target input").first.fill(HOSTILE)
    page.click("#run")
    toast = page.get_by_text("looks like a file path")
    toast.wait_for()
    assert "<img src=x onerror=alert(1)>" in toast.inner_text()  # shown literally, not as an element
    assert page.locator("[class*=toast] img").count() == 0
    page.wait_for_timeout(500)
    assert dialogs == []
    assert tokens.locator(".tok").count() > 0  # the refusal left the previous run's tokens in place
    page.screenshot(path=str(ARTIFACTS / "markup-as-text.png"), full_page=True)
    page.close()


def test_switching_the_pair_mid_run_leaves_the_run_alone(browser, app):
    page = open_page(browser, app)
    choose_first_example(page)  # the default 128 tokens: the second run is still decoding when the pair changes
    page.get_by_label(COMPARE).uncheck()  # the first run's tokens are the yardstick, not the target alone's
    run_to_its_end(page)  # a first, complete run: the one to compare with
    tokens = "els => els.map(e => e.className + ':' + e.textContent).join('|')"
    first = page.eval_on_selector_all("#tokens .tok", tokens)
    mark_the_headline_old(page)
    page.click("#run")  # the second run redraws the headline as soon as its first tokens arrive
    page.wait_for_function(HEADLINE_DRAWN_ANEW, timeout=RUN_ENDS_MS)
    page.click("#pair input")
    page.locator("li.item", has_text="drafting for itself").click()  # mid-run
    page.wait_for_function("document.querySelector('#pair-note')?.innerText.includes('teaching pair')")
    page.wait_for_function(RUN_ENDED, timeout=RUN_ENDS_MS)
    # The run finished with the settings it started with: prompt lookup, the same greedy tokens and rounds as before.
    assert page.eval_on_selector_all("#tokens .tok", tokens) == first
    page.close()


def run_with_pair(page, pair_label: str, note: str, prompt: str, **numbers: int) -> list[str]:
    """Pick the pair by its label, wait for its note, set the numeric settings (#num-draft-tokens for
    num_draft_tokens=...), run `prompt` to its end without the comparison; the tokens' tooltips."""
    page.click("#pair input")
    page.locator("li.item", has_text=pair_label).click()
    page.wait_for_function(f"document.querySelector('#pair-note')?.innerText.includes('{note}')")
    set_numbers(page, **numbers)
    page.get_by_label(COMPARE).uncheck()
    page.fill("#prompt textarea", prompt)
    run_to_its_end(page)
    return page.eval_on_selector_all("#tokens .tok", "spans => spans.map(s => s.title)")


def test_the_suffix_pair_says_what_each_round_chose(browser, app):
    page = open_page(browser, app)
    titles = run_with_pair(
        page,
        "suffix drafting",
        "pass costs",
        "Copy this list exactly: red, green, blue, red, green, blue, red, green, blue.",
        num_draft_tokens=12,
        max_new_tokens=32,
    )
    summary = page.text_content("#summary")
    assert "Cost-aware drafting" in summary and "The plans expected" in summary
    # every token names its round's choice but the last round's, when no token was left to draft
    assert sum("drafted " in t for t in titles) >= len(titles) - 1, titles[:3]
    assert any(re.search(r"drafted \d+: expected \d+\.\d+ tokens for \d+\.\d+ steps", t) for t in titles), titles[:3]
    page.screenshot(path=str(ARTIFACTS / "suffix-light.png"), full_page=True)
    page.close()


def test_the_batch_view_streams_four_lanes(browser, app):
    page = open_page(browser, app)
    set_numbers(page, max_new_tokens=16)  # the settings column is the batch's too
    page.get_by_role("tab", name="Batch").click()
    page.click("#batch-example")
    page.wait_for_function("document.querySelector('#batch-prompts textarea').value.split('\\n').length === 4")
    page.click("#batch-run")
    page.wait_for_function("document.querySelectorAll('#batch-lanes .lane .tok').length > 0", timeout=RUN_ENDS_MS)
    page.wait_for_function(
        "document.querySelector('#batch-summary')?.innerText.includes('tokens/s in all')", timeout=RUN_ENDS_MS
    )
    assert page.locator("#batch-lanes .lane").count() == 4
    for lane in range(4):  # every lane has tokens and its acceptance
        assert page.locator("#batch-lanes .lane").nth(lane).locator(".tok").count() > 0
        assert "α" in page.locator("#batch-lanes .lane-figures").nth(lane).inner_text()
    page.wait_for_selector("#batch-chart .js-plotly-plot")
    screenshot_light_and_dark(page, "batch")
    page.close()


LANE_TEXTS = """() => [...document.querySelectorAll('#race-lanes .race-lane')].map(lane =>
    [...lane.querySelectorAll('.tokens .tok:not(.tok-rejected)')].map(tok => tok.textContent).join(''))"""


def race_to_its_end(page, button: str = "#race-run") -> list[str]:
    """Press `button` (Run the race, or a lesson's) and wait for the race's lanes (texts other than the last race's)
    and its agreement sentence; returns each lane's text (its kept tokens)."""
    before = page.evaluate(LANE_TEXTS)
    page.click(button)
    page.wait_for_function(
        f"""before => {{ const texts = ({LANE_TEXTS})();
            return JSON.stringify(texts) !== JSON.stringify(before)
                && document.querySelector('#race-summary')?.innerText.includes('finished lanes wrote the same'); }}""",
        arg=before,
        timeout=RUN_ENDS_MS,
    )
    page.wait_for_selector("#race-chart .js-plotly-plot .main-svg")
    return page.evaluate(LANE_TEXTS)


def test_a_race_of_five_lanes_writes_one_text(browser, app):
    """Four drafters and the target alone race on the offline default, greedy: every lane writes the same text, and
    the finish chart is drawn (a coupled sampled race in the browser: the thorough test below)."""
    page = open_page(browser, app)
    set_numbers(page, max_new_tokens=24)  # the settings column is the race's too
    page.get_by_role("tab", name="Race").click()
    page.fill("#race-prompt textarea", "Correct the spelling: The quartely planing meeting is moved to Thursday.")
    for lane in ("ngram", "suffix", "recurrent", "hybrid"):  # the offline default's lanes, all ticked
        assert page.get_by_label(lane, exact=True).is_checked()
    texts = race_to_its_end(page)
    assert len(texts) == 5 and len(set(texts)) == 1 and texts[0], texts
    assert page.locator("#race-lanes .race-finished").count() == 5
    assert "speedup" in page.inner_text("#race-summary")
    page.wait_for_selector("#race-chart .js-plotly-plot .main-svg")
    assert page.locator("#race-chart .scatterlayer .trace").count() == 10  # a line per lane in each of two charts
    screenshot_light_and_dark(page, "race")
    page.click("#presenter")
    page.wait_for_timeout(500)  # plotly redraws the chart at the new width after a resize, debounced
    page.screenshot(path=str(ARTIFACTS / "race-presenter.png"), full_page=True)
    page.click("#presenter")
    page.close()


@pytest.mark.thorough
def test_a_coupled_race_its_link_and_its_lesson(browser, app):
    """Breadth beside the race above: sampled at 0.8 under the rule 'same text for any drafter', every lane writes the
    same text; its Copy link, opened in a new page, opens the Race tab and re-runs it with the same texts
    (test_share.py checks the link's parsing); the lesson Race the drafters runs greedy."""
    page = open_page(browser, app)
    set_numbers(page, max_new_tokens=24, temperature=0.8)
    page.get_by_role("tab", name="Race").click()
    page.locator("#rule label", has_text="same text for any drafter").click()
    assert page.input_value("#temperature input[type=number]") == "0.8"
    page.fill("#race-prompt textarea", "Write a haiku about autumn rain.")  # free writing: sampling shows
    sampled = race_to_its_end(page)
    assert len(sampled) == 5 and len(set(sampled)) == 1 and sampled[0], sampled
    assert page.locator("#race-lanes .race-finished").count() == 5
    page.screenshot(path=str(ARTIFACTS / "race-coupled-light.png"), full_page=True)
    page.click("#race-copy-link")  # the link opens the Race tab and re-runs the race: the same text
    page.wait_for_function("document.querySelector('#race-share-link textarea')?.value.includes('tab=race')")
    link = page.input_value("#race-share-link textarea")
    assert "lanes=ngram%2Csuffix%2Crecurrent%2Chybrid" in link and "rule=coupled" in link, link
    again = open_page(browser, app)
    again.goto(link, wait_until="domcontentloaded")
    again.wait_for_function(
        "document.querySelector('#race-summary')?.innerText.includes('finished lanes wrote the same')",
        timeout=RUN_ENDS_MS,
    )
    assert again.evaluate(LANE_TEXTS) == sampled
    again.close()
    lesson = race_to_its_end(page, "#lesson-race")  # greedy again, on the lesson's prompt and lanes
    assert len(lesson) == 5 and len(set(lesson)) == 1, lesson
    assert "Race the drafters." in page.inner_text("#lesson-note")
    assert "quartely" in page.input_value("#race-prompt textarea")
    page.close()


def test_the_audit_passes_for_the_sampler_and_fails_for_a_planted_bug(browser, app):
    page = open_page(browser, app)
    page.get_by_role("tab", name="Audit: is it lossless?").click()
    page.click("#audit-run")
    page.wait_for_function(
        "document.querySelector('#audit-verdict')?.innerText.startsWith('Lossless')", timeout=RUN_ENDS_MS
    )
    page.wait_for_selector("#audit-chart .js-plotly-plot .main-svg")
    page.wait_for_selector("#audit-tv-chart .js-plotly-plot .main-svg")
    screenshot_light_and_dark(page, "audit-pass")
    page.locator("#audit-bug input").click()
    page.get_by_role("option", name="always accept", exact=False).click()
    page.click("#audit-run")
    page.wait_for_function(
        "document.querySelector('#audit-verdict')?.innerText.startsWith('Not lossless')", timeout=RUN_ENDS_MS
    )
    assert "Planted bug, always accept" in page.inner_text("#audit-verdict")
    screenshot_light_and_dark(page, "audit-fail")
    page.close()


def test_the_hybrid_pair_names_who_proposed_each_token(browser, app):
    page = open_page(browser, app)
    prompt = "Suggest a healthy morning routine for a busy student."
    titles = run_with_pair(page, "suffix copy and recurrent drafter", "trained head", prompt, max_new_tokens=24)
    assert any("proposed by the recurrent head" in t for t in titles), titles[:5]
    page.screenshot(path=str(ARTIFACTS / "hybrid-light.png"), full_page=True)
    page.close()


def test_stepping_through_a_sampled_run_and_inspecting_a_rejection(browser, app):
    """Next round decodes a sampled run one round a press, one sentence each; Run then decodes the same run whole, with
    the same tokens; stepping through it, a rejected token and a resampled one open the inspector with p, q, the
    residual and u drawn."""
    page = open_page(browser, app)
    page.get_by_text("Explain why the sky is blue", exact=False).first.click()  # the teaching pair, T = 0.7
    page.wait_for_function("document.querySelector('#pair-note')?.innerText.includes('teaching pair')")
    set_numbers(page, max_new_tokens=24)
    page.get_by_label(COMPARE).uncheck()
    sentences = []
    for step in range(1, 6):  # nothing to step through: each press decodes one round of the form's run
        if step == 3:
            page.locator("body").press("n")  # the keyboard shortcut
        else:
            page.click("#next-round")
        page.wait_for_function(
            f"document.querySelector('#round-sentence')?.innerText.startsWith('Round {step} of {step} so far')",
            timeout=RUN_ENDS_MS,
        )
        sentences.append(page.inner_text("#round-sentence"))
    assert all(re.search(r"so far \(Next round decodes the next\)\. (The draft|Nothing)", s) for s in sentences)
    assert page.locator("#tokens .tok").count() == 0  # nothing decoded whole yet
    kept = "els => els.filter(e => !e.classList.contains('tok-rejected')).map(e => e.textContent).join('')"
    stepped = page.eval_on_selector_all("#step-tokens .tok", kept)
    page.click("#run")  # the same run, whole: the same tokens, and the step view shows its round 1
    page.wait_for_function(
        "document.querySelector('#headline')?.innerText.includes('not measured')", timeout=RUN_ENDS_MS
    )
    page.wait_for_function("/^Round 1 of \\d+\\. /.test(document.querySelector('#round-sentence')?.innerText)")
    assert stepped and page.eval_on_selector_all("#tokens .tok", kept).startswith(stepped), stepped
    total = re.match(r"Round 1 of (\d+)", page.inner_text("#round-sentence")).group(1)
    page.fill("#replay input[type=number]", total)  # the slider's end: the whole run
    page.locator("#replay input[type=number]").press("Enter")
    page.wait_for_function(f"document.querySelector('#round-sentence')?.innerText.startsWith('Round {total} of')")
    page.click("#next-round")  # past the last round: a sentence
    page.wait_for_function("document.querySelector('#round-sentence')?.innerText.startsWith('That was the last')")
    page.fill("#replay input[type=number]", str(int(total) - 1))  # back one round, and Next to the last again
    page.locator("#replay input[type=number]").press("Enter")
    page.click("#next-round")
    page.wait_for_function(f"document.querySelector('#round-sentence')?.innerText.startsWith('Round {total} of')")
    page.locator("#step-tokens .tok-rejected[data-r]").first.click()
    page.wait_for_selector("#inspector .js-plotly-plot .main-svg")
    page.wait_for_function("document.querySelector('#inspector-note')?.innerText.includes('rejected')")
    legend = page.inner_text("#inspector")
    assert "target p" in legend and "draft q" in legend and "residual" in legend and "u = " in legend
    page.locator("#inspector").scroll_into_view_if_needed()
    screenshot_light_and_dark(page, "inspector-rejection")
    page.locator("#step-tokens .tok-resampled[data-r]").first.click()
    page.wait_for_function("document.querySelector('#inspector-note')?.innerText.includes('drawn from the residual')")
    page.evaluate("document.documentElement.style.filter = 'grayscale(1)'")
    page.locator("#tokens").screenshot(path=str(ARTIFACTS / "tokens-greyscale.png"))
    page.close()


def test_the_token_colours_read_in_greyscale_and_the_themes_are_those_measured(browser, app):
    """The legend's four outcomes differ by a line besides their colour (so a greyscale page still tells them apart),
    and the theme colours tests/app/test_contrast.py computes with are the page's."""
    from tests.app.test_contrast import THEMES

    for theme, (text, background) in THEMES.items():
        page = open_page(browser, app, theme=theme)
        seen = page.evaluate(
            """() => { let e = document.querySelector('#tokens'); const text = getComputedStyle(e).color;
            while (getComputedStyle(e).backgroundColor === 'rgba(0, 0, 0, 0)') e = e.parentElement;
            return [text, getComputedStyle(e).backgroundColor]; }"""
        )
        assert seen == [f"rgb{text}", f"rgb{background}"]
        cues = page.eval_on_selector_all(
            "#header .tok",
            "spans => spans.map(s => { const c = getComputedStyle(s); "
            "return [c.borderBottomStyle, c.borderBottomWidth, c.textDecorationLine].join(' '); })",
        )
        assert len(set(cues)) == 4, cues
        page.evaluate("document.documentElement.style.filter = 'grayscale(1)'")
        page.locator("#header").screenshot(path=str(ARTIFACTS / f"legend-greyscale-{theme}.png"))
        page.close()


def test_a_shared_link_reproduces_the_run_and_a_bad_one_says_what_it_left_out(browser, app):
    """Copy link gives a link that, opened, restores the form and re-runs it: the same tokens and the same α line; a
    link with a bad and an unknown parameter opens with a note naming them; ?view=present hides the settings."""
    from urllib.parse import quote

    page = open_page(browser, app)
    tokens = "els => els.map(e => e.className + ':' + e.textContent).join('|')"
    query = f"prompt={quote('Explain why the sky is blue.')}&pair=smollm2-135m-self&temperature=0.7&seed=3"
    query += "&draft_temperature=1.2"  # not the pair's own 1.5: the pair's arrival must not overwrite it
    page.goto(f"{app}?{query}&max_new_tokens=12&compare=false&run=1", wait_until="domcontentloaded")
    page.wait_for_function("document.querySelector('#link-note')?.innerText.includes('re-running it')")
    done = "document.querySelector('#headline')?.innerText.includes('not measured')"
    page.wait_for_function(done, timeout=RUN_ENDS_MS)
    first = page.eval_on_selector_all("#tokens .tok", tokens)
    alpha = page.text_content("#summary").split("α = ")[1][:60]
    page.click("#copy-link")
    page.wait_for_function("document.querySelector('#share-link textarea')?.value.includes('seed=3')")
    link = page.input_value("#share-link textarea")
    assert "max_new_tokens=12" in link and "pair=smollm2-135m-self" in link and "compare=false" in link
    assert "draft_temperature=1.2" in link, link
    again = browser.new_page(viewport={"width": 1400, "height": 1300})
    again.set_default_timeout(REACTS_MS)
    again.goto(link, wait_until="domcontentloaded")
    again.wait_for_function(done, timeout=RUN_ENDS_MS)
    assert again.eval_on_selector_all("#tokens .tok", tokens) == first
    assert again.text_content("#summary").split("α = ")[1][:60] == alpha
    again.goto(f"{app}?temperature=hot&colour=red&view=present", wait_until="domcontentloaded")
    again.wait_for_function("document.querySelector('#link-note')?.innerText.includes('Left out')")
    note = again.inner_text("#link-note")
    assert "temperature='hot'" in note and "'colour': the page has no such setting" in note
    assert again.evaluate("document.body.classList.contains('present')")
    assert not again.locator("#settings-column").is_visible()
    again.close()
    page.click("#presenter")  # the toggle: the run as the presenter view shows it
    assert "view=present" in page.url and not page.locator("#settings-column").is_visible()
    page.screenshot(path=str(ARTIFACTS / "presenter.png"), full_page=True)
    page.click("#presenter")
    assert "view=" not in page.url and page.locator("#settings-column").is_visible()
    page.close()


def big_numbers(page) -> list[str]:
    return page.eval_on_selector_all("#headline .big", "cells => cells.map(c => c.textContent)")


def run_lesson(page, key: str) -> None:
    """Click a lesson and wait until its run has ended (run_to_its_end), or, for the lesson that shows the Audit tab
    (whose verdict is empty before its first audit), until a verdict is drawn."""
    if key == "broken-sampler":
        page.click(f"#lesson-{key}")
        verdict = "(document.querySelector('#audit-verdict')?.innerText ?? '')"
        ended = f"{verdict}.startsWith('Lossless') || {verdict}.startsWith('Not lossless')"
        page.wait_for_function(ended, timeout=RUN_ENDS_MS)
    else:
        run_to_its_end(page, f"#lesson-{key}")
    page.wait_for_function("document.querySelector('#lesson-note')?.innerText.length > 0")


OUTCOMES = "els => els.map(e => e.classList[1])"


def test_the_lessons_load_their_settings_and_run(browser, app):
    """Each lesson sets the form, says what to watch and runs in one click with its own settings, and its run shows
    what the note says: copying many tokens per pass, free writing refusals, the hot draft residual draws and no
    comparison, three candidates a tree of three beams a round, the broken sampler a failed audit in the tab it opens.
    The greedy lesson's run (48 tokens and the target alone's) is the thorough tier's:
    test_the_greedy_lesson_writes_the_target_alones_text_despite_wrong_drafts."""
    from specdemo.app.panels.lessons import LESSONS

    page = open_page(browser, app)
    assert [b.get_attribute("id") for b in page.locator("#lessons button").all()] == [
        f"lesson-{lesson.key}" for lesson in LESSONS
    ]
    run_lesson(page, "copying")
    assert "quartely" in page.input_value("#prompt textarea") and "Copying." in page.inner_text("#lesson-note")
    copying = big_numbers(page)
    assert copying[0].endswith("×") and float(copying[1]) >= 3, copying  # tokens per pass
    run_lesson(page, "free-writing")
    assert "ReDrafter" in page.inner_text("#pair-note")
    free = big_numbers(page)
    assert float(free[2]) < float(copying[2]) and float(free[1]) < float(copying[1]), (free, copying)
    assert "tok-rejected" in page.eval_on_selector_all("#tokens .tok", OUTCOMES)
    run_lesson(page, "hot-draft")
    assert "teaching pair" in page.inner_text("#pair-note")
    assert page.input_value("#max-new-tokens input[type=number]") == "32"
    assert {"tok-rejected", "tok-resampled"} <= set(page.eval_on_selector_all("#tokens .tok", OUTCOMES))
    assert "not measured" in page.inner_text("#headline")  # the comparison is off: the form says so too
    assert not page.get_by_label(COMPARE).is_checked()
    run_lesson(page, "three-candidates")
    assert page.input_value("#num-candidates input[type=number]") == "3"
    page.wait_for_selector("#candidates .cand-round", state="visible")  # the lesson opened the tree
    ends = page.eval_on_selector_all(  # each leaf of a round's tree names the candidates that end there
        "#candidates .cand-round",
        "rounds => rounds.map(r => [...r.querySelectorAll('.cand')].map(l => l.dataset.candidates).join(' '))",
    )
    assert ends and all(sorted(end.split()) == ["1", "2", "3"] for end in ends), ends  # three beams every round
    assert page.locator("#candidates .cand-path").count() > 0  # the accepted path is marked
    title = page.get_attribute("#candidates .cand .tok", "title")
    assert "target p =" in title and "draft q =" in title and "min(1, p/q)" in title
    page.locator("#candidates .cand-round").first.scroll_into_view_if_needed()
    screenshot_light_and_dark(page, "candidates")
    run_lesson(page, "broken-sampler")
    page.screenshot(path=str(ARTIFACTS / "lesson-audit.png"), full_page=True)
    verdict = page.inner_text("#audit-verdict")
    assert verdict.startswith("Not lossless") and "Planted bug, resample from p" in verdict, verdict
    assert page.get_by_role("tab", name="Audit: is it lossless?").get_attribute("aria-selected") == "true"
    page.close()


@pytest.mark.thorough
def test_the_greedy_lesson_writes_the_target_alones_text_despite_wrong_drafts(browser, app):
    """Breadth: the lessons' one-click wiring is test_the_lessons_load_their_settings_and_run's, and a greedy run's
    text equal to the target alone's is tests/app/test_app.py's and the engine's."""
    page = open_page(browser, app)
    run_lesson(page, "greedy")
    assert "Greedy = target." in page.inner_text("#lesson-note")
    assert "identical" in page.text_content("#summary")
    assert "tok-rejected" in page.eval_on_selector_all("#tokens .tok", OUTCOMES)  # wrong drafts, the same text
    page.close()


def test_a_recorded_run_replays_at_once_and_the_page_says_where_runs_decode(browser, app):
    page = open_page(browser, app)
    assert page.inner_text("#device-line").startswith("Runs on CPU")  # device, number format, torch and its CUDA
    page.click("#recorded-runs input")
    page.get_by_role("option", name="Copying", exact=False).click()
    page.wait_for_function("document.querySelector('#round-sentence')?.textContent.includes('Round 1 of')")
    assert "recorded on CPU" in page.inner_text("#inspector-note")  # the label names the device and the date
    assert page.locator("#step-tokens .tok").count() > 0
    page.screenshot(path=str(ARTIFACTS / "recorded-run.png"), full_page=True)
    page.close()
