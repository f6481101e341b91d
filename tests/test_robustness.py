"""Many users at once, bad input of every kind, failures and budgets: the app keeps serving and says why."""

from __future__ import annotations

import json
import statistics
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError

import specdemo.ui as ui
from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.decoding import speculative_generate
from specdemo.models import ModelCache, chat_prompt_ids
from specdemo.pairs import make_drafter
from tests.conftest import SPELLING, settings

ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
PROMPTS = (SPELLING, "Write a short poem about the sea.")
VARIANTS = (  # mixed greedy and sampled settings
    {"temperature": 0.0},
    {"temperature": 0.8, "top_p": 0.9},
    {"temperature": 1.0, "top_k": 50},
    {"temperature": 0.0, "repetition_penalty": 1.2},
)
NUM_CLIENTS, RUNS_PER_CLIENT, NEW_TOKENS = 8, 3, 48


@pytest.fixture(scope="module")
def client(app) -> Client:
    return Client(app, verbose=False)


def generated_ids(final) -> list[int]:
    with open(final[6]["value"]) as handle:
        return json.load(handle)["generated_token_ids"]


def run_alone(offline_model, prompt: str, variant: dict, seed: int) -> list[int]:
    """The same settings and seed through the engine alone, in this thread, nothing else running."""
    sampling = SamplingConfig(**{"temperature": 0.0, **variant}, seed=seed)
    speculative = SpeculativeConfig(max_new_tokens=NEW_TOKENS)
    prompt_ids = chat_prompt_ids(offline_model, prompt)
    rounds = speculative_generate(
        offline_model.model,
        make_drafter(offline_model, None, sampling, speculative),
        prompt_ids,
        sampling,
        speculative,
        offline_model.eos_token_ids,
    )
    return [token for round_ in rounds for token in round_.emitted_token_ids]


def test_eight_clients_at_once_get_exactly_what_they_would_alone(app, client, offline_model):
    plan = [
        (c, r, PROMPTS[(c + r) % 2], VARIANTS[(c + r) % 4], 100 * c + r)
        for c in range(NUM_CLIENTS)
        for r in range(RUNS_PER_CLIENT)
    ]
    client.predict(*settings(max_new_tokens=8), api_name="/generate")  # the first run pays one-time costs
    rss_after_first = psutil.Process().memory_info().rss

    def one_client(number: int) -> list[dict]:
        own = Client(app, verbose=False)
        results = []
        for _, _, prompt, variant, seed in [step for step in plan if step[0] == number]:
            started = time.perf_counter()
            job = own.submit(
                *settings(prompt, **variant, seed=seed, max_new_tokens=NEW_TOKENS, compare=False), api_name="/generate"
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
                    "ids": generated_ids(job.outputs()[-1]),
                }
            )
        return results

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=NUM_CLIENTS) as pool:
        results = [result for results in pool.map(one_client, range(NUM_CLIENTS)) for result in results]
    wall = time.perf_counter() - started
    rss_after_load = psutil.Process().memory_info().rss

    assert len(results) == NUM_CLIENTS * RUNS_PER_CLIENT
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
            client.predict(*settings(**changes), api_name="/generate")
        assert message in str(caught.value), (changes, str(caught.value)[:300])
    final = client.predict(*settings(max_new_tokens=8), api_name="/generate")
    assert "tok-" in final[0]


def test_a_failure_inside_a_run_is_that_users_message_only(client, monkeypatch):
    def failing(*args, **kwargs):
        yield from ()
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(ui, "speculative_generate", failing)
    with pytest.raises(AppError, match=r"The run failed \(RuntimeError: CUDA out of memory \(simulated\)\)"):
        client.predict(*settings(max_new_tokens=8), api_name="/generate")
    monkeypatch.undo()
    assert "tok-" in client.predict(*settings(max_new_tokens=8), api_name="/generate")[0]


def test_a_run_past_its_time_budget_stops_and_says_so(client, monkeypatch):
    monkeypatch.setattr(ui, "RUN_TIME_BUDGET_SECONDS", 0.5)
    final = client.predict(*settings("Write a long story about the sea.", max_new_tokens=300), api_name="/generate")
    assert "Stopped after 0.5 s, the time budget of one run" in final[1]
    assert "target alone" not in final[1]  # no comparison against an unfinished run
    assert 0 < final[0].count("tok-") < 300


def test_limits_are_shown_on_the_page(app):
    with urllib.request.urlopen(f"{app}config", timeout=10) as response:
        config = response.read().decode()
    assert ui.LIMITS in json.loads(config)["components"].__repr__()
    assert "4,096 tokens" in ui.LIMITS and "120 s per run" in ui.LIMITS and "up to 16 can wait" in ui.LIMITS


def test_a_full_queue_answers_at_once_instead_of_hanging(offline_model, monkeypatch):
    cache = ModelCache(pinned=offline_model.name)
    cache.put(offline_model)
    monkeypatch.setattr(ui, "QUEUE_SIZE", 1)
    demo = ui.build_demo(cache)
    _, url, _ = demo.launch(prevent_thread_lock=True, quiet=True)
    try:
        clients = [Client(url, verbose=False) for _ in range(3)]
        long_run = settings("Write a long story about the sea.", max_new_tokens=200, compare=False)
        running = clients[0].submit(*long_run, api_name="/generate")  # takes the one run slot
        time.sleep(1.0)
        waiting = clients[1].submit(*long_run, api_name="/generate")  # takes the one waiting place
        time.sleep(0.5)
        started = time.perf_counter()
        with pytest.raises(Exception, match="Queue is full"):
            clients[2].predict(*settings(max_new_tokens=4), api_name="/generate")
        assert time.perf_counter() - started < 5
        running.cancel()
        waiting.cancel()
    finally:
        demo.close()
