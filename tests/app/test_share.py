"""A run as a link: the query's settings are checked one by one as /generate checks them, a bad or unknown one is
left out with a sentence, and only a cheap offline run re-runs by itself, never on ZeroGPU."""

from __future__ import annotations

from types import SimpleNamespace

from specdemo.app import page
from specdemo.app.serving import share
from specdemo.app.serving.share import RERUNNING, form_from_query, link_js, race_from_query, runs_on_open

SHARED = {"prompt": "Hi there", "pair": "smollm2-135m-self", "seed": "3", "run": "1"}  # re-runs by itself off ZeroGPU


def test_a_links_settings_come_back_as_the_form_holds_them():
    query = {"prompt": "Hi there", "pair": "smollm2-135m-self", "temperature": "0.7", "seed": "3", "compare": "false"}
    prompt, values, notes = form_from_query({**query, "__theme": "dark", "run": "1", "view": "present"})
    assert prompt == "Hi there" and notes == []
    assert values == {"pair": "smollm2-135m-self", "temperature": 0.7, "seed": 3.0, "compare": False}
    assert runs_on_open({**query, "run": "1"}, prompt, values)
    assert not runs_on_open(query, prompt, values)  # not asked to
    assert not runs_on_open({"run": "1"}, None, values)  # nothing to decode
    assert not runs_on_open({"run": "1"}, prompt, {**values, "max_new_tokens": 512})  # not cheap


def test_a_bad_or_unknown_parameter_is_left_out_with_a_sentence_and_the_rest_kept():
    prompt, values, notes = form_from_query(
        {
            "temperature": "-1",
            "seed": "abc",
            "colour": "red",
            "compare": "maybe",
            "pair": "nope",
            "top_k": "5",
            "prompt": "",
        }
    )
    assert prompt is None and values == {"top_k": 5.0}
    text = " ".join(notes)
    assert "Left out temperature='-1': temperature must be" in text
    assert "Left out seed='abc'" in text and "Left out 'colour': the page has no such setting." in text
    assert "compare must be one of" in text and "Left out pair='nope'" in text and "The prompt is empty" in text
    assert len(notes) == 6


def test_the_copy_link_script_names_every_setting_in_the_forms_order():
    script = link_js()
    assert '"prompt", "pair", ' in script and "query.set('run', '1')" in script and "navigator.clipboard" in script


def test_a_links_rule_comes_back_and_a_bad_one_is_left_out_with_a_sentence():
    _, values, notes = form_from_query({"prompt": "Hi", "rule": "coupled", "temperature": "0.7"})
    assert values == {"rule": "coupled", "temperature": 0.7} and notes == []
    assert '"rule"' in link_js()
    _, values, notes = form_from_query({"rule": "shuffled"})
    assert values == {} and notes == ["Left out rule='shuffled': rule must be 'standard' or 'coupled', got 'shuffled'."]


def opened(query: dict[str, str]) -> tuple[str, list]:
    """The page's load event for a link: its note's text and the form's updates."""
    *form, note = page.open_link(SimpleNamespace(query_params=query))
    return note["value"], form


def test_on_zerogpu_a_link_fills_the_form_and_waits_for_run(monkeypatch):
    """A run there spends the visitor's daily GPU quota: the link sets the form, and its note says why it waits (the
    page presses Run only when the note says it re-runs: page.RUN_ON_OPEN_JS)."""
    monkeypatch.setattr(share, "ON_ZEROGPU", False)
    text, form = opened(SHARED)
    assert runs_on_open(SHARED, *form_from_query(SHARED)[:2]) and text == f"Opened from a shared link: {RERUNNING}."
    assert RERUNNING in page.RUN_ON_OPEN_JS
    monkeypatch.setattr(share, "ON_ZEROGPU", True)
    assert not runs_on_open(SHARED, *form_from_query(SHARED)[:2])
    waiting, waiting_form = opened(SHARED)
    assert waiting_form == form  # the same form: prompt, pair and seed set
    assert RERUNNING not in waiting
    assert waiting == (
        "Opened from a shared link: press **Run** to decode it. On this ZeroGPU Space a run spends your daily GPU "
        "quota, so a link never runs by itself."
    )
    assert opened({k: v for k, v in SHARED.items() if k != "run"})[0] == ""  # a link not asking to run says nothing


RACE = {"tab": "race", "lanes": "ngram,suffix", "prompt": "Hi there", "seed": "3", "run": "1"}


def test_a_race_link_opens_the_race_tab_with_its_prompt_and_lanes_and_re_runs(monkeypatch):
    """?tab=race sets the Race tab's prompt (not the One prompt tab's) and lanes, shows the tab, and re-runs the race
    (page.RUN_ON_OPEN_JS presses #race-run for it); Copy link on the Race tab names the tab and the lanes."""
    monkeypatch.setattr(share, "ON_ZEROGPU", False)
    text, form = opened(RACE)
    one_prompt, race_prompt, lanes, tabs, *_ = form
    assert text == f"Opened from a shared link: {RERUNNING}."
    assert "value" not in one_prompt  # the One prompt tab's prompt is left alone
    assert race_prompt["value"] == "Hi there" and lanes["value"] == ["ngram", "suffix"] and tabs.selected == "race"
    assert "#race-run" in page.RUN_ON_OPEN_JS
    script = link_js(("prompt", "lanes"), tab="race")
    assert '"prompt", "lanes", "pair", ' in script and '{"tab": "race"}' in script


def test_a_race_links_bad_lanes_or_tab_are_left_out_with_a_sentence():
    """Planted: the target lane kept among the link's lanes (the control holds drafters only) fails it."""
    assert race_from_query({"tab": "race", "lanes": "ngram,beam"}, {})[1:] == (
        None,
        [
            "Left out lanes='ngram,beam': 'beam' is not a lane this pair can race: choose among target, ngram, suffix, "
            "recurrent, hybrid."
        ],
    )
    racing, lanes, notes = race_from_query({"tab": "race", "lanes": "ngram,draft"}, {"pair": "smollm2-135m-self"})
    assert racing and lanes == ["ngram", "draft"] and notes == []  # checked against the link's own pair
    assert race_from_query({"tab": "batch"}, {}) == (
        False,
        None,
        ["Left out tab='batch': the only tab a link opens besides the first is 'race'."],
    )
    assert race_from_query({"lanes": "ngram"}, {})[2] == [
        "Left out 'lanes': only a race's link (tab=race) names lanes."
    ]
    assert form_from_query(RACE)[2] == []  # the race's parameters are not the form's unknown ones
