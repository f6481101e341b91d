"""The app through gradio_client, launched in-process on the offline default: streaming, Stop, errors, parity."""

from __future__ import annotations

import itertools
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import gradio as gr
import httpx
import plotly.graph_objects as go
import pytest
import torch
from gradio_client import Client
from gradio_client.exceptions import AppError

import specdemo.app.tabs.one_prompt as one_prompt
from specdemo.app import page
from specdemo.app.form import parse_request
from specdemo.app.serving.divergence import divergence as find_divergence
from specdemo.app.serving.divergence import noise_seed
from specdemo.app.serving.handlers import Downloads
from specdemo.app.serving.runs import Run, Server
from specdemo.app.tabs import batch
from specdemo.cli.main import main
from specdemo.core.stats import emitted_ids
from specdemo.engine.decoding import autoregressive_generate
from specdemo.engine.scheduler import DecodeRequest, Schedulers
from specdemo.models.loading import chat_prompt_ids, native_bfloat16
from specdemo.models.shared import ModelCache
from tests.app_helpers import SPELLING, settings
from tests.helpers import (
    HANG_GUARD_SECONDS,
    SMOLLM2_CPU,
    STORY,
    assert_stopped_runs_leave_at_the_next_round,
    count_rounds,
    make_round,
    trace_of,
    wait_for_rounds,
    wait_until,
)

SETTING_NAMES = [*settings()]  # the /generate parameters, in the settings table's order
TODAYS_NAMES = [  # the API's names and order before the settings table: they keep working
    *("prompt", "pair", "custom_target", "custom_draft", "temperature", "top_k", "top_p", "repetition_penalty"),
    *("draft_temperature", "num_draft_tokens", "max_new_tokens", "seed", "chat", "compare", "num_candidates", "dtype"),
]


@pytest.fixture(scope="module")
def client(app) -> Client:
    return Client(app, verbose=False)


def direct_run(loaded, values: dict) -> Run:
    """A run of `values` on `loaded`, made as the page makes one, without the page."""
    request = parse_request(values.pop("prompt"), values)
    prompt_ids = chat_prompt_ids(loaded, request.prompt)[0].tolist()
    deadline = time.monotonic() + HANG_GUARD_SECONDS  # no budget ends a test's run
    return Run(request, loaded, None, [prompt_ids], Schedulers(), deadline, threading.Event())


def direct_server(loaded, folder) -> Server:
    return Server(ModelCache(), Schedulers(), Downloads(str(folder)), None)


def cli_run(capsys, prompt: str, **options: object) -> dict:
    """The CLI's run for the same settings (`python -m specdemo generate ... --json`)."""
    arguments = ["generate", "--prompt", prompt, "--json"]
    for name, value in {"dtype": "float32", **options}.items():  # the format settings() asks the app for
        arguments += [f"--{name.replace('_', '-')}", str(value)]
    assert main(arguments) == 0
    return json.loads(capsys.readouterr().out)


def test_a_run_streams_growing_tokens_and_ends_with_every_output(client):
    """Without the comparison, which test_a_client_that_sends_only_the_prompt_gets_a_full_run reads."""
    job = client.submit(**settings(compare=False), api_name="/generate")
    updates = list(job)
    tokens = [update[0] for update in updates]
    assert len(updates) >= 3
    assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(tokens))
    assert 'class="tok tok-' in tokens[-1] and "title=" in tokens[-1]
    assert all(update[1].endswith("…*") for update in updates[:-1])  # a streamed summary says it is not the last
    final = job.outputs()[-1]
    summary, charts, trace = final[1], final[2:6], final[6]
    assert not summary.endswith("…*")
    assert all(chart is not None and "plot" in str(chart) for chart in charts)
    assert trace and trace["value"].endswith(".json")
    assert "not measured: the comparison was off" in final[8] and "tokens per target pass" in final[8]  # headline


