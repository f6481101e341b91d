"""Many users at once, bad input of every kind, failures and budgets: the app keeps serving and says why."""

from __future__ import annotations

import json
import math
import statistics
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import psutil
import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError

import specdemo.ui as ui
from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.decoding import Round, speculative_generate
from specdemo.models import chat_prompt_ids
from specdemo.pairs import make_drafter
from tests.conftest import SPELLING, launched_app, make_round, settings, trace_of

ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
PROMPTS = (SPELLING, "Write a short poem about the sea.")
VARIANTS = (  # mixed greedy and sampled settings
    {"temperature": 0.0},
    {"temperature": 0.8, "top_p": 0.9},
    {"temperature": 1.0, "top_k": 50},
    {"temperature": 0.0, "repetition_penalty": 1.2},
)
NUM_CLIENTS, RUNS_PER_CLIENT, NEW_TOKENS = 8, 3, 48
RUN_CONCURRENCY = 2  # runs decoding at once in the load test, so they truly interleave on the shared model


@pytest.fixture(scope="module")
def client(app) -> Client:
    return Client(app, verbose=False)


@pytest.fixture
def concurrent_app(offline_model, monkeypatch) -> str:
    """An app of its own that runs RUN_CONCURRENCY runs at once on the one shared model; yields its URL."""
    monkeypatch.setattr(ui, "RUN_CONCURRENCY", RUN_CONCURRENCY)
    with launched_app(offline_model) as url:
        yield url


def track_overlap(monkeypatch) -> dict[str, int]:
    """The most speculative engines that were running at the same moment (ui.speculative_generate wrapped)."""
    engines, lock = {"running": 0, "most": 0}, threading.Lock()
    original = ui.speculative_generate

    def tracked(*args, **kwargs):
        with lock:
            engines["running"] += 1
            engines["most"] = max(engines["most"], engines["running"])
        try:
            yield from original(*args, **kwargs)
        finally:
            with lock:
                engines["running"] -= 1

    monkeypatch.setattr(ui, "speculative_generate", tracked)
    return engines


def run_alone(offline_model, prompt: str, variant: dict, seed: int) -> list[int]:
    """The same settings and seed through the engine alone, in this thread, nothing else running."""
    sampling = SamplingConfig(**{"temperature": 0.0, **variant}, seed=seed)
    speculative = SpeculativeConfig(max_new_tokens=NEW_TOKENS)
    prompt_ids = chat_prompt_ids(offline_model, prompt)
    rounds = speculative_generate(
        offline_model.model,
        make_drafter(offline_model, None, speculative),
        prompt_ids,
        sampling,
        speculative,
        offline_model.eos_token_ids,
    )
    return [token for round_ in rounds for token in round_.emitted_token_ids]


