"""Every failure and refusal a visitor meets is one sentence of ours: ZeroGPU's refusals as `spaces`' own scheduling
client words them (each of its limits said apart, with the seconds actually asked on a GPU whose duration factor
scales them), any exception of a GPU function, a model that fails to load; and a run's budget leaves room for its
set-up, and a model audit stops at the end of its own."""

from __future__ import annotations

import json
import re
import threading
from datetime import timedelta
from importlib.resources import files

import gradio as gr
import httpx
import pytest
import torch
from gradio_client import Client
from gradio_client.exceptions import AppError
from spaces.zero import api, client, config
from spaces.zero.gradio import error as spaces_error

import specdemo.app.serving.audit as audit
import specdemo.app.serving.zerogpu as zerogpu
from specdemo.app.serving.handlers import Downloads
from specdemo.app.serving.messages import failure_sentence, loading
from specdemo.app.serving.runs import Server
from specdemo.engine.decoding import NonFiniteLogits
from specdemo.engine.scheduler import Schedulers
from specdemo.models.shared import ModelCache
from tests.app_helpers import settings

LOWER = "lower max new tokens or turn off the comparison"
BLACKWELL = next(
    gpu for gpu in json.loads(files("spaces.zero").joinpath("configs.json").read_text()) if "Blackwell" in gpu["model"]
)
NO_GPU = r"^No ZeroGPU card was free for this run, all were lent to other calls: try again in a minute, or replay "
RECORDED = "or replay a recorded run in the step view, which needs no GPU."


class Headers(dict):
    """A request's headers as spaces reads them (it asks for a `__dict__`, which Starlette's headers have)."""


class Request:
    def __init__(self, headers: dict[str, str]) -> None:
        self.headers = Headers(headers)


class DeviceAPI:
    """ZeroGPU's device API answering every schedule with `answer` (a response and its metadata)."""

    def __init__(self, answer: tuple) -> None:
        self.answer = answer

    def schedule(self, **_: object) -> tuple:
        return self.answer


@pytest.fixture
def on_blackwell(monkeypatch):
    """The app on ZeroGPU's half Blackwell card, as spaces describes it: its duration factor is 1.5."""
    assert BLACKWELL["duration_factor"] == 1.5
    monkeypatch.setattr(zerogpu, "ON_ZEROGPU", True)
    monkeypatch.setattr(config, "get_config", lambda: BLACKWELL)


def refused(answer: tuple, token: bool, seconds: int = 20) -> str:
    """The sentence a call that asked for `seconds` gets when ZeroGPU answers `answer`, through spaces' own schedule."""
    headers = {"x-ip-token": "header.e30.signature"} if token else {}  # a visitor's token (its payload: {})
    client.api_client = lambda: DeviceAPI(answer)
    try:
        with pytest.raises(gr.Error) as caught:
            client.schedule(0, Request(headers), timedelta(seconds=seconds))
    finally:
        del client.api_client  # spaces' own again
    return str(zerogpu.refusal(caught.value, seconds, LOWER).message)


def quota(left: int, wait: timedelta) -> tuple:
    return api.QuotaInfos(left=left, wait=wait), api.ScheduleMetadata()