def test_the_api_names_every_setting_and_defaults_all_but_the_prompt(client):
    parameters = client.view_api(return_format="dict", print_info=False)["named_endpoints"]["/generate"]["parameters"]
    assert [p["parameter_name"] for p in parameters] == SETTING_NAMES
    assert SETTING_NAMES[: len(TODAYS_NAMES)] == TODAYS_NAMES  # new settings come after, drafter options first
    assert SETTING_NAMES[len(TODAYS_NAMES) :] == ["max_ngram_size", "min_ngram_size", "suffix_cache_tokens", "rule"]
    assert [p["parameter_name"] for p in parameters if not p["parameter_has_default"]] == ["prompt"]
    defaults = {p["parameter_name"]: p["parameter_default"] for p in parameters}
    assert defaults["pair"] == "smollm2-135m-ngram" and defaults["max_new_tokens"] == 128 and defaults["compare"]
    assert defaults["dtype"] == "auto" and defaults["rule"] == "standard"


def test_the_rule_is_a_choice_on_the_page_in_the_sampling_settings(app):
    components = httpx.get(f"{app}config").json()["components"]
    [rule] = [c for c in components if c["props"].get("elem_id") == "rule"]
    assert rule["type"] == "radio" and rule["props"]["value"] == "standard"
    assert [list(choice) for choice in rule["props"]["choices"]] == [
        ["standard", "standard"],
        ["same text for any drafter", "coupled"],
    ]
    assert "min(1, p/q)" in rule["props"]["info"] and "whatever drafts" in rule["props"]["info"]


def test_a_sampled_run_under_the_coupled_rule_is_checked_against_the_target_alone_token_for_token(client):
    """Under the coupled rule a sampled run's text is the target alone's for its seed: the summary says so, and sets
    the match chance the rule predicts from the run's own p and q beside the measured one; under the standard rule a
    sampled run's text is another draw, and no check is shown."""
    sampled = {"temperature": 0.8, "seed": 3, "max_new_tokens": 24}
    final = client.predict(**settings(**sampled, rule="coupled"), api_name="/generate")
    summary, trace = final[1], trace_of(final)
    assert trace["sampling"]["rule"] == "coupled"
    assert "Same-text check (coupled rule, seed 3): the two texts are **identical**, token for token." in summary
    assert "tok-accepted" in final[0] and "tok-rejected" in final[0]  # drafts were refused, and the text is the same
    rounds = trace["rounds"]
    matched = sum(r["num_accepted"] for r in rounds)
    tested = sum(min(len(r["draft_token_ids"]), r["num_accepted"] + 1) for r in rounds)
    assert f"measured: {matched} of {tested} matched" in summary, summary
    standard = client.predict(**settings(**sampled | {"max_new_tokens": 8}), api_name="/generate")[1]
    assert "Speedup" in standard and "check" not in standard and "Theory beside measurement" not in standard


def test_the_same_seed_lesson_runs_a_sampled_run_whose_text_is_the_target_alones(app_server):
    """The lesson's run, as its button starts it (the lesson's own values): the self-drafting pair at temperature 0.8
    under the coupled rule, drafts refused, and the same text as the target alone's."""
    from specdemo.app.form import RUN_FIELDS
    from specdemo.app.panels.lessons import LESSONS

    [lesson] = [lesson for lesson in LESSONS if lesson.key == "same-seed"]
    values = lesson.values(RUN_FIELDS)
    values[[spec.name for spec in RUN_FIELDS].index("max_new_tokens")] = 16  # the lesson's 32, halved for time
    updates = list(one_prompt.run_steps(app_server, lesson.prompt, *values, run_id="same-seed"))
    tokens, summary = updates[-1][0], updates[-1][1]
    assert "Same-text check (coupled rule, seed 0): the two texts are **identical**, token for token." in summary
    assert "tok-rejected" in tokens  # the draft model's guesses were refused, and the text is still the target's
    assert "**Theory beside measurement**: from this run's own p and q" in summary