def test_eight_clients_at_once_get_exactly_what_they_would_alone(concurrent_app, offline_model, monkeypatch):
    app = concurrent_app
    engines = track_overlap(monkeypatch)
    plan = [
        (c, r, PROMPTS[(c + r) % 2], VARIANTS[(c + r) % 4], 100 * c + r)
        for c in range(NUM_CLIENTS)
        for r in range(RUNS_PER_CLIENT)
    ]
    Client(app, verbose=False).predict(**settings(max_new_tokens=8), api_name="/generate")  # pays one-time costs
    rss_after_first = psutil.Process().memory_info().rss

    def one_client(number: int) -> list[dict]:
        own = Client(app, verbose=False)
        results = []
        for _, _, prompt, variant, seed in [step for step in plan if step[0] == number]:
            started = time.perf_counter()
            job = own.submit(
                **settings(prompt, **variant, seed=seed, max_new_tokens=NEW_TOKENS, compare=False), api_name="/generate"
            )
            first_token = None
            for update in job:
                if first_token is None and "tok-" in update[0]:
                    first_token = time.perf_counter() - started
            results.append(
                {
                    "prompt": prompt,
                    "variant": variant,
                    "seed": seed,
                    "first_token": first_token,
                    "total": time.perf_counter() - started,
                    "ids": trace_of(job.outputs()[-1])["generated_token_ids"],
                }
            )
        return results

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=NUM_CLIENTS) as pool:
        results = [result for results in pool.map(one_client, range(NUM_CLIENTS)) for result in results]
    wall = time.perf_counter() - started
    rss_after_load = psutil.Process().memory_info().rss

    assert len(results) == NUM_CLIENTS * RUNS_PER_CLIENT
    assert engines["most"] >= 2, "the runs never overlapped, so cross-talk could not show"
    for result in results:  # no cross-talk: every run is the run it would have been alone
        assert result["ids"] == run_alone(offline_model, result["prompt"], result["variant"], result["seed"]), result
    growth = rss_after_load - rss_after_first
    assert growth <= max(0.10 * rss_after_first, 200 * 2**20), f"resident memory grew {growth / 2**20:.0f} MB"

    def percentile(values: list[float], share: float) -> float:
        return sorted(values)[min(len(values) - 1, round(share * (len(values) - 1)))]

    first, total = [r["first_token"] for r in results], [r["total"] for r in results]
    figures = {
        "runs": len(results),
        "clients": NUM_CLIENTS,
        "new_tokens": NEW_TOKENS,
        "wall_seconds": wall,
        "time_to_first_token_p50": statistics.median(first),
        "time_to_first_token_p95": percentile(first, 0.95),
        "total_p50": statistics.median(total),
        "total_p95": percentile(total, 0.95),
        "rss_after_first_run_mb": rss_after_first / 2**20,
        "rss_after_load_mb": rss_after_load / 2**20,
        "most_runs_at_once": engines["most"],
    }
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "load.json").write_text(json.dumps(figures, indent=2))
    print(json.dumps(figures))


BAD_INPUTS = [
    ({"prompt": ""}, "The prompt is empty"),
    ({"prompt": "   \n\t "}, "The prompt is empty"),
    ({"prompt": None}, "The prompt is empty"),
    ({"prompt": "hello\x00world"}, "control character U+0000"),
    ({"prompt": "\x1b[31mred"}, "control character U+001B"),
    ({"prompt": "a" * 1_000_000}, "The prompt is 1,000,000 characters; the limit is 50,000"),
    ({"prompt": "word " * 4500}, "the limit is 4,096"),
    # JSON has no NaN (gradio_client refuses to send one), so a client's NaN arrives as text
    ({"temperature": "nan"}, "temperature must be a number, got 'nan'"),
    ({"temperature": -0.5}, "temperature must be in [0, 10]"),
    ({"temperature": 1e9}, "temperature must be in [0, 10]"),
    ({"temperature": "hot"}, "temperature must be a number, got 'hot'"),
    ({"top_k": -1}, "top-k must be between 0 and"),
    ({"top_k": 1e12}, "top-k must be between 0 and"),
    ({"top_k": 2.5}, "top-k must be a whole number, got 2.5"),
    ({"top_k": "NaN"}, "top-k must be a whole number, got 'NaN'"),
    ({"top_p": 0.0}, "top-p must be in (0, 1]"),
    ({"top_p": 1.5}, "top-p must be in (0, 1]"),
    ({"top_p": "nan"}, "top-p must be a number, got 'nan'"),
    ({"seed": "1e400"}, "seed must be a whole number, got '1e400'"),
    ({"repetition_penalty": 0.0}, "repetition penalty must be in (0, 10]"),
    ({"repetition_penalty": -1.0}, "repetition penalty must be in (0, 10]"),
    ({"repetition_penalty": 1e6}, "repetition penalty must be in (0, 10]"),
    ({"pair": "smollm2-135m-self", "draft_temperature": -1.0}, "draft temperature must be in [0, 10]"),
    ({"num_draft_tokens": 0}, "num-draft-tokens must be between 1 and 16"),
    ({"num_draft_tokens": 100}, "num-draft-tokens must be between 1 and 16"),
    ({"num_draft_tokens": "five"}, "draft tokens per round must be a whole number, got 'five'"),
    ({"max_new_tokens": 0}, "max-new-tokens must be between 1 and 2048"),
    ({"max_new_tokens": -5}, "max-new-tokens must be between 1 and 2048"),
    ({"max_new_tokens": 10**6}, "max new tokens must be between 1 and 512 here"),
    ({"seed": -1}, "seed must be between 0 and"),
    ({"seed": 1.5}, "seed must be a whole number, got 1.5"),
    ({"pair": "fastest"}, "Unknown pair 'fastest'"),
    ({"pair": "custom", "custom_target": "gpt2"}, "'gpt2' is not a valid model id"),
    ({"pair": "custom", "custom_target": "nobody/no-such-model"}, "Could not load 'nobody/no-such-model'"),
    ({"pair": "custom", "custom_target": "/etc/passwd"}, "looks like a file path"),
    ({"pair": "custom", "custom_target": "../../models/x"}, "looks like a file path"),
    (
        {"pair": "custom", "custom_target": "smollm2-135m-instruct", "custom_draft": "not an id"},
        "'not an id' is not a valid model id",
    ),
    (
        {"pair": "custom", "custom_target": "smollm2-135m-instruct", "custom_draft": "gemma-3-270m"},
        "cannot draft for 'smollm2-135m-instruct': their tokenizers differ",
    ),
]