@pytest.mark.parametrize(
    "answer, token, sentence",
    [
        (
            quota(12, timedelta(minutes=10)),
            True,
            r"^This run asks ZeroGPU for 30 s of GPU time \(20 s, counted 1\.5 times on this Space's GPU\) and your "
            rf"quota has 12 s left: {LOWER}, try again in 0:10:00, {RECORDED}$",
        ),
        (quota(100, timedelta(0)), True, rf"^You have started as many ZeroGPU runs as your quota allows .*{RECORDED}$"),
        (
            quota(12, timedelta(minutes=10)),
            False,
            r"^This Space has used up the GPU time ZeroGPU lends to calls that carry no visitor's token \(an API "
            r"client that sends no X-IP-Token header\): run it from the Space's page, or call it with your Hugging "
            r"Face token",
        ),
        (
            quota(0, timedelta(seconds=-1)),
            True,
            rf"^This run asks ZeroGPU for 30 s of GPU time, more than it lends to one call: {LOWER}\.$",
        ),
        ((iter([api.QueueEvent(event="failed")]), api.ScheduleMetadata(queuing_reason="node")), False, NO_GPU),
        ((iter([api.QueueEvent(event="failed")]), api.ScheduleMetadata(queuing_reason="node")), True, NO_GPU),
        ((httpx.codes.SERVICE_UNAVAILABLE, api.ScheduleMetadata()), True, NO_GPU),
    ],
    ids=["visitor-quota", "runs-limit", "space-limit", "too-long", "queue-no-token", "queue-timeout", "no-gpu-now"],
)
@pytest.mark.filterwarnings("ignore::UserWarning")  # spaces warns that it has no Gradio queue here
def test_each_refusal_spaces_words_is_one_sentence_naming_its_limit(on_blackwell, answer, token, sentence):
    """spaces titles a visitor's quota, the Space's own limit (a call without a visitor's token) and a queue that gave
    up all "ZeroGPU quota exceeded": each is said apart, the visitor's with the seconds spaces actually asked for."""
    said = refused(answer, token)
    assert re.match(sentence, said), said


def test_a_whole_card_counts_twice_and_its_seconds_are_not_scaled(on_blackwell, monkeypatch):
    """Past spaces' large-size threshold every call is `xlarge`: lent its seconds as asked, counted twice."""
    import spaces.zero

    monkeypatch.setattr(spaces.zero, "_default_gpu_size", "xlarge")
    said = refused(quota(12, timedelta(minutes=10)), token=True)
    assert said.startswith("This run asks ZeroGPU for 40 s of GPU time (20 s, counted 2 times"), said
    assert zerogpu.lent_seconds(20) == 20


def test_a_worker_that_ended_early_and_other_errors(on_blackwell):
    aborted = zerogpu.refusal(spaces_error("ZeroGPU worker error", "GPU task aborted"), 20, LOWER)
    assert aborted.message.startswith("The GPU's worker ended before this run did (ZeroGPU takes the GPU back after")
    assert f"the 30 s a call asks for): {LOWER}, and try again." in aborted.message
    expired = spaces_error("ZeroGPU client error", "Expired ZeroGPU proxy token")
    assert zerogpu.refusal(expired, 20, LOWER) is expired  # not a limit the visitor can do anything about


def test_a_runs_budget_starts_after_its_set_up_and_ends_before_the_gpu_is_taken_back(on_blackwell):
    """Lent 30 s for 20 asked (1.5 times): the set-up's allowance is 15 s, the margin 5, the budget the rest; a
    set-up that ran over its allowance comes out of the budget."""
    assert zerogpu.budget_seconds(20, set_up=3.0) == 30 - 15 - 5
    assert zerogpu.budget_seconds(20, set_up=18.0) == 30 - 18 - 5


def failing(error: Exception):
    def steps(*values: object, run_id: str):
        yield "first update"
        raise error

    return steps


@pytest.mark.parametrize(
    "error, sentence",
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"), r"^This run needed more memory "),
        (MemoryError(), r"^This run needed more memory than the cpu device had \(.* GiB free\): lower max-new-tokens"),
        (
            OSError(5, "Input/output error"),
            r"^The run failed, and the app is still serving: try again, or with fewer tokens or a smaller pair, and "
            r"if it happens again report it with these settings and the error \(OSError: \[Errno 5\] Input/output "
            r"error\)\.$",
        ),
        (ValueError("A sentence of ours, as it is."), r"^A sentence of ours, as it is\.$"),
    ],
)
def test_any_exception_of_a_gpu_function_is_one_sentence(error, sentence):
    """Off ZeroGPU too: a GPU function's failure reaches the page as a gr.Error with our sentence, never a class name
    first."""
    steps = zerogpu.gpu_function(failing(error), lambda *values, **options: 20)
    updates = steps("prompt", run_id="run")
    assert next(updates) == "first update"
    with pytest.raises(gr.Error) as caught:
        next(updates)
    assert re.match(sentence, caught.value.message), caught.value.message