def test_the_coupled_rules_chances_are_the_means_over_tested_drafts_beside_the_share_that_matched():
    """Two drafted positions (the first matched, the second not) and a bonus position, which counts for nothing."""
    from specdemo.app.views.summary import chances_line, coupled_chances
    from specdemo.core.rounds import CoupledChoice

    matched = CoupledChoice(5, -0.1, 0.2, 5, -0.1, 0.2, 0.4, 0.5, 0.6)  # 1 - TV 0.4, a match chance of 0.5..0.6
    missed = CoupledChoice(6, 0.3, 1.0, 9, -1.2, 0.5, 0.2, 0.3, 0.4)
    bonus = CoupledChoice(7, 0.1, 0.4, None, None, None, None, None, None)
    rounds = [
        replace(make_round(0, [5, 9], 1, "resampled", 0.1), coupled=(matched, missed)),
        replace(make_round(1, [], 0, "bonus", 0.1), coupled=(bonus,)),
    ]
    assert chances_line(coupled_chances(rounds)) == (
        "**Theory beside measurement**: from this run's own p and q at its 2 tested drafts, the coupled rule predicts "
        "a draft matches the target's token 40% to 50% of the time (the standard rule would accept 30%, 1 − TV); "
        "measured: 1 of 2 matched (50%)."
    )
    assert coupled_chances([make_round(0, [5, 9], 1, "resampled", 0.1)]) is None  # the standard rule's rounds
    fixed = replace(missed, standard_chance=0.3, coupled_chance=0.3, coupled_chance_high=0.3)  # a one-hot q: p(x)
    line = chances_line(coupled_chances([replace(rounds[0], coupled=(fixed,))]))
    assert "token 30% of the time (the standard rule would accept 30%, 1 − TV; the two agree where" in line
    three = replace(matched, coupled_chance=0.7, coupled_chance_high=0.72, num_alive=3)  # W = 3's first position
    wide = coupled_chances([replace(rounds[0], coupled=(three, missed)), rounds[1]])
    assert (wide.coupled_low, wide.coupled_high, wide.most_alive) == (0.5, 0.56, 3)
    assert chances_line(wide) == (
        "**Theory beside measurement**: from this run's own p and q at its 2 tested positions, the coupled rule "
        "predicts that at least one of the candidates tested at a position (those still on the path, up to 3) matches "
        "the target's token 50% to 56% of the time; measured: one matched at 1 of 2 positions (50%). The standard "
        "rule would accept one candidate drafted from q 30% of the time (1 − TV, per candidate)."
    )


def test_a_client_that_sends_only_the_prompt_gets_a_full_run(client):
    final = client.predict(SPELLING, api_name="/generate")
    assert "tok-accepted" in final[0]
    assert "Speedup" in final[1] and "identical" in final[1]  # the comparison ran: compare defaults to on
    assert "speedup over the target alone" in final[8] and "tokens per target pass" in final[8]  # the headline
    trace = trace_of(final)
    assert trace["pair"]["key"] == "smollm2-135m-ngram" and trace["speculative"]["max_new_tokens"] == 128


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
            client.predict(**inputs, api_name="/generate")
        assert message in str(caught.value), (message, str(caught.value))
    assert "tok-" in client.predict(**settings(max_new_tokens=8), api_name="/generate")[0]  # still serving


def test_the_page_names_the_number_format_and_refuses_one_the_device_lacks(client):
    cpu = torch.device("cpu")
    reason = (
        "bfloat16 (auto: this CPU has native bfloat16)"
        if native_bfloat16(cpu)
        else ("float32 (auto: this CPU has no native bfloat16)")
    )
    final = client.predict(**settings(max_new_tokens=8, dtype="auto"), api_name="/generate")
    assert f"Number format: {reason}." in final[1] and trace_of(final)["dtype_reason"] == reason
    summary = client.predict(prompts=["hi"], max_new_tokens=4, dtype="float32", api_name="/generate_batch")[1]
    assert "Number format: float32 (chosen)." in summary
    refusals = [("float64", "Unknown number format 'float64': use auto")]
    if not native_bfloat16(cpu):
        refusals.append(("bfloat16", "This CPU has no native bfloat16 (AMX or AVX-512 BF16), so bfloat16 would run"))
    for dtype, message in refusals:
        for inputs, api_name in [
            (settings(dtype=dtype), "/generate"),
            ({"prompts": ["hi"], "dtype": dtype}, "/generate_batch"),
        ]:
            with pytest.raises(AppError) as caught:
                client.predict(**inputs, api_name=api_name)
            assert message in str(caught.value), (message, str(caught.value)[:300])
    assert "tok-" in client.predict(**settings(max_new_tokens=4), api_name="/generate")[0]  # still serving