def test_every_bad_input_gets_one_clear_sentence_and_the_app_keeps_serving(client, tmp_path, monkeypatch):
    remote_code = tmp_path / "remote-code-model"
    remote_code.mkdir()
    (remote_code / "config.json").write_text(
        json.dumps(
            {"model_type": "my-custom-arch", "auto_map": {"AutoConfig": "x.XConfig", "AutoModelForCausalLM": "x.X"}}
        )
    )
    monkeypatch.setenv("SPECDEMO_ALLOW_LOCAL_PATHS", "1")  # an operator's setting; the id is still refused
    cases = [*BAD_INPUTS, ({"pair": "custom", "custom_target": str(remote_code)}, "needs custom code")]
    assert len(cases) >= 30
    for changes, message in cases:
        with pytest.raises(AppError) as caught:
            client.predict(**settings(**changes), api_name="/generate")
        assert message in str(caught.value), (changes, str(caught.value)[:300])
    final = client.predict(**settings(max_new_tokens=8), api_name="/generate")
    assert "tok-" in final[0]


def test_a_failure_inside_a_run_is_that_users_message_only(client, monkeypatch):
    def failing(*args, **kwargs):
        yield from ()
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(ui, "speculative_generate", failing)
    job = client.submit(**settings(max_new_tokens=8), api_name="/generate")
    with pytest.raises(AppError, match=r"The run failed \(RuntimeError: CUDA out of memory \(simulated\)\)"):
        job.result()
    assert "The run failed (RuntimeError: CUDA out of memory (simulated))" in job.outputs()[-1][1]  # the summary too
    monkeypatch.undo()
    assert "tok-" in client.predict(**settings(max_new_tokens=8), api_name="/generate")[0]


def test_a_run_past_its_time_budget_stops_and_says_so(client, monkeypatch):
    monkeypatch.setattr(ui, "RUN_TIME_BUDGET_SECONDS", 0.5)
    final = client.predict(**settings("Write a long story about the sea.", max_new_tokens=300), api_name="/generate")
    assert "Stopped after 0.5 s, the time budget of one run" in final[1]
    assert "target alone" not in final[1]  # no comparison against an unfinished run
    assert 0 < final[0].count("tok-") < 300


