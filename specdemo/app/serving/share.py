"""A run as a link: the form's settings and seed in the URL's query (?prompt=...&pair=...&seed=3&run=1), read back
when the page opens, each parameter checked as /generate checks it; a bad or unknown one is left out with a note. A
race's link names its tab and lanes too (?tab=race&lanes=ngram,suffix&prompt=...). On ZeroGPU a link fills the form
and waits for Run: a run there spends the visitor's GPU quota."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from specdemo.app.form import RUN_FIELDS, by_name, defaults, parse_request
from specdemo.app.serving.zerogpu import ON_ZEROGPU
from specdemo.core.race import TARGET_LANE
from specdemo.engine.race import check_lanes
from specdemo.pairs import PAIRS_BY_KEY

PAGE_PARAMETERS = ("__theme", "view", "run")  # the page's own: the theme, the presenter view, re-running on open
CHEAP_NEW_TOKENS = 256  # a shared link re-runs on open when its pair is offline and it decodes at most this many
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
RERUNNING = "re-running it with its settings and seed"  # the page presses Run when its note says so (page.py)
RACE_TAB = "race"  # ?tab=race: the link is a race's, its prompt and lanes the Race tab's
RACE_PARAMETERS = ("tab", "lanes")  # a race's own, read by race_from_query


def _value(name: str, text: str) -> Any:
    """A query parameter's text as its control holds it: a number, a flag, or text."""
    control = by_name(RUN_FIELDS, name).control
    if control in ("slider", "number"):
        return float(text)
    if control == "checkbox":
        if text.lower() not in TRUE + FALSE:
            raise ValueError(f"{name} must be one of {', '.join(TRUE + FALSE)}, got {text!r}.")
        return text.lower() in TRUE
    return text


def form_from_query(query: Mapping[str, str]) -> tuple[str | None, dict[str, Any], list[str]]:
    """The prompt (None when absent or refused), the settings the query sets (each one checked with the rest at
    their defaults, then all together), and a sentence for each parameter left out."""
    names = {spec.name for spec in RUN_FIELDS}
    notes: list[str] = []
    prompt, values = None, {}
    for name, text in query.items():
        if name in PAGE_PARAMETERS + RACE_PARAMETERS:
            continue
        if name != "prompt" and name not in names:
            notes.append(f"Left out {name!r}: the page has no such setting.")
            continue
        try:
            if name == "prompt":
                parse_request(text, defaults())
                prompt = text
            else:
                value = _value(name, text)
                parse_request("x", defaults(**{name: value}))
                values[name] = value
        except ValueError as error:
            notes.append(f"Left out {name}={text[:40]!r}: {error}")
    try:
        parse_request(prompt or "x", defaults(**values))
    except ValueError as error:  # each was fine alone, not together (e.g. a custom pair's ids)
        notes.append(f"Left out the link's settings: {error}")
        values = {}
    return prompt, values, notes


def race_from_query(query: Mapping[str, str], values: Mapping[str, Any]) -> tuple[bool, list[str] | None, list[str]]:
    """Whether the link is a race's (?tab=race), its drafter lanes (None when absent or refused; checked against the
    pair the link sets, `values`' or the default), and a sentence for each parameter left out."""
    tab = query.get("tab")
    if tab is None:
        return False, None, ["Left out 'lanes': only a race's link (tab=race) names lanes."] if "lanes" in query else []
    if tab != RACE_TAB:
        return False, None, [f"Left out tab={tab[:40]!r}: the only tab a link opens besides the first is {RACE_TAB!r}."]
    if "lanes" not in query:
        return True, None, []
    pair = PAIRS_BY_KEY.get(values.get("pair", defaults()["pair"]))
    try:
        if pair is None:
            raise ValueError("a custom pair's lanes are checked when it runs: pick them on the page.")
        lanes = check_lanes(query["lanes"], pair)
    except ValueError as error:
        return True, None, [f"Left out lanes={query['lanes'][:40]!r}: {error}"]
    return True, [name for name in lanes if name != TARGET_LANE], []


def runs_on_open(query: Mapping[str, str], prompt: str | None, values: Mapping[str, Any]) -> bool:
    """Whether opening the link re-runs it: asked for (run=1), a prompt, an offline pair, a short run, and not on
    ZeroGPU, where a run spends the visitor's daily GPU quota and so waits for their click."""
    pair = PAIRS_BY_KEY.get(values.get("pair", defaults()["pair"]))  # None: a custom pair
    short = values.get("max_new_tokens", defaults()["max_new_tokens"]) <= CHEAP_NEW_TOKENS
    asked = query.get("run") == "1" and not ON_ZEROGPU
    return asked and prompt is not None and pair is not None and not pair.needs_hub and short


def run_note(query: Mapping[str, str], prompt: str | None, values: Mapping[str, Any]) -> str | None:
    """The note's first sentence for a link that asks to run (None for one that does not): it re-runs, or why it waits
    for Run."""
    if runs_on_open(query, prompt, values):
        return f"Opened from a shared link: {RERUNNING}."
    if query.get("run") != "1":
        return None
    if ON_ZEROGPU:
        return (
            "Opened from a shared link: press **Run** to decode it. On this ZeroGPU Space a run spends your daily GPU "
            "quota, so a link never runs by itself."
        )
    return (
        "Opened from a shared link: press **Run** to decode it (it re-runs by itself only for an offline pair and a "
        "short run)."
    )


def link_js(leading: Sequence[str] = ("prompt",), tab: str | None = None) -> str:
    """The Copy link button's script: the form's values (`leading`, then RUN_FIELDS' order; a list as comma-separated
    names) as a link to this page, on `tab` if given, that re-runs on open, written to the clipboard where the browser
    allows and returned for the link box."""
    keys = json.dumps([*leading, *(spec.name for spec in RUN_FIELDS)])
    default = json.dumps({name: value for name, value in defaults().items() if value is not None}, default=str)
    return f"""(...values) => {{
  const keys = {keys}, defaults = {default};
  const query = new URLSearchParams({json.dumps({"tab": tab} if tab else {})});
  keys.forEach((key, i) => {{
    const value = values[i];
    if (value === null || value === undefined || value === '' || String(value) === String(defaults[key])) return;
    query.set(key, String(value));
  }});
  query.set('run', '1');
  const link = location.origin + location.pathname + '?' + query.toString();
  navigator.clipboard?.writeText(link).catch(() => {{}});
  return link;
}}"""