def test_the_suffix_pair_shows_each_rounds_choice_and_what_its_plans_expected(client, monkeypatch):
    """The page's tokens carry the round's plan in their tooltips; the summary sets the plans' expected speedup beside
    the measured one; the trace keeps every plan; and the text is the target alone's (greedy). The plans use an idle
    CPU's pass costs: costs measured on a busy machine plan short drafts or none (the plan's own tests:
    drafters/test_suffix.py)."""
    from specdemo.engine import drafting
    from specdemo.engine.cost_watch import CostWatch

    monkeypatch.setattr(drafting, "pass_costs", lambda model, max_tokens: SMOLLM2_CPU)
    monkeypatch.setattr(CostWatch, "observe", lambda self, plan, seconds: None)
    prompt = "Copy this list exactly: red, green, blue, red, green, blue, red, green, blue."
    final = client.predict(**settings(prompt, pair="smollm2-135m-suffix", num_draft_tokens=12), api_name="/generate")
    tokens, summary, trace = final[0], final[1], trace_of(final)
    assert "drafted " in tokens and "tokens for" in tokens  # e.g. title="... drafted 12: expected 5.39 tokens for..."
    assert "**Cost-aware drafting**" in summary and "The plans expected" in summary and "measured" in summary
    assert "the two texts are **identical**" in summary
    plans = [r["plan"] for r in trace["rounds"] if r["plan"]]
    assert plans and any(p["num_tokens"] > 5 for p in plans), [p["says"] for p in plans]


def test_the_target_alone_streams_as_the_speculative_run_did(offline_model, monkeypatch, tmp_path):
    """The comparison run loads the page as the speculative run did (its text every batch, two charts at the same
    pace), so a browser on the server's cores slows both alike; its text stays, folded, under the tokens."""
    monkeypatch.setattr(one_prompt, "TOKENS_INTERVAL_SECONDS", 0.02)  # several updates on any device
    monkeypatch.setattr(one_prompt, "CHART_INTERVAL_SECONDS", 0.1)
    run = direct_run(offline_model, settings(max_new_tokens=24))
    updates = list(one_prompt.stream_run(direct_server(offline_model, tmp_path), run))
    comparing = [u for u in updates if "Now decoding with the target alone" in u[1]]
    so_far = [int(u[0].split("decoding, ")[1].split(" tokens so far")[0]) for u in comparing]
    assert len(comparing) >= 3 and so_far == sorted(so_far) and so_far[-1] > so_far[0], so_far
    assert all(u[0].startswith(comparing[0][0].split('<details class="alone" open>')[0]) for u in comparing)
    drawn = [u for u in comparing if isinstance(u[3], go.Figure)]  # the latency chart
    assert len(drawn) >= 2 and all(isinstance(u[5], go.Figure) for u in drawn)  # and the tokens over time
    assert [t["name"] for t in drawn[-1][3].data][-1] == "target alone"
    growth = [len(u[5].data[-1].x) for u in drawn]  # the target alone's line in the tokens-over-time chart
    assert growth[-1] > growth[0], growth
    final = updates[-1][0]
    assert final.endswith("</details>") and '<details class="alone"><summary>The target alone: 24 tokens' in final


def test_a_greedy_difference_is_located_with_the_targets_top_two_there(offline_model):
    run = direct_run(offline_model, settings(SPELLING, max_new_tokens=6))
    request, prompt_ids = run.request, torch.tensor(run.prompts)  # [1, T]
    eos = offline_model.eos_token_ids
    baseline = list(autoregressive_generate(offline_model.model, prompt_ids, request.sampling, 6, eos))
    target_ids = emitted_ids(baseline)
    assert find_divergence(run, baseline, baseline) is None
    swapped = (target_ids[3] + 1) % offline_model.vocab_size  # the "speculative" run emits another 4th token
    speculative = [*baseline[:3], replace(baseline[3], next_token_id=swapped), *baseline[4:]]
    divergence = find_divergence(run, speculative, baseline)
    decode = offline_model.tokenizer.decode
    assert (divergence.position, divergence.dtype) == (4, str(offline_model.model.dtype).removeprefix("torch."))
    assert divergence.speculative_text == decode([swapped]) and divergence.target_text == decode([target_ids[3]])
    with torch.inference_mode():  # the target alone's 4th token is its argmax after the shared prefix
        logits = offline_model.model(torch.tensor([[*prompt_ids[0].tolist(), *target_ids[:3]]])).logits[0, -1]
    top2 = logits.float().topk(2).values
    assert divergence.top2_logit_gap == pytest.approx(float(top2[0] - top2[1]), abs=1e-4)
    assert 1 > divergence.top2_probs[0] >= divergence.top2_probs[1] > 0


