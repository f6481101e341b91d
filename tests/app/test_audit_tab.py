"""The Audit tab through /audit: the default audit passes, a planted bug fails, model mode's samples agree, bad input
is one sentence, Stop ends a model audit, and a failing one is a sentence after which the next runs. Under the coupled
rule the rule passes, with each seed's text the target alone's, and each of its planted bugs fails by the check meant
for it. The model audit's worker sends its progress and hands back its outcome."""

from __future__ import annotations

import json
import threading
from collections.abc import Generator, Iterator
from pathlib import Path

import gradio as gr
import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError

import specdemo.app.serving.audit as serving_audit
from specdemo.app.serving.audit import bug_choices, drawing
from specdemo.audit import BUGS, COUPLED_BUGS, MODEL_BATCH_ROWS
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


def test_three_hundred_samples_of_two_tokens_on_the_offline_default_are_lossless(client):
    """Model mode through /audit: its verdict, chart and record (seed 0: chi-square p-value 0.33 here). The default
    pair's prompt lookup drafts nothing in this prompt's first two tokens, so no planted bug shows in it at any count;
    the model audit's power against each planted bug is audit/test_audit.py's (tiny models)."""
    verdict, chart, _, download = client.predict(mode="model", num_samples=300, num_tokens=2, api_name="/audit")
    record = json.loads(Path(download["value"]).read_text())
    assert verdict.startswith("**Lossless"), verdict
    assert chart  # the two samples' most frequent sequences
    assert sum(record["speculative"]) == sum(record["target_only"]) == 300
    assert record["settings"]["pair"] == "smollm2-135m-ngram" and record["settings"]["sampling"]["seed"] == 0
    assert record["seconds"] > 0  # the audit's own time is in its record; speed is not a test's business


def test_the_rule_offers_its_own_bugs():
    assert [name for _, name in bug_choices("standard")] == list(BUGS)
    assert [name for _, name in bug_choices("coupled")] == list(COUPLED_BUGS)
    assert bug_choices("coupled")[0] == ("none (the project's coupled rule)", "none")


def test_the_coupled_rule_passes_in_toy_mode_with_each_seeds_text_the_target_alones(client):
    verdict, chart, tv_chart, download = client.predict(rule="coupled", num_samples=20_000, api_name="/audit")
    assert verdict.startswith("**Lossless") and "Same text for any drafter: for all 20,000 seeds" in verdict
    assert "The project's sampler. Rule: same text for any drafter. Seed 0." in verdict
    assert chart and tv_chart
    record = json.loads(Path(download["value"]).read_text())
    assert record["settings"]["rule"] == "coupled" and record["differing"] == 0
    assert len(record["counts"]) == 6 and record["pair"]["label"] == "positions 1 and 2 together"  # K + 2 tokens


@pytest.mark.parametrize(
    "bug, caught",
    [
        ("noise by round", "Not the same text for any drafter"),  # exact, but the text changes with K
        ("one noise vector", "**Not lossless: at positions 1 and 2 together"),  # the same text, correlated tokens
        ("noise from the draft", "Not the same text for any drafter"),
    ],
)
def test_each_coupled_bug_fails_in_the_app_by_its_check(client, bug, caught):
    verdict, *_ = client.predict(rule="coupled", bug=bug, num_samples=10_000, api_name="/audit")
    assert caught in verdict and f"Planted bug, {bug}: {COUPLED_BUGS[bug]}" in verdict, verdict


def test_the_coupled_rule_on_the_offline_default_writes_the_target_alones_text(client):
    verdict, chart, _, download = client.predict(
        mode="model", rule="coupled", num_samples=100, num_tokens=2, api_name="/audit"
    )
    record = json.loads(Path(download["value"]).read_text())
    assert verdict.startswith("**Lossless") and "Same text for any drafter: for all 100 seeds" in verdict, verdict
    assert record["differing"] == 0 and record["settings"]["sampling"]["rule"] == "coupled"
    assert chart  # the speculative and the target-only samples' most frequent sequences
    assert sum(record["speculative"]) == sum(record["target_only"]) == 100


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
    ({"rule": "fair"}, "rule must be 'standard' or 'coupled', got 'fair'."),
    ({"rule": "coupled", "bug": "shared uniform"}, "The same text for any drafter rule has no planted bug 'shared"),
    ({"bug": "one noise vector"}, "The standard rule has no planted bug 'one noise vector': pick one of none,"),
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
    audit_threads = [t for t in threading.enumerate() if t.name == "specdemo-scheduler"]  # its rows' schedulers
    wait_until(lambda: not any(t.is_alive() for t in audit_threads), "the audit's schedulers ending")
    verdict, *_ = client.predict(num_samples=10_000, api_name="/audit")
    assert verdict.startswith("**Lossless")


def test_a_failing_model_audit_is_one_sentence_and_the_next_model_audit_runs(client, monkeypatch):
    """The audit fails holding the models' lock, as a failing pass would: this user reads one sentence, and the next
    model audit draws all its samples (planted: `failed` that yields its sentence without raising it)."""

    def failing(**settings: object) -> Iterator[float]:
        with settings["lock"]:  # type: ignore[attr-defined]
            raise RuntimeError("planted failure")
        yield 0.0  # a generator, as the audit's draws are

    monkeypatch.setattr(serving_audit, "audit_draws", failing)
    with pytest.raises(AppError) as caught:
        client.predict(mode="model", num_samples=100, num_tokens=1, api_name="/audit")
    message = str(caught.value)
    assert message.startswith("The model audit failed, and the app is still serving: try again"), message
    assert message.endswith("(RuntimeError: planted failure)."), message
    monkeypatch.undo()
    verdict, _, _, download = client.predict(mode="model", num_samples=100, num_tokens=1, api_name="/audit")
    assert verdict.startswith("**Lossless"), verdict
    assert sum(json.loads(Path(download["value"]).read_text())["speculative"]) == 100


def test_drawing_sends_each_share_returns_the_audit_and_closes_its_steps_when_closed():
    """`drawing` sends the page each share of samples the audit's steps yield, returns what they return, raises what
    they raise, and, closed early (Stop, a closed tab), closes them, so the audit's rows leave their schedulers
    (planted: steps left open)."""

    def steps() -> Generator[float, None, str]:
        yield 0.5
        return "drawn"

    shown = drawing(steps(), gr.Progress())  # type: ignore[arg-type]
    assert next(shown)[0] == "Drawing samples: 50%"
    with pytest.raises(StopIteration) as ended:
        next(shown)
    assert ended.value.value == "drawn"
    closed: list[bool] = []

    def endless() -> Generator[float, None, str]:
        try:
            while True:
                yield 0.25
        finally:
            closed.append(True)

    held = endless()  # held here, so only drawing can close it
    shown = drawing(held, gr.Progress())  # type: ignore[arg-type]
    next(shown)
    shown.close()
    assert closed == [True]

    def stopped() -> Generator[float, None, str]:
        raise InterruptedError("stopped at its next round")
        yield 0.0

    with pytest.raises(InterruptedError):
        list(drawing(stopped(), gr.Progress()))  # type: ignore[arg-type]