def test_a_gr_error_and_a_plain_functions_failure():
    said = spaces_error("A title", "Ours already.")

    def plain(*values: object) -> dict:
        raise said

    with pytest.raises(gr.Error) as caught:
        zerogpu.gpu_function(plain, lambda *values: 20)("prompt")
    assert caught.value is said

    def broken(*values: object) -> dict:
        raise KeyError("rounds")

    with pytest.raises(gr.Error) as caught:
        zerogpu.gpu_function(broken, lambda *values: 20)("prompt")
    assert re.match(r"^The run failed, and the app .* \(KeyError: 'rounds'\)\.$", caught.value.message)


def test_a_model_that_fails_to_load_is_named_with_why():
    with pytest.raises(ValueError, match=r"^Could not load 'draft', so nothing ran: .*\(OSError: disk full\)\.$"):
        with loading(["target", "draft"], held=lambda name: name == "target"):
            raise OSError("disk full")
    with pytest.raises(torch.OutOfMemoryError):  # its own sentence, further up: what to lower
        with loading(["target"], held=lambda name: False):
            raise torch.OutOfMemoryError("CUDA out of memory")


@pytest.mark.parametrize(
    "planted, sentence",
    [
        (OSError(28, "No space left on device"), r"^Could not load 'smollm2-135m-instruct', so nothing ran: .*"),
        (torch.OutOfMemoryError("CUDA out of memory"), r"^This run needed more memory than the cpu device had"),
    ],
)
def test_off_zerogpu_the_page_says_the_same_sentences(app, monkeypatch, planted, sentence):
    def load_pair(*args: object, **kwargs: object):
        raise planted

    monkeypatch.setattr(zerogpu, "load_pair", load_pair)
    with pytest.raises(AppError) as failed:
        Client(app, verbose=False).predict(**settings(max_new_tokens=8), api_name="/generate")
    assert re.match(sentence, str(failed.value)), str(failed.value)


def test_a_model_audit_stops_at_the_end_of_its_budget_with_a_sentence(offline_model, tmp_path, monkeypatch):
    """On ZeroGPU a model audit's budget is its call's time less its models' set-up: at its end the audit stops at its
    next round and says so, before the GPU is taken back (here a budget already spent when it starts)."""
    cache = ModelCache(pinned=offline_model.name)
    cache.put(offline_model)
    server = Server(cache, Schedulers(), Downloads(str(tmp_path)), None)
    monkeypatch.setattr(audit, "ON_ZEROGPU", True)
    monkeypatch.setattr(audit, "budget_seconds", lambda seconds, set_up: 0.0)
    request = audit.parse_audit({"mode": "model", "num_samples": 100, "pair": "smollm2-135m-ngram"})
    updates = []
    with pytest.raises(gr.Error) as caught:
        for update in audit.run_model_audit(server, request, gr.Progress(), threading.Event()):
            updates.append(update)
    sentence = (
        "The model audit stopped after 0 s, its time on the GPU: lower the samples or the first tokens per sample, "
        "and run it again."
    )
    assert caught.value.message == sentence
    assert updates[-1][0] == sentence  # the verdict says so too


def test_an_overflow_names_the_pair_its_format_and_the_way_forward():
    """The engine knows the format and the token, the app the pair: the page's sentence has all three (planted: the
    overflow shown as any ValueError, without the pair)."""
    overflow = NonFiniteLogits("target's logits", torch.float16, 7)
    assert failure_sentence(overflow, "The run", "Qwen2.5-0.5B → Qwen2.5-1.5B-Instruct") == (
        "With Qwen2.5-0.5B → Qwen2.5-1.5B-Instruct, the target's logits overflowed to inf or NaN in float16 at "
        "generated token 7: choose float32 or bfloat16 in Number format (--dtype), or another pair."
    )
    assert failure_sentence(overflow, "The run").startswith("The target's logits overflowed to inf or NaN in float16")