def test_a_coupled_difference_is_located_with_the_targets_top_two_scores_there(offline_model):
    """The page draws the rule's noise as the engine does (the noise at each emitted token is the one the engine
    recorded), so at a differing token the best log p + G is the target alone's own token."""
    from specdemo.app.views.same_text import greedy_check
    from specdemo.core.coupled import NoiseAsk, position_noise
    from specdemo.models.fixed_shape import SEED_BITS

    run = direct_run(offline_model, settings(SPELLING, temperature=0.8, seed=5, rule="coupled", max_new_tokens=8))
    request, device, vocab_size = run.request, offline_model.device, offline_model.vocab_size
    decoded = {}
    for drafting in (True, False):
        stream = run.submit(
            run.target, [DecodeRequest(run.prompts[0], request.sampling, request.speculative, drafting)]
        )
        decoded[drafting] = [round_ for batch in stream.rounds(0.1) for round_ in batch]
    speculative, baseline = decoded[True], decoded[False]
    assert emitted_ids(speculative) == emitted_ids(baseline)  # the rule's promise, which the page checks
    seed = noise_seed(request.sampling, device)
    assert 0 <= seed < 2**SEED_BITS
    start = len(run.prompts[0])
    for round_ in speculative:
        for offset, choice in enumerate(round_.coupled):
            noise = position_noise(NoiseAsk(seed, start + offset, 1, 0, (), vocab_size, device))[0]  # [V]
            assert float(noise[choice.target_id]) == choice.target_noise
        start += len(round_.emitted_token_ids)
    assert find_divergence(run, speculative, baseline) is None
    target_ids = emitted_ids(baseline)
    swapped = (target_ids[3] + 1) % vocab_size  # the "speculative" run emits another 4th token
    changed = [*baseline[:3], replace(baseline[3], next_token_id=swapped), *baseline[4:]]
    divergence = find_divergence(run, changed, baseline)
    decode = offline_model.tokenizer.decode
    assert (divergence.position, divergence.temperature) == (4, 0.8)
    assert divergence.speculative_text == decode([swapped]) and divergence.target_text == decode([target_ids[3]])
    assert divergence.top2_logit_gap > 0 and 1 >= divergence.top2_probs[0] > 0 and 1 >= divergence.top2_probs[1] > 0
    assert divergence.top2_probs[0] == pytest.approx(baseline[3].next_token_prob, rel=1e-4)  # its best: the alone's
    check = greedy_check(False, divergence, coupled_seed=5)
    assert check.startswith("Same-text check (coupled rule, seed 5): the two texts **differ** from generated token 4")
    assert "top two scores log p + G are" in check


def test_stop_ends_the_generation_at_the_next_round(client, monkeypatch):
    counter = count_rounds(monkeypatch)
    job = client.submit(**settings(STORY, max_new_tokens=400, compare=False), api_name="/generate")
    wait_for_rounds(counter, 3)
    job.cancel()
    assert_stopped_runs_leave_at_the_next_round(counter)
    assert "tok-" in client.predict(**settings(max_new_tokens=8), api_name="/generate")[0]  # the next run works


def test_a_slow_client_gets_the_whole_run_and_can_still_stop_it(client, monkeypatch, capsys):
    counter = count_rounds(monkeypatch)
    sampled = {"temperature": 0.8, "top_p": 0.9, "seed": 11, "max_new_tokens": 32}
    job = client.submit(**settings(**sampled, compare=False), api_name="/generate")
    for number, _ in enumerate(job):
        if number == 0:  # a slow network or a paused tab: the client reads nothing more until the run has ended
            wait_until(counter.all_left, "the run decoded to its end")
    assert (
        trace_of(job.outputs()[-1])["generated_token_ids"]
        == cli_run(capsys, SPELLING, **sampled)["generated_token_ids"]
    )

    job = client.submit(**settings(STORY, max_new_tokens=400, compare=False), api_name="/generate")
    wait_for_rounds(counter, counter.rounds + 3)
    wait_for_rounds(counter, counter.rounds + 20)  # the client reads nothing while the run goes on, then stops it
    job.cancel()
    assert_stopped_runs_leave_at_the_next_round(counter)


