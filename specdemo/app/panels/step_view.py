"""Step through a run: Next round decodes the form's run one round at a time; after each run (or from a downloaded
trace) the page replays it round by round; a sentence per round, and a click on any token opens the inspector: p, q,
the residual and u as bars (under the coupled rule, the target's choice y and the drafted x with the noise G that
decided them), from the run's own trace."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import gradio as gr

from specdemo.app.form import names
from specdemo.app.panels import recorded
from specdemo.app.serving.messages import failure_error, failure_sentence, user_error
from specdemo.app.serving.runs import Server, Stepper, read_values, requested_seconds
from specdemo.app.serving.zerogpu import ON_ZEROGPU, gpu_function
from specdemo.app.views.replay import check_replay, inspector_figure, step_html, step_sentence, view_title

MAX_TRACE_BYTES = 20_000_000  # a 512-token run's trace is about 1 MB
STEPPER_SECONDS = 900  # a run decoded round by round is let go this long after its last press (or when the tab goes)
START = (
    "Press Next round to decode the form's run one round at a time, or Run to decode it whole and step through it "
    "here; or replay a trace you downloaded."
)
# Clicks on tokens (delegated, so tokens streamed in later count too) and the N key (outside text fields).
INSPECT_JS = """
element.addEventListener('click', (event) => {
  const token = event.target.closest('.tok[data-r]');
  if (token) trigger('inspect', {round: Number(token.dataset.r), position: Number(token.dataset.p)});
});
if (!window.specdemoStepKeys) {
  window.specdemoStepKeys = true;
  document.addEventListener('keydown', (event) => {
    const typing = event.target.closest('input, textarea, [contenteditable="true"]');
    if (!typing && !event.ctrlKey && !event.metaKey && !event.altKey && event.key.toLowerCase() === 'n') {
      document.querySelector('#next-round')?.click();
    }
  });
}
"""
STEP_CSS = """
.step-current .tok { outline: 2px solid rgba(128, 128, 128, .9); outline-offset: 1px; }
.tok[data-r] { cursor: pointer; }
"""


def build(server: Server, trace: gr.DownloadButton, tokens: gr.HTML, runs: list, theme_css: str, form: list) -> None:
    """The step view under the run's outputs; `runs` are the run events, each of which refreshes it when it ends, and
    `form` the prompt and settings Next round decodes when there is nothing to step through."""
    record = gr.State(None)
    stepper = gr.State(None, time_to_live=STEPPER_SECONDS)
    with gr.Accordion("Step through the run, and inspect any token", open=True, elem_id="step"):
        with gr.Row(equal_height=True):
            next_round = gr.Button("Next round ▶ (N)", elem_id="next-round", scale=0, min_width=180)
            replay = gr.Slider(0, 1, value=0, step=1, label="Round", elem_id="replay", interactive=True)
            upload = gr.UploadButton(
                "Replay a trace file", file_types=[".json"], elem_id="replay-upload", scale=0, min_width=180
            )
        recordings = gr.Dropdown(
            recorded.choices(),
            value=None,
            label="Or replay a recorded run: instant, no GPU needed",
            elem_id="recorded-runs",
        )
        sentence = gr.Markdown(START, elem_id="round-sentence")
        step_tokens = gr.HTML(
            "", css_template=theme_css + STEP_CSS, elem_id="step-tokens", js_on_load=INSPECT_JS, min_height=40
        )
        note = gr.Markdown("Click a token above or in the run to inspect it.", elem_id="inspector-note")
        inspector = gr.Plot(elem_id="inspector", show_label=False, visible=False)
    shown = [record, stepper, replay, sentence, step_tokens, note, inspector]
    for run in runs:
        run.success(from_trace, inputs=trace, outputs=shown, api_visibility="private")
    upload.upload(from_upload, inputs=upload, outputs=shown, api_visibility="private")
    recordings.input(from_recording, inputs=recordings, outputs=shown, queue=False, api_visibility="private")
    # queue=False: pure and fast, and no queue status drawn over the sentence
    replay.change(
        show_round, inputs=[record, replay], outputs=[sentence, step_tokens], queue=False, api_visibility="private"
    )
    whole = (
        gpu_function(partial(decode_whole, server), whole_seconds, lower="lower max new tokens") if ON_ZEROGPU else None
    )
    next_round.click(  # queued (it may load models and decodes), its status hidden so the sentence stays readable
        partial(next_step, server, whole=whole),
        inputs=[record, stepper, replay, *form],
        outputs=[record, stepper, replay, sentence],
        show_progress="hidden",
        concurrency_limit=server.run_concurrency,
        concurrency_id="step",
        api_visibility="private",
    )
    for source in (step_tokens, tokens):
        source.inspect(inspect_token, inputs=record, outputs=[note, inspector], api_visibility="private")


def _loaded(record: dict) -> tuple:
    total = len(record["rounds"])
    first = min(1, total)
    return (
        record,
        None,  # a run decoded round by round before is let go
        gr.update(minimum=0, maximum=total, value=first),
        step_sentence(record, first),
        step_html(record, first),
        "Click a token above or in the run to inspect it.",
        gr.update(visible=False),
    )


def from_trace(path: str | None) -> tuple:
    """The finished run's replay, from the trace it just wrote."""
    if not path:
        return tuple(gr.skip() for _ in range(7))
    return _loaded(check_replay(json.loads(Path(path).read_text()).get("replay")))