def test_comparisons_honour_the_time_budget(offline_model, monkeypatch):
    started: list[str] = []  # the comparisons whose engine took its first step
    original = ui.autoregressive_generate

    def recording(model, *args, **kwargs):
        started.append("draft alone" if started else "target alone")
        yield from original(model, *args, **kwargs)

    monkeypatch.setattr(ui, "autoregressive_generate", recording)
    request = ui.parse_request(*settings("Write a long story about the sea.", max_new_tokens=300).values())
    prompt_ids = chat_prompt_ids(offline_model, request.prompt)
    draft = replace(offline_model)  # another LoadedModel, so the draft-alone comparison is planned too

    def comparisons(seconds_left: float) -> tuple:
        deadline = time.monotonic() + seconds_left
        run = ui.Run(request, offline_model, draft, prompt_ids, threading.Semaphore(1), deadline)
        updates = ui.stream_comparisons(run, "", "")
        while True:
            try:
                next(updates)
            except StopIteration as done:
                return *done.value, time.monotonic() - deadline

    baseline, draft_alone, out_of_time, late = comparisons(seconds_left=1.0)
    assert out_of_time and baseline == draft_alone == []
    assert started == ["target alone"], "a comparison started after the budget"
    assert late < 0.5, f"the running comparison went on {late:.2f} s past the budget"
    started.clear()
    assert comparisons(seconds_left=-1.0)[2] and started == []  # past the budget, none starts


def fake_rounds(count: int, seconds: float, forwards: list | None = None, name: str = "") -> Iterator[Round]:
    """An engine whose rounds each take `seconds` (a forward pass), noting (name, start, end) in `forwards`."""
    for index in range(count):
        start = time.monotonic()
        time.sleep(seconds)
        if forwards is not None:
            forwards.append((name, start, time.monotonic()))
        yield make_round(index, [5, 6], 2, "bonus", seconds)


def test_a_slow_consumer_still_receives_every_round():
    engine = ui.EngineThread(fake_rounds(30, 0.05), threading.Semaphore(1), deadline=math.inf)
    received = []
    for batch in engine.batches(interval=0.1):
        received.extend(batch)
        time.sleep(2.0)  # a busy server or a slow network: the engine must not take this for a cancel
    assert [round_.index for round_ in received] == list(range(30))
    assert not engine.out_of_time


def test_a_new_engine_touches_the_models_only_after_the_stopped_one_let_go():
    forwards: list[tuple[str, float, float]] = []
    models_in_use = threading.Semaphore(1)
    stopped = ui.EngineThread(fake_rounds(100, 0.3, forwards, "stopped"), models_in_use, deadline=math.inf)
    batches = stopped.batches(interval=0.01)
    next(batches)
    batches.close()  # Stop, while the engine is in its next forward pass
    following = ui.EngineThread(fake_rounds(100, 0.3, forwards, "next"), models_in_use, deadline=math.inf)
    next(following.batches(interval=0.01))
    stopped_forwards = [(start, end) for name, start, end in forwards if name == "stopped"]
    next_start = min(start for name, start, _ in forwards if name == "next")
    assert len(stopped_forwards) <= 3, "the stopped engine went on after the round in progress"
    assert next_start >= max(end for _, end in stopped_forwards), "two engines ran the models at once"


def test_limits_are_shown_on_the_page(app):
    with urllib.request.urlopen(f"{app}config", timeout=10) as response:
        config = response.read().decode()
    assert ui.LIMITS in json.loads(config)["components"].__repr__()
    assert "4,096 tokens" in ui.LIMITS and "120 s per run" in ui.LIMITS and "up to 16 can wait" in ui.LIMITS


def test_a_full_queue_answers_at_once_instead_of_hanging(offline_model, monkeypatch):
    monkeypatch.setattr(ui, "QUEUE_SIZE", 1)
    with launched_app(offline_model) as url:
        clients = [Client(url, verbose=False) for _ in range(3)]
        long_run = settings("Write a long story about the sea.", max_new_tokens=200, compare=False)
        running = clients[0].submit(**long_run, api_name="/generate")  # takes the one run slot
        time.sleep(1.0)
        waiting = clients[1].submit(**long_run, api_name="/generate")  # takes the one waiting place
        time.sleep(0.5)
        started = time.perf_counter()
        with pytest.raises(Exception, match="Queue is full"):
            clients[2].predict(**settings(max_new_tokens=4), api_name="/generate")
        assert time.perf_counter() - started < 5
        running.cancel()
        waiting.cancel()