def test_a_dropped_client_ends_the_engine_at_the_next_round(app, monkeypatch):
    counter = count_rounds(monkeypatch)
    dependencies = httpx.get(f"{app}config").json()["dependencies"]
    fn_index = next(d["id"] for d in dependencies if d.get("api_name") == "generate")
    data = list(settings(STORY, max_new_tokens=400, compare=False).values())
    joined = {"data": data, "fn_index": fn_index, "session_hash": "dropped-client", "event_data": None}
    assert httpx.post(f"{app}gradio_api/queue/join", json=joined).status_code == 200
    with httpx.stream("GET", f"{app}gradio_api/queue/data", params={"session_hash": "dropped-client"}) as stream:
        for line in stream.iter_lines():  # the page's own protocol, until the first tokens arrive
            if "tok-" in line:
                break
    # The connection is closed here, as when a tab is closed or a network drops.
    assert_stopped_runs_leave_at_the_next_round(counter)


def test_the_app_reproduces_the_cli_for_the_same_seed(client, capsys):
    sampled = {"temperature": 0.8, "top_p": 0.9, "seed": 7, "max_new_tokens": 24}
    trace = trace_of(client.predict(**settings(**sampled, compare=False), api_name="/generate"))
    cli = cli_run(capsys, SPELLING, **sampled)
    assert trace["generated_token_ids"] == cli["generated_token_ids"]
    assert [r["uniforms"] for r in trace["rounds"]] == [r["uniforms"] for r in cli["rounds"]]


def test_generate_batch_by_name_returns_one_result_per_prompt(client):
    prompts = [
        "Correct the spelling: The quartely planing meeting is moved.",
        "Write a poem about the sea.",
        "List three colours.",
    ]
    lanes, summary, _, results = client.predict(
        prompts=prompts, temperature=0.7, seed=5, max_new_tokens=16, num_candidates=2, api_name="/generate_batch"
    )
    assert [r["prompt"] for r in results] == prompts and [r["seed"] for r in results] == [5, 6, 7]
    assert all(r["token_ids"] and r["text"] and r["stats"]["num_generated"] == len(r["token_ids"]) for r in results)
    assert lanes.count('class="lane"') == 3 and "tokens/s in all" in summary
    # one per line, as the page sends them, gives the same rows with the same seeds
    again = client.predict(
        prompts="\n".join(prompts),
        temperature=0.7,
        seed=5,
        max_new_tokens=16,
        num_candidates=2,
        api_name="/generate_batch",
    )[3]
    assert [r["token_ids"] for r in again] == [r["token_ids"] for r in results]


def test_the_batch_summary_names_the_lane_whose_rounds_were_the_batchs():
    """A batch takes as many rounds as its longest lane: lane 2 here (3 passes for 5 tokens), although lane 1 emitted
    more tokens in fewer passes."""
    lanes = [
        [make_round(0, [1, 2, 3, 4, 5], 5, "bonus", 0.1)],
        [make_round(i, [7], 1 if i < 2 else 0, "resampled", 0.1) for i in range(3)],
        [make_round(0, [], 0, "bonus", 0.1), make_round(1, [], 0, "bonus", 0.1)],
    ]
    summary = batch.batch_summary(lanes, 13, 1.0, "float32")
    assert "longest lane, lane 2: 3 target passes for 5 tokens" in summary, summary


def test_bad_batches_get_one_sentence_and_the_app_keeps_serving(client):
    cases = [
        ({"prompts": ["hi"] * 9}, "The batch has 9 prompts; at most 8 run together: remove 1"),
        ({"prompts": "first\n\nthird"}, "Line 2 of the batch is empty: remove it or write a prompt on it."),
        ({"prompts": ["ok", "bad\x00"]}, "Line 2 of the batch: The prompt contains the control character U+0000"),
        ({"prompts": ["ok"], "num_candidates": 9}, "num-candidates must be between 1 and 8"),
        ({"prompts": ["ok"], "max_new_tokens": 9999}, "max new tokens must be between 1 and 512 here"),
        ({"prompts": ["ok", "word " * 4500]}, "Prompt 2: The prompt is"),
        ({"prompts": []}, "The batch is empty"),
        (
            {"prompts": ["a", "b", "c"], "seed": 2**63 - 1},
            "too large for the batch's 3 prompts: row k decodes with seed + k - 1, so the last row (row 3)",
        ),
    ]
    for inputs, message in cases:
        with pytest.raises(AppError) as caught:
            client.predict(**inputs, api_name="/generate_batch")
        assert message in str(caught.value), (message, str(caught.value)[:300])
    assert client.predict(prompts=["hi"], max_new_tokens=4, api_name="/generate_batch")[3][0]["token_ids"]