def from_upload(path: str | None) -> tuple:
    """A downloaded trace to replay; a file too large, not JSON, or from another version is refused in a sentence."""
    if not path:
        return tuple(gr.skip() for _ in range(7))
    size = Path(path).stat().st_size
    if size > MAX_TRACE_BYTES:
        raise user_error(
            f"This file is {size / 1e6:.0f} MB, more than the {MAX_TRACE_BYTES / 1e6:.0f} MB a trace may be: upload "
            "a trace downloaded from specdemo."
        )
    try:
        trace = json.loads(Path(path).read_bytes())
    except (ValueError, UnicodeDecodeError) as error:
        raise user_error("This file is not JSON: upload a trace downloaded from specdemo after a run.") from error
    try:
        return _loaded(check_replay(trace.get("replay") if isinstance(trace, dict) else None))
    except ValueError as error:
        raise user_error(str(error)) from error


def from_recording(key: str | None) -> tuple:
    """A run recorded beforehand (specdemo/app/panels/recorded.py), its label saying on which device and when."""
    if not key:
        return tuple(gr.skip() for _ in range(7))
    try:
        trace = recorded.load(key)
    except ValueError as error:
        raise user_error(str(error)) from error
    shown = _loaded(trace["replay"])
    note = f"Replaying a recorded run ({recorded.label(trace['recorded'])}). Click a token to inspect it."
    return (*shown[:5], note, *shown[6:])


def show_round(record: dict | None, upto: float) -> tuple[str, str]:
    if record is None:
        return START, ""
    upto = max(0, min(int(upto), len(record["rounds"])))
    return step_sentence(record, upto), step_html(record, upto)


def next_step(
    server: Server,
    record: dict | None,
    stepper: Stepper | None,
    upto: float,
    *form: object,
    whole: Callable[..., dict] | None = None,
) -> tuple:
    """One round more: the next of the run on show; past its last, the next decoded, while a run decoded round by
    round goes on; with nothing to step through, the first round of the form's run (its checks, engine and seed).
    Past a finished run's last round, a sentence and nothing else changes. With `whole` (ZeroGPU, where nothing of a
    GPU call outlives it), the form's run is decoded whole in one call and stepped through from its first round."""
    upto = int(upto or 0)
    if record is not None and upto < len(record["rounds"]):
        return gr.skip(), gr.skip(), upto + 1, gr.skip()
    if record is not None and not record.get("live"):
        total = len(record["rounds"])
        return (
            gr.skip(),
            gr.skip(),
            gr.skip(),
            (f"**That was the last round**: the run ended after {total} rounds. Drag the slider back, or run again."),
        )
    if whole is not None:
        record = whole(*form)
        first = min(1, len(record["rounds"]))
        return (
            record,
            None,
            gr.update(minimum=0, maximum=len(record["rounds"]), value=first),
            step_sentence(record, first),
        )
    if stepper is None or record is None:
        named, progress = read_values(["prompt", *names()], form)
        try:
            stepper = Stepper(server.prepare([named.pop("prompt")], named, progress, threading.Event()))
        except Exception as error:  # a refusal, or a model that failed to load
            raise failure_error(error, "The run") from error
    try:
        stepper.step()
    except Exception as error:  # the row's own sentence, or a model error: this stepping ends, the app stays
        raise user_error(
            f"{failure_sentence(error, 'The round')} Press Next round to start again.", log=True
        ) from error
    record = stepper.record()
    total = len(record["rounds"])
    return record, stepper, gr.update(minimum=0, maximum=total, value=total), gr.skip()


def whole_seconds(*form: object) -> int:
    """What decoding the form's run whole asks ZeroGPU for: a run's seconds, without its comparisons."""
    values = list(form)
    values[1 + names().index("compare")] = False  # after the prompt
    return requested_seconds("prompt", *values)


def decode_whole(server: Server, *form: object) -> dict:
    """The form's run decoded whole, as Next round steps through it (its engine and seed, no comparison), as a replay
    record: on ZeroGPU, one GPU call; a refusal or a failure is one sentence."""
    named, progress = read_values(["prompt", *names()], form)
    try:
        stepper = Stepper(server.prepare([named.pop("prompt")], named, progress, threading.Event()))
        while not stepper.done and time.monotonic() < stepper.run.deadline:
            stepper.step()
    except Exception as error:  # a refusal, the row's own sentence, or a model error: the app and its models stay
        raise failure_error(error, "The run") from error
    return stepper.record() | {"live": False}


def inspect_token(record: dict | None, event: gr.EventData) -> tuple:
    """The inspector for the clicked token's round and position."""
    data = getattr(event, "_data", None) or {}
    round_index, position = data.get("round"), data.get("position")
    if record is None:
        return "The inspector opens once the run has finished: its distributions come from the run's trace.", gr.skip()
    if not isinstance(round_index, int) or not 0 <= round_index < len(record["rounds"]):
        return "That token is not in this run's trace: run again, or step to it.", gr.update(visible=False)
    views = record["rounds"][round_index]["views"]
    if not isinstance(position, int) or not 0 <= position < len(views):
        return "This token was never tested: an earlier draft of its round was rejected.", gr.update(visible=False)
    view, greedy = views[position], record.get("greedy", False)
    title = view_title(view, round_index + 1, position, greedy)
    return title, gr.update(value=inspector_figure(view, "", greedy), visible=True)
