"""The app on a ZeroGPU Space, through `spaces`' own GPU wrappers on this CPU (tests/app/zerogpu_space.py): each run is
a call forked into `spaces`' worker, its arguments and updates pickled across, its models' set-up before its budget
and inside the seconds it asked for; Stop reaches the worker; Next round and a lesson work; each of ZeroGPU's refusals,
and a failure in the worker, is one sentence of ours; off ZeroGPU, with `spaces` installed, runs share one
scheduler."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import gradio as gr
import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError

from specdemo.app.form import parse_request
from specdemo.app.serving.runs import call_seconds
from specdemo.app.serving.zerogpu import MARGIN_SECONDS, MIN_SECONDS, ON_ZEROGPU, run_seconds
from specdemo.models.platform import on_zerogpu
from tests.app.test_browser import ARTIFACTS, RUN_ENDS_MS, open_page, set_numbers
from tests.app_helpers import CHROMIUM, SPELLING, settings
from tests.helpers import HANG_GUARD_SECONDS, wait_until

ROOT = Path(__file__).resolve().parents[2]
PAIRS = "smollm2-135m-suffix"  # and the default pair, the offline model's: no Hub here
STORY = "Write a long story about a dragon who learns to sing."
# The stand-in's GPU is this CPU, which decodes far slower than the 0.03 s a token a call asks for (an H200's): it is
# described to spaces as ZeroGPU describes a slower card, with a duration factor (1.5 on a Blackwell half), here so
# large that the smallest call is lent as long as the hang guard waits. A budget is a clock, and a busy machine must
# not reach it: the first run below, when it decoded 32 tokens and its comparison (16 now), took 3 s idle, and 70 s
# at a load of 8 on 2 cores.
DURATION_FACTOR = HANG_GUARD_SECONDS // MIN_SECONDS
VISITOR = {"X-IP-Token": "header.e30.signature"}  # a visitor's token, as the Hub's page sends it (its payload: {})

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def space(offline_model):
    """The Space's process (the offline model converted once before it starts), its URL and its log. It runs in a
    session of its own, ended whole: `spaces`' workers are its children, and would outlive it holding pytest's
    output open."""
    folder = Path(tempfile.mkdtemp(prefix="specdemo-zerogpu-"))  # apart from pytest's folders, which it prunes
    log = folder / "calls.jsonl"
    env = os.environ | {"SPECDEMO_ZEROGPU_PAIRS": PAIRS, "GRADIO_ANALYTICS_ENABLED": "False"}
    command = [sys.executable, "-m", "tests.app.zerogpu_space", str(log), str(free_port()), str(DURATION_FACTOR)]
    with open(folder / "output.txt", "w") as output:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=output, stderr=output, start_new_session=True)
    try:
        url = wait_for(log, lambda call: call["call"] == "ready", process)["url"]
        yield url, log
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the Space and every worker it forked
        process.wait()
        shutil.rmtree(folder, ignore_errors=True)


def calls(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def wait_for(log: Path, matches, process=None, after: int = 0) -> dict:
    """The first call in the log past the first `after` that `matches`; fails after HANG_GUARD_SECONDS (a hang, not
    speed)."""
    seconds = HANG_GUARD_SECONDS
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = [call for call in calls(log)[after:] if matches(call)]
        if found:
            return found[0]
        assert process is None or process.poll() is None, "the Space's process ended"
        time.sleep(0.1)
    raise AssertionError(f"hang guard: nothing in the log matched within {seconds} s: {calls(log)[after:]}")


def test_a_run_is_a_call_in_spaces_worker_streamed_back_and_lent_for_its_settings(space):
    url, log = space
    before = len(calls(log))
    values = settings(pair="smollm2-135m-suffix", dtype="auto", max_new_tokens=16)
    job = Client(url, verbose=False).submit(**values, api_name="/generate")
    updates = list(job)
    summary = job.result()[1]
    assert len(updates) > 3  # streamed round by round from the worker
    assert "**identical**, token for token" in summary  # greedy = the target alone, both decoded in the worker
    new = calls(log)[before:]
    [schedule] = [call for call in new if call["call"] == "schedule"]
    prompt = values.pop("prompt")
    lent = round(call_seconds(parse_request(prompt, values)) * DURATION_FACTOR)  # its tokens and comparison, scaled
    assert schedule["seconds"] == lent  # what spaces asked ZeroGPU for
    [prepared] = [call for call in new if call["call"] == "prepare"]
    print(f"set up in {prepared['set_up']:.2f} s before the run's budget of {prepared['budget']:.1f} s started")
    assert prepared["set_up"] + prepared["budget"] + MARGIN_SECONDS <= lent  # set-up and run inside the call's time
    [run] = [call for call in new if call["call"] == "run"]
    assert run["ended"] == "finished" and run["pid"] != schedule["pid"]  # decoded in the forked worker
    assert [call["fail"] for call in new if call["call"] == "release"] == [False]


def test_stop_closes_the_run_in_spaces_worker(space):
    url, log = space
    before = len(calls(log))
    values = settings(STORY, pair="smollm2-135m-suffix", dtype="auto", max_new_tokens=400, compare=False)
    job = Client(url, verbose=False).submit(**values, api_name="/generate")
    wait_until(lambda: len(job.outputs()) >= 3 or job.done(), "the run's first updates")
    assert not job.done(), job.exception()  # a run of 400 tokens was streaming when Stop came
    cancelled = time.time()
    job.cancel()
    run = wait_for(log, lambda call: call["call"] == "run", after=before)
    release = wait_for(log, lambda call: call["call"] == "release", after=before)
    assert run["ended"] == "closed", run  # spaces' stop event closed the steps: they did not run to their end
    assert not release["fail"]
    print(f"the worker closed the run {run['time'] - cancelled:.2f} s after the cancel, after {run['updates']} updates")


@pytest.mark.parametrize(
    "refusal, headers, sentence",
    [
        (
            "10",
            VISITOR,
            r"^This run asks ZeroGPU for (?P<lent>\d+) s of GPU time \((?P<seconds>\d+) s, counted "
            rf"{DURATION_FACTOR} times on this "
            r"Space's GPU\) and your quota has 10 s left: lower max new tokens or turn off the comparison, try again "
            r"in 1:00:00, or replay a recorded run in the step view, which needs no GPU\.$",
        ),
        ("10", {}, r"^This Space has used up the GPU time ZeroGPU lends to calls that carry no visitor's token .*"),
        ("no-gpu", VISITOR, r"^No ZeroGPU card was free for this run, all were lent to other calls: try again in a .*"),
        ("no-gpu", {}, r"^No ZeroGPU card was free for this run, all were lent to other calls: try again in a .*"),
    ],
    ids=["visitor-quota", "space-limit", "no-gpu", "no-gpu-no-token"],
)
def test_each_zerogpu_refusal_is_one_sentence_naming_its_limit(space, refusal, headers, sentence):
    """spaces titles all three "ZeroGPU quota exceeded" (the last also "ZeroGPU queue timeout"): the visitor's quota
    is told the seconds actually asked (scaled by the GPU's duration factor) and what to lower, a full queue to try
    again, and a call without a visitor's token what to do."""
    url, log = space
    quota = Path(f"{log}.quota")
    quota.write_text(refusal)
    values = settings(max_new_tokens=64)
    try:
        with pytest.raises(AppError) as refused:
            Client(url, verbose=False, headers=headers).predict(**values, api_name="/generate")
    finally:
        quota.unlink()
    said = re.match(sentence, str(refused.value))
    assert said, str(refused.value)
    if "lent" in said.groupdict():
        seconds = call_seconds(parse_request(values.pop("prompt"), values))
        assert (int(said["seconds"]), int(said["lent"])) == (seconds, round(seconds * DURATION_FACTOR))


@pytest.mark.parametrize(
    "failure, api_name, sentence",
    [
        ("oom", "/generate", r"^This run needed more memory than the cpu device had \(.* GiB free\): lower max-new-"),
        ("disk", "/generate", r"^Could not load 'smollm2-135m-instruct', so nothing ran: try again, or pick .*"),
        ("round", "/generate", r"^The run failed, and the app is still serving: .* \(RuntimeError: CUDA error: an"),
        ("oom", "/generate_batch", r"^This run needed more memory than the cpu device had"),
        ("disk", "/audit", r"^Could not load 'smollm2-135m-instruct', so nothing ran: .*No space left on device"),
        ("oom", "/audit", r"^This run needed more memory than the cpu device had"),
    ],
)
def test_a_failure_in_spaces_worker_is_one_sentence_of_ours(space, failure, api_name, sentence):
    """spaces shows any exception but a gr.Error raised in its worker as "ZeroGPU worker error" and the exception's
    class: every GPU function says its failures in sentences of ours (out of memory: what to lower; a model that
    failed to load: which, and why; anything else: the way forward, and the error at the end for a report)."""
    url, log = space
    planted = Path(f"{log}.fail")
    planted.write_text(failure)
    values = {
        "/generate": settings(pair="smollm2-135m-suffix", dtype="auto", max_new_tokens=8, compare=False),
        "/generate_batch": {"prompts": ["One.", "Two."], "max_new_tokens": 8},
        "/audit": {"mode": "model", "num_samples": 100},
    }[api_name]
    try:
        with pytest.raises(AppError) as failed:
            Client(url, verbose=False).predict(**values, api_name=api_name)
    finally:
        planted.unlink()
    assert re.match(sentence, str(failed.value)), str(failed.value)
    assert "ZeroGPU" not in str(failed.value)


def test_a_pair_not_loaded_at_startup_is_refused_in_one_sentence(space):
    url, _ = space
    loaded = r"runs the pairs it loaded at startup.*pick one of smollm2-135m-ngram, smollm2-135m-suffix"
    with pytest.raises(AppError, match=loaded):
        Client(url, verbose=False).predict(**settings(pair="smollm2-135m-360m"), api_name="/generate")


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (make chromium)")
def test_next_round_runs_as_one_call_in_the_browser(space, browser):
    url, log = space
    ARTIFACTS.mkdir(exist_ok=True)
    page = open_page(browser, url)
    assert "ZeroGPU" in page.inner_text("#device-line")
    page.fill("#prompt textarea", "Repeat exactly: the cat sat on the mat, the cat sat on the mat.")
    set_numbers(page, max_new_tokens=16)
    before = len(calls(log))
    page.click("#next-round")  # nothing to step through: the form's run is decoded whole in one call
    page.wait_for_function(
        "document.querySelector('#round-sentence')?.textContent.includes('Round 1')", timeout=RUN_ENDS_MS
    )
    asked = [call["seconds"] for call in calls(log)[before:] if call["call"] == "schedule"]
    assert asked == [run_seconds(16, 1) * DURATION_FACTOR]  # one call, for the form's tokens, without comparison
    page.click("#next-round")  # the next round of the record: no call
    page.wait_for_function(
        "document.querySelector('#round-sentence')?.textContent.includes('Round 2')", timeout=RUN_ENDS_MS
    )
    page.screenshot(path=str(ARTIFACTS / "zerogpu-next-round.png"), full_page=True)


@pytest.mark.parametrize("value", [None, "", "0", "false", "1", "true", "True", "t", "yes"])
def test_zerogpu_is_read_as_spaces_reads_it(value, monkeypatch):
    from spaces.config import Settings

    if value is None:
        monkeypatch.delenv("SPACES_ZERO_GPU", raising=False)
    else:
        monkeypatch.setenv("SPACES_ZERO_GPU", value)
        monkeypatch.setenv("SPACES_ZERO_DEVICE_API_URL", "http://127.0.0.1:9")  # Settings asserts it on ZeroGPU
    assert on_zerogpu() == Settings().zero_gpu


def test_with_spaces_installed_and_zerogpu_off_runs_share_one_scheduler(app_server):
    """Every Space installs `spaces`; off ZeroGPU its decorator returns the function, and runs share passes."""
    import spaces

    assert not ON_ZEROGPU and spaces.GPU(free_port) is free_port
    values = settings(pair="smollm2-135m-suffix")
    prompt = values.pop("prompt")
    runs = [app_server.prepare([prompt], dict(values), gr.Progress(), threading.Event()) for _ in range(2)]
    assert runs[0].schedulers is runs[1].schedulers is app_server.schedulers
    schedulers = [run.schedulers.get(run.target, run.draft, run.request.pair.drafter) for run in runs]
    assert schedulers[0] is schedulers[1]  # the rows of both runs join one batch


def test_a_model_audit_is_a_call_in_spaces_worker(space):
    url, log = space
    before = len(calls(log))
    verdict = Client(url, verbose=False).predict(mode="model", num_samples=100, api_name="/audit")[0]
    assert verdict.startswith("**Lossless") or verdict.startswith("**Not"), verdict  # the audit ran to its verdict
    new = calls(log)[before:]
    assert [call["call"] for call in new if call["call"] in ("schedule", "release")] == ["schedule", "release"]


def test_a_race_is_one_zerogpu_call_that_covers_every_lane(space):
    """Through `spaces`' own wrappers (tests/app/zerogpu_space.py): the race is one call, decoded in the worker,
    lent for every lane's tokens as if each decoded alone (the lanes share passes, so this covers them). Planted: a
    race asking for one run's seconds fails it."""
    url, log = space
    before = len(calls(log))
    values = {**settings(SPELLING, dtype="auto", max_new_tokens=48), "lanes": "ngram,suffix,recurrent,hybrid"}
    _, summary, _, result = Client(url, verbose=False).predict(**values, api_name="/race")
    assert result["agreement"].startswith("All 5 finished lanes wrote the same"), result  # decoded in the call
    assert "Stopped" not in summary
    new = calls(log)[before:]
    assert [call["call"] for call in new if call["call"] in ("schedule", "release")] == ["schedule", "release"]
    [schedule] = [call for call in new if call["call"] == "schedule"]
    assert run_seconds(48, 5) > run_seconds(48, 1)  # five lanes ask for more than one run does
    assert schedule["seconds"] == round(run_seconds(48, 5) * DURATION_FACTOR)
