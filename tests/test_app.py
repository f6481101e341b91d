"""The app through gradio_client, launched in-process on the offline default: streaming, Stop, errors, parity."""

from __future__ import annotations

import itertools
import json
import time

import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError

import specdemo.ui as ui
from specdemo.__main__ import main
from tests.conftest import SPELLING, STORY, settings


@pytest.fixture(scope="module")
def client(app) -> Client:
    return Client(app, verbose=False)


def test_a_run_streams_growing_tokens_and_ends_with_every_output(client):
    job = client.submit(*settings(), api_name="/generate")
    updates = list(job)
    tokens = [update[0] for update in updates]
    assert len(updates) >= 3
    assert all(len(earlier) <= len(later) for earlier, later in itertools.pairwise(tokens))
    assert 'class="tok tok-' in tokens[-1] and "title=" in tokens[-1]
    final = job.outputs()[-1]
    summary, charts, trace = final[1], final[2:6], final[6]
    assert "Speedup" in summary and "identical" in summary  # greedy: the check against the target alone
    assert all(chart is not None and "plot" in str(chart) for chart in charts)
    assert trace and trace["value"].endswith(".json")


def test_invalid_settings_give_an_error_naming_the_setting(client):
    cases = [
        (settings(temperature=-1.0), "temperature must be in [0, 10], got -1.0"),
        (settings(top_p=0.0), "top-p must be in (0, 1], got 0.0"),
        (settings(prompt="   "), "The prompt is empty"),
        (settings(top_k=2.5), "top-k must be a whole number, got 2.5"),
        (settings(seed=-4), "seed must be between 0 and"),
        (settings(num_draft_tokens=17), "num-draft-tokens must be between 1 and 16, got 17"),
        (settings(max_new_tokens=9999), "max new tokens must be between 1 and 512 here, got 9999"),
        (settings(pair="custom", custom_target="../secrets"), "looks like a file path"),
        (settings(pair="nonsense"), "Unknown pair 'nonsense': choose one of smollm2-135m-ngram"),
    ]
    for inputs, message in cases:
        with pytest.raises(AppError, match=None) as caught:
            client.predict(*inputs, api_name="/generate")
        assert message in str(caught.value), (message, str(caught.value))
    assert "tok-" in client.predict(*settings(max_new_tokens=8), api_name="/generate")[0]  # still serving


def test_stop_ends_the_generation_within_a_second(client, monkeypatch):
    counter = {"rounds": 0}
    original = ui.speculative_generate

    def counting(*args, **kwargs):
        for round_ in original(*args, **kwargs):
            counter["rounds"] += 1
            yield round_

    monkeypatch.setattr(ui, "speculative_generate", counting)
    job = client.submit(*settings(STORY, max_new_tokens=400, compare=False), api_name="/generate")
    while counter["rounds"] < 3:
        time.sleep(0.05)
    job.cancel()
    time.sleep(1.0)
    stopped_at = counter["rounds"]
    time.sleep(1.5)
    assert counter["rounds"] == stopped_at, "rounds kept coming more than a second after the cancel"
    assert stopped_at < 400
    assert "tok-" in client.predict(*settings(max_new_tokens=8), api_name="/generate")[0]  # the next run works


def test_the_app_reproduces_the_cli_for_the_same_seed(client, capsys):
    sampled = {"temperature": 0.8, "top_p": 0.9, "seed": 7, "max_new_tokens": 24}
    final = client.predict(*settings(**sampled, compare=False), api_name="/generate")
    with open(final[6]["value"]) as handle:
        trace = json.load(handle)
    assert (
        main(
            [
                "generate",
                "--prompt",
                SPELLING,
                "--temperature",
                "0.8",
                "--top-p",
                "0.9",
                "--seed",
                "7",
                "--max-new-tokens",
                "24",
                "--json",
            ]
        )
        == 0
    )
    cli = json.loads(capsys.readouterr().out)
    assert trace["generated_token_ids"] == cli["generated_token_ids"]
    assert [r["uniforms"] for r in trace["rounds"]] == [r["uniforms"] for r in cli["rounds"]]
