"""The Audit tab through /audit: the default audit passes, a planted bug fails, model mode's samples agree, bad input
is one sentence, and Stop ends a model audit."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError

from specdemo.audit import MODEL_BATCH_ROWS
from tests.helpers import assert_stopped_runs_leave_at_the_next_round, count_rounds, wait_for_rounds, wait_until


@pytest.fixture(scope="module")
def client(app) -> Client:
    return Client(app, verbose=False)


def test_the_default_audit_needs_no_parameters_and_passes(client):
    verdict, chart, tv_chart, download = client.predict(api_name="/audit")
    assert verdict.startswith("**Lossless") and "Seed 0" in verdict
    assert chart and tv_chart  # the histograms over p, and TV against N
    record = json.loads(Path(download["value"]).read_text())
    assert record["passes"] and record["settings"]["num_samples"] == 200_000
    assert sum(record["counts"][0]) == 200_000


def test_a_planted_bug_fails_in_the_app(client):
    verdict, *_ = client.predict(bug="shared uniform", num_samples=50_000, api_name="/audit")
    assert verdict.startswith("**Not lossless") and "Planted bug, shared uniform" in verdict


def test_a_thousand_samples_of_two_tokens_on_the_offline_default_are_lossless(client):
    verdict, chart, _, download = client.predict(mode="model", num_samples=1_000, num_tokens=2, api_name="/audit")
    record = json.loads(Path(download["value"]).read_text())
    assert verdict.startswith("**Lossless"), verdict
    assert chart  # the two samples' most frequent sequences
    assert sum(record["speculative"]) == sum(record["target_only"]) == 1_000
    assert record["settings"]["pair"] == "smollm2-135m-ngram" and record["settings"]["sampling"]["seed"] == 0
    assert record["seconds"] > 0  # the audit's own time is in its record; speed is not a test's business


BAD_AUDITS = [
    ({"num_samples": 10}, "The number of samples must be between 1,000 and 1,000,000 in toy mode, got 10."),
    ({"num_samples": 2_000_000}, "between 1,000 and 1,000,000 in toy mode"),
    ({"mode": "model", "num_samples": 50}, "The number of samples must be between 100 and 5,000 in model mode"),
    ({"mode": "model"}, "between 100 and 5,000 in model mode, got 200,000."),  # the toy default: pass M
    ({"target_weights": "0.5, -0.2, 0.7"}, "The target p has a negative or non-finite weight"),
    ({"draft_weights": "0, 0, 0"}, "The draft q is all zeros"),
    ({"draft_weights": "1, 2, 3"}, "The target p has 8 weights and the draft q 3: give both one weight per token."),
    ({"target_weights": "one, two"}, "The target p must be numbers separated by commas"),
    (
        {"mode": "model", "num_samples": 200, "temperature": 0},
        "temperature 0 is greedy decoding, which has nothing to sample",
    ),
    ({"mode": "sideways"}, "Unknown audit mode 'sideways'"),
    ({"bug": "gremlins"}, "Unknown bug 'gremlins'"),
    ({"num_candidates": 9}, "candidates per round (W) must be between 1 and"),
    ({"mode": "model", "num_samples": 200, "num_tokens": 4}, "tokens per sample must be between 1 and 3, got 4."),
]


@pytest.mark.parametrize("changes, message", BAD_AUDITS)
def test_bad_audit_input_is_one_sentence(client, changes, message):
    with pytest.raises(AppError) as caught:
        client.predict(**changes, api_name="/audit")
    assert message in str(caught.value), str(caught.value)[:300]


def test_stop_ends_a_model_audit_at_the_next_round_and_the_app_keeps_serving(client, monkeypatch):
    counter = count_rounds(monkeypatch)
    job = client.submit(mode="model", num_samples=5_000, api_name="/audit")
    wait_for_rounds(counter, 3 * MODEL_BATCH_ROWS)
    job.cancel()
    assert_stopped_runs_leave_at_the_next_round(counter)
    audit_threads = [t for t in threading.enumerate() if t.name == "specdemo-audit"]
    wait_until(lambda: not any(t.is_alive() for t in audit_threads), "the audit's thread ending")
    verdict, *_ = client.predict(num_samples=10_000, api_name="/audit")
    assert verdict.startswith("**Lossless")