def test_the_queue_looks_for_events_every_20_ms_not_every_1():
    """Gradio's queue polls; each poll takes the GIL from the engine's thread. Its private periods are set, and a
    Gradio that renames them fails here."""
    with gr.Blocks() as demo:
        gr.Markdown("queue")
    demo.queue()
    page.calm_queue_polling(demo)
    for name, seconds in page.QUEUE_POLL_SECONDS.items():
        assert getattr(demo._queue, name) == seconds, name


def test_many_runs_leave_a_bounded_folder_of_downloads(app, app_server, monkeypatch):
    """Every trace and audit file lives in one folder of Gradio's cache, which keeps the newest few (MAX_DOWNLOADS; 4
    here, so 12 runs overflow it thrice): a Space that runs for weeks does not fill its disk. Before, each run left a
    file in /tmp for good."""
    folder = app_server.downloads.folder
    monkeypatch.setattr(app_server.downloads, "limit", 4)

    def trace_path(seed: int) -> str:
        run = {"prompt": f"Count to {seed}.", "max_new_tokens": 2, "compare": False, "seed": seed}
        return Client(app, verbose=False).predict(**run, api_name="/generate")[6]["value"]

    with ThreadPoolExecutor(max_workers=4) as pool:  # users at the same time, as on a Space
        paths = list(pool.map(trace_path, range(12)))
    files = list(folder.glob("*.json"))
    assert len(files) == 4, len(files)
    assert Path(paths[-1]).name in {file.name for file in files}  # the newest is kept, and served from there
    assert json.loads(Path(paths[-1]).read_text())["prompt"] == "Count to 11."


def test_next_round_decodes_one_round_a_press_and_gives_the_tokens_of_the_same_run(app_server, monkeypatch):
    """The step view's Next round with nothing to step through decodes the form's run one round per press (the record
    growing by one, 'so far' while it goes on), and its rounds are those of the same run decoded whole, planned with
    the same pass costs."""
    from specdemo.app.form import names
    from specdemo.app.panels import step_view
    from specdemo.engine.cost_watch import CostWatch

    # On a busy machine the cost watch may measure the costs again between the two runs (engine/cost_watch.py); other
    # costs plan other rounds, whose sampled tokens agree in law but not draw for draw. The costs stay as they are.
    monkeypatch.setattr(CostWatch, "observe", lambda self, plan, seconds: None)
    values = settings("Explain why the sky is blue.", pair="smollm2-135m-self", temperature=0.7, max_new_tokens=20)
    form = [values["prompt"], *(values[name] for name in names())]
    record, stepper, upto = None, None, 0
    for press in range(1, 4):
        record, stepper, slider, _ = step_view.next_step(app_server, record, stepper, upto, *form)
        upto = slider["value"]
        assert upto == len(record["rounds"]) == press and record["live"]
        assert "so far" in step_view.show_round(record, upto)[0]
    while record["live"]:
        record, stepper, slider, _ = step_view.next_step(app_server, record, stepper, slider["value"], *form)
    run = app_server.prepare([values["prompt"]], {n: values[n] for n in names()}, gr.Progress(), threading.Event())
    stream = run.submit(run.target, [DecodeRequest(run.prompts[0], run.request.sampling, run.request.speculative)])
    alone = [round_ for batch in stream.rounds(0.1) for round_ in batch]
    assert emitted_ids(stepper.decoded) == emitted_ids(alone) and len(record["rounds"]) == len(alone)
    assert [r.uniforms for r in stepper.decoded] == [r.uniforms for r in alone]
    last = step_view.next_step(app_server, record, stepper, len(alone), *form)
    assert "That was the last round" in last[3]
