"""The one settings table: a setting added as one row appears on the page, in the API's parameters with its default, and
in the RunRequest; the table's defaults are the API's as they were before the table."""

from __future__ import annotations

import importlib.util
import json
import sys
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
        "rule": "standard",  # the acceptance rule, after them: positional clients keep working
    }


def test_picking_a_pair_suggests_its_draft_temperature_and_setting_one_changes_no_value():
    """A person's pick (the dropdown's input event) sets the pair's draft temperature; describe_pair, which also runs
    when a shared link or a lesson sets the pair, only shows and hides (a link's draft_temperature=1.2 stays)."""
    import gradio as gr

    from specdemo.app.form import describe_pair, pair_draft_temperature

    assert pair_draft_temperature("smollm2-135m-self") == 1.5
    assert isinstance(pair_draft_temperature("smollm2-135m-suffix"), type(gr.skip()))
    assert all("value" not in update for update in describe_pair("smollm2-135m-self")[1:] if isinstance(update, dict))


def test_the_pair_dropdown_marks_pairs_too_big_for_this_gpu_and_gated_ones_without_a_token(monkeypatch):
    """On a T4 (auto: float16) with no Hub token: the 7B and 8B pairs are too big, the Llama and Gemma pairs gated;
    the page's dropdown is made the same way, when the page is built, for this machine."""
    import torch

    from specdemo.app.form import by_name, pair_choices
    from specdemo.models.loading import DTYPE_CHOICES, pick_device
    from specdemo.pairs import PAIRS
    from tests.models.test_float16 import simulate_gpu
    from tests.test_pairs import T4_MEMORY, without_a_token

    assert by_name(RUN_FIELDS, "pair").choices() == pair_choices(pick_device())
    assert by_name(RUN_FIELDS, "dtype").choices == list(DTYPE_CHOICES) == ["auto", "float32", "bfloat16", "float16"]
    simulate_gpu(monkeypatch, 7, 5)
    without_a_token(monkeypatch)
    monkeypatch.setattr("specdemo.models.fitting.device_memory", lambda device: (T4_MEMORY, T4_MEMORY))
    labels = {key: label for label, key in pair_choices(torch.device("cuda"))}
    assert labels == {
        **{pair.key: pair.label for pair in PAIRS},
        "qwen2.5-0.5b-7b": "Qwen2.5-0.5B → Qwen2.5-7B-Instruct — too big for this GPU in float32, which Qwen2 and "
        "Qwen2.5 need here (float16 overflows): needs 36.3 GB, 12.7 GB usable (the most for weights: 32.5 GB)",
        "llama-3.2-1b-3.1-8b": "Llama-3.2-1B → Llama-3.1-8B-Instruct — too big for this GPU: needs 22.5 GB, 12.7 GB "
        "usable (the most for weights: 18.5 GB) — gated: needs HF_TOKEN",
        "gemma-3-270m-1b": "gemma-3-270m-it → gemma-3-1b-it — gated: needs HF_TOKEN",
        "custom": "Custom: any two Hub ids",
    }


def test_importing_the_form_probes_no_device(monkeypatch):
    """The pair list asks the device (pick_device, its memory) when the page is built, never at import: a fresh copy
    of the module imports with every probe refusing. Planted: the pair row's `pair_choices(pick_device())` put back at
    import."""
    from specdemo.models import fitting, loading

    def probe(*args: object) -> None:
        raise AssertionError("importing the form probed the device")

    for module, name in [(loading, "pick_device"), (loading, "device_memory"), (fitting, "device_memory")]:
        monkeypatch.setattr(module, name, probe)
    spec = importlib.util.spec_from_file_location("form_copy", form.__file__)
    copy = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "form_copy", copy)  # dataclasses look their module up
    spec.loader.exec_module(copy)
    assert callable(copy.by_name(copy.RUN_FIELDS, "pair").choices)
