"""The one settings table: a setting added as one row appears on the page, in the API's parameters with its default, and
in the RunRequest; the table's defaults are the API's as they were before the table."""

from __future__ import annotations

import json
import urllib.request

from gradio_client import Client

from specdemo.app import form
from specdemo.app.form import RUN_FIELDS, Field, defaults, parse_request
from tests.app_helpers import SPELLING, launched_app


def test_a_setting_added_as_one_row_is_on_the_page_in_the_api_and_in_the_request(offline_model):
    knob = Field("knob", "number", 3, "A knob", elem_id="knob", section="speculation", read=form.whole("knob"))
    RUN_FIELDS.append(knob)  # the one line: the table is read when the page is built and when a request is parsed
    try:
        assert parse_request(SPELLING, {"knob": 5.0}).values["knob"] == 5
        assert parse_request(SPELLING, {}).values["knob"] == 3  # absent: its default
        with launched_app(offline_model) as (url, _):
            with urllib.request.urlopen(f"{url}config", timeout=10) as response:
                components = json.loads(response.read())["components"]
            assert [c["props"].get("label") for c in components if c["props"].get("elem_id") == "knob"] == ["A knob"]
            client = Client(url, verbose=False)
            for endpoint in ("/generate", "/generate_batch"):
                parameters = client.view_api(return_format="dict", print_info=False)["named_endpoints"][endpoint]
                knobs = [p for p in parameters["parameters"] if p["parameter_name"] == "knob"]
                assert knobs and knobs[0]["parameter_default"] == 3, endpoint
            final = client.predict(prompt=SPELLING, knob=4, max_new_tokens=4, compare=False, api_name="/generate")
            assert "tok-" in final[0]
    finally:
        RUN_FIELDS.remove(knob)


def test_the_tables_defaults_are_the_apis_defaults_as_they_were():
    assert defaults() == {
        "pair": "smollm2-135m-ngram",
        "custom_target": "",
        "custom_draft": "ngram",
        "temperature": 0.0,
        "top_k": 0,
        "top_p": 1.0,
        "repetition_penalty": 1.0,
        "draft_temperature": 1.5,
        "num_draft_tokens": 5,
        "max_new_tokens": 128,
        "seed": 0,
        "chat": True,
        "compare": True,
        "num_candidates": 1,
        "dtype": "auto",
        "max_ngram_size": 3,  # the drafter kinds' options, made from their dataclasses, after them
        "min_ngram_size": 2,
        "suffix_cache_tokens": 20_000,
    }


def test_picking_a_pair_suggests_its_draft_temperature_and_setting_one_changes_no_value():
    """A person's pick (the dropdown's input event) sets the pair's draft temperature; describe_pair, which also runs
    when a shared link or a lesson sets the pair, only shows and hides (a link's draft_temperature=1.2 stays)."""
    import gradio as gr

    from specdemo.app.form import describe_pair, pair_draft_temperature

    assert pair_draft_temperature("smollm2-135m-self") == 1.5
    assert isinstance(pair_draft_temperature("smollm2-135m-suffix"), type(gr.skip()))
    assert all("value" not in update for update in describe_pair("smollm2-135m-self")[1:] if isinstance(update, dict))
