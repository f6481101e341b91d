"""The Gradio app: layout and handlers (the only module importing gradio); the engine does the work."""

from __future__ import annotations

import html
import json
import os
import queue
import tempfile
import threading
import time
from collections.abc import Generator, Iterator
from dataclasses import asdict, dataclass
from functools import partial

import gradio as gr

from specdemo.config import (
    MAX_NUM_DRAFT_TOKENS,
    MAX_PROMPT_CHARACTERS,
    MAX_PROMPT_TOKENS,
    SamplingConfig,
    SpeculativeConfig,
    check_prompt,
    check_prompt_fits,
)
from specdemo.decoding import Round, autoregressive_generate, speculative_generate
from specdemo.models import LOCAL_PATHS_VARIABLE, OFFLINE_DEFAULT, LoadedModel, ModelCache, chat_prompt_ids
from specdemo.pairs import DEFAULT_PAIR, NGRAM, PAIRS, Pair, custom_pair, find_pair, load_pair, make_drafter
from specdemo.plots import acceptance_figure, latency_figure, positions_figure, throughput_figure
from specdemo.render import LEGEND_HTML, TOKEN_CSS, html_spans, round_spans, summary_markdown
from specdemo.stats import compare_runs, round_record, run_stats

try:  # On a ZeroGPU Space, GPU work runs inside @spaces.GPU; elsewhere the package is absent and this is a no-op.
    import spaces

    on_gpu = spaces.GPU(duration=120)
except ImportError:

    def on_gpu(function):  # type: ignore[no-redef]
        return function


CUSTOM = "custom"
UI_MAX_NEW_TOKENS = 512  # the slider's end: a run stays well under a minute on a CPU
CHART_INTERVAL_SECONDS = 0.5  # charts are re-sent whole (~28 ms to build four): at most 2 updates a second
TOKENS_INTERVAL_SECONDS = 0.1  # tokens stream in batches of rounds, so the page's work never slows the engine
ABANDONED_SECONDS = 0.6  # a run whose page stopped asking for rounds this long ago was cancelled
QUEUE_SIZE = 16  # waiting runs beyond this are told the queue is full
RUN_TIME_BUDGET_SECONDS = 120.0  # one run, comparison included; then it stops and says so
LIMITS = (
    f"Limits: a prompt of up to {MAX_PROMPT_TOKENS:,} tokens ({MAX_PROMPT_CHARACTERS:,} characters), up to "
    f"{UI_MAX_NEW_TOKENS} new tokens, up to {MAX_NUM_DRAFT_TOKENS} draft tokens per round, "
    f"{RUN_TIME_BUDGET_SECONDS:.0f} s per run. Runs take turns; up to {QUEUE_SIZE} can wait."
)

EXAMPLES = [
    [
        "Correct the spelling mistakes in this text and return the corrected text:\n\nThe quartely planing meeting is "
        "moved from Tuesday to Thursday. Anna will presnt the budget review and Tom will cover the hirring plan.",
        DEFAULT_PAIR.key,
        0.0,
    ],
    [
        "Summarise this message in two sentences:\n\nThe quarterly planning meeting is moved from Tuesday, March 4 to "
        "Thursday, March 6 at 10:00 in room 2.14. Anna Berg will present the budget review, Tom Lee will cover the "
        "hiring plan, and Maria Lopez will report on the customer survey.",
        DEFAULT_PAIR.key,
        0.0,
    ],
    ["Write a short story about a lighthouse keeper who finds a message in a bottle.", "smollm2-135m-self", 0.0],
    ["Explain why the sky is blue to a ten-year-old.", "smollm2-135m-self", 0.7],
]

HEADER = (
    "<h2>Speculative decoding, made visible</h2><p>A draft proposes tokens; the target checks them all in one pass "
    "and keeps each with probability min(1, p/q), resampling the first it refuses. The output follows exactly the "
    f"target's own distribution: only the speed changes.</p><p>{LEGEND_HTML}</p>"
)


@dataclass(frozen=True)
class RunRequest:
    """Everything a run needs, checked: the pair and the settings."""

    prompt: str
    pair: Pair
    sampling: SamplingConfig
    speculative: SpeculativeConfig
    chat: bool
    compare: bool
    allow_local: bool  # the operator allowed local directories (SPECDEMO_ALLOW_LOCAL_PATHS=1)


def parse_request(
    prompt: str,
    pair_key: str,
    custom_target: str,
    custom_draft: str,
    temperature: float,
    top_k: float,
    top_p: float,
    repetition_penalty: float,
    draft_temperature: float,
    num_draft_tokens: float,
    max_new_tokens: float,
    seed: float,
    chat: bool,
    compare: bool,
) -> RunRequest:
    """The form's values as checked settings; a ValueError names the first bad one."""
    check_prompt(prompt)
    if _whole("max new tokens", max_new_tokens) > UI_MAX_NEW_TOKENS:
        raise ValueError(f"max new tokens must be between 1 and {UI_MAX_NEW_TOKENS} here, got {max_new_tokens}.")
    allow_local = os.environ.get(LOCAL_PATHS_VARIABLE) == "1"
    pair = (
        custom_pair(str(custom_target or "").strip(), str(custom_draft or "").strip() or NGRAM, allow_local)
        if pair_key == CUSTOM
        else find_pair(pair_key)
    )
    sampling = SamplingConfig(
        temperature=temperature,
        top_k=_whole("top-k", top_k),
        top_p=top_p,
        repetition_penalty=repetition_penalty,
        seed=_whole("seed", seed),
    )
    speculative = SpeculativeConfig(
        num_draft_tokens=_whole("draft tokens per round", num_draft_tokens),
        max_new_tokens=_whole("max new tokens", max_new_tokens),
        draft_temperature=draft_temperature if pair.uses_draft_model else None,
    )
    if speculative.max_new_tokens > UI_MAX_NEW_TOKENS:
        raise ValueError(
            f"max new tokens must be between 1 and {UI_MAX_NEW_TOKENS} here, got {speculative.max_new_tokens}."
        )
    return RunRequest(prompt, pair, sampling, speculative, bool(chat), bool(compare), allow_local)


def _whole(name: str, value: float | None) -> int:
    """A whole number from a number field (which may send 3.0, or None when emptied)."""
    if value is None or isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise ValueError(f"{name} must be a whole number, got {value!r}.")
    if value != int(value):
        raise ValueError(f"{name} must be a whole number, got {value}.")
    return int(value)


def _trace_file(
    request: RunRequest, target: LoadedModel, prompt_ids: list[int], rounds: list[Round], baseline: list[Round]
) -> str:
    """The run as JSON in a temporary file, for the download button; the seed reproduces it."""
    generated = [token for round_ in rounds for token in round_.emitted_token_ids]
    trace = {
        "pair": asdict(request.pair),
        "sampling": asdict(request.sampling),
        "speculative": asdict(request.speculative),
        "chat_template": request.chat,
        "device": target.description,
        "prompt": request.prompt,
        "prompt_token_ids": prompt_ids,
        "generated_token_ids": generated,
        "text": target.tokenizer.decode(generated, skip_special_tokens=True),
        "rounds": [round_record(round_) for round_ in rounds],
        "stats": run_stats(rounds).as_dict(),
        "baseline_stats": run_stats(baseline).as_dict() if baseline else None,
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="specdemo-trace-", delete=False) as handle:
        json.dump(trace, handle, indent=1)
    return handle.name


def user_error(message: str, log: bool = False) -> gr.Error:
    """Gradio shows an error's message as HTML, and ours may quote what the user typed: escape it."""
    return gr.Error(html.escape(message, quote=False), print_exception=log)


def check_settings(*values: object) -> None:
    """The form's values, checked before anything runs; the refusal names the setting."""
    try:
        parse_request(*values)  # type: ignore[arg-type]
    except ValueError as error:
        raise user_error(str(error)) from error


def build_demo(cache: ModelCache | None = None) -> gr.Blocks:
    """The whole page. `cache` holds loaded models across runs and users (a fresh one by default)."""
    cache = cache or ModelCache(pinned=OFFLINE_DEFAULT)
    # The default pair is ready before the first visitor (and ZeroGPU wants models loaded outside GPU functions).
    load_pair(DEFAULT_PAIR, cache, progress=print)

    @on_gpu
    def generate(*values: object, progress: gr.Progress = gr.Progress()) -> Iterator[tuple]:
        """The run: the form's values in the order of `inputs` below (parse_request's parameters)."""
        try:
            request = parse_request(*values)  # type: ignore[arg-type]
            target, draft = load_pair(
                request.pair, cache, lambda message: progress(0.0, desc=message), allow_local=request.allow_local
            )
            prompt_ids = chat_prompt_ids(target, request.prompt, chat=request.chat)  # [1, T]
            check_prompt_fits(prompt_ids.shape[1], request.speculative.max_new_tokens, target.context_length)
        except ValueError as error:
            raise user_error(str(error)) from error
        try:
            yield from stream_run(request, target, draft, prompt_ids)
        except Exception as error:  # a model error, out of memory...: this run fails, the app and its models stay
            message = f"The run failed ({error.__class__.__name__}: {str(error)[:200]})"
            raise user_error(
                f"{message}. The app is still serving: try again, or fewer tokens or a smaller pair.", log=True
            ) from error

    with gr.Blocks(title="specdemo: speculative decoding, made visible") as demo:
        gr.HTML(HEADER, css_template=TOKEN_CSS, elem_id="header")
        with gr.Row():
            with gr.Column(scale=1, min_width=300):
                pair = gr.Dropdown(
                    [(p.label, p.key) for p in PAIRS] + [("Custom: any two Hub ids", CUSTOM)],
                    value=DEFAULT_PAIR.key,
                    label="Draft / target pair",
                    elem_id="pair",
                )
                note = gr.Markdown(DEFAULT_PAIR.note, elem_id="pair-note")
                custom_target = gr.Textbox(
                    label="Target (Hub id)",
                    placeholder="HuggingFaceTB/SmolLM2-360M-Instruct",
                    visible=False,
                    elem_id="custom-target",
                )
                custom_draft = gr.Textbox(
                    label="Drafter (Hub id, or ngram)", value=NGRAM, visible=False, elem_id="custom-draft"
                )
                temperature = gr.Slider(0, 2, value=0, step=0.05, label="Temperature (0 = greedy)")
                top_k = gr.Number(0, minimum=0, step=1, label="Top-k (0 = off)")
                top_p = gr.Slider(0.05, 1, value=1, step=0.01, label="Top-p (1 = off)")
                repetition_penalty = gr.Slider(1, 2, value=1, step=0.05, label="Repetition penalty (1 = off)")
                draft_temperature = gr.Slider(
                    0, 2, value=1.5, step=0.05, visible=False, label="Draft temperature (the draft samples at its own)"
                )
                num_draft_tokens = gr.Slider(
                    1, MAX_NUM_DRAFT_TOKENS, value=5, step=1, label="Draft tokens per round (γ)"
                )
                max_new_tokens = gr.Slider(1, UI_MAX_NEW_TOKENS, value=128, step=1, label="Max new tokens")
                seed = gr.Number(0, minimum=0, step=1, label="Seed")
                chat = gr.Checkbox(True, label="Apply the chat template")
                compare = gr.Checkbox(True, label="Then run the target alone, to compare")
            with gr.Column(scale=2):
                prompt = gr.Textbox(
                    lines=5,
                    label="Prompt",
                    elem_id="prompt",
                    placeholder="Text to continue; input-grounded tasks (edit, summarise) draft best",
                )
                with gr.Row():
                    run = gr.Button("Run", variant="primary", elem_id="run")
                    stop = gr.Button("Stop", variant="stop", elem_id="stop")
                gr.Markdown(LIMITS, elem_id="limits")
                gr.Examples(EXAMPLES, inputs=[prompt, pair, temperature], cache_examples=False)
                tokens = gr.HTML(
                    "", label="Tokens", css_template=TOKEN_CSS, elem_id="tokens", elem_classes=["tokens"], min_height=80
                )
                summary = gr.Markdown(elem_id="summary")
                with gr.Row():
                    acceptance = gr.Plot(elem_id="acceptance-chart", show_label=False)
                    latency = gr.Plot(elem_id="latency-chart", show_label=False)
                with gr.Row():
                    positions = gr.Plot(elem_id="positions-chart", show_label=False)
                    throughput = gr.Plot(elem_id="throughput-chart", show_label=False)
                trace = gr.DownloadButton("Download the trace (JSON)", visible=False, elem_id="trace")

        pair.change(
            describe_pair,
            inputs=pair,
            outputs=[note, custom_target, custom_draft, draft_temperature],
            api_visibility="private",
        )
        inputs = [
            prompt,
            pair,
            custom_target,
            custom_draft,
            temperature,
            top_k,
            top_p,
            repetition_penalty,
            draft_temperature,
            num_draft_tokens,
            max_new_tokens,
            seed,
            chat,
            compare,
        ]
        outputs = [tokens, summary, acceptance, latency, positions, throughput, trace]
        # preprocess=False: the handler checks the raw values itself, so every refusal names its setting
        # (Gradio's own range check says only "Value -1.0 is less than minimum value 0.").
        # Settings are checked first in an event with no outputs, so a refusal is a message and the last run's
        # tokens and charts stay as they were; /generate checks them again for API clients.
        run_events = []
        for trigger in (run.click, prompt.submit):
            checked = trigger(check_settings, inputs=inputs, outputs=None, preprocess=False, api_visibility="private")
            run_events.append(
                checked.success(
                    generate,
                    inputs=inputs,
                    outputs=outputs,
                    concurrency_limit=1,
                    preprocess=False,
                    api_name="generate" if trigger == run.click else False,
                )
            )
        stop.click(None, cancels=run_events, api_visibility="private")
    demo.queue(max_size=QUEUE_SIZE, default_concurrency_limit=1)  # explicit: ZeroGPU would default to 1
    return demo


def describe_pair(pair_key: str) -> tuple:
    """The pair's note, the custom id fields when 'custom' is picked, the draft temperature for draft models."""
    if pair_key == CUSTOM:
        return (
            "Type a target and a drafter that share a tokenizer, or `ngram` as the drafter.",
            gr.update(visible=True),
            gr.update(visible=True),
            gr.update(visible=True),
        )
    pair = find_pair(pair_key)
    draft_temperature = gr.update(visible=pair.uses_draft_model, value=pair.draft_temperature or 0.0)
    return pair.note, gr.update(visible=False), gr.update(visible=False), draft_temperature


_DONE = object()


def rounds_in_background(rounds: Iterator[Round], interval: float) -> Iterator[list[Round]]:
    """Run the engine in its own thread and yield the rounds that arrived, at most every `interval` seconds.

    The engine stops after the round in progress once this generator is closed, or once the page has not come back
    for ABANDONED_SECONDS after taking a batch: Gradio stops iterating a cancelled run (Stop, a closed tab) without
    closing it.
    """
    arrived: queue.Queue = queue.Queue()
    stop = threading.Event()
    suspended_since: list[float | None] = [None]  # when the page last handed rounds out and has not come back

    def work() -> None:
        try:
            for round_ in rounds:
                arrived.put(round_)
                since = suspended_since[0]
                if stop.is_set() or (since is not None and time.monotonic() - since > ABANDONED_SECONDS):
                    break
        except Exception as error:  # handed to the page's thread, which raises it there
            arrived.put(error)
        finally:
            rounds.close()  # type: ignore[attr-defined]
            arrived.put(_DONE)

    worker = threading.Thread(target=work, name="specdemo-engine", daemon=True)
    worker.start()
    try:
        finished = False
        while not finished:
            batch, deadline = [arrived.get()], time.monotonic() + interval
            while batch[-1] is not _DONE and not isinstance(batch[-1], Exception):
                try:
                    batch.append(arrived.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
            finished = batch[-1] is _DONE or isinstance(batch[-1], Exception)
            if isinstance(batch[-1], Exception):
                raise batch[-1]
            rounds_now = [item for item in batch if item is not _DONE]
            if rounds_now:
                suspended_since[0] = time.monotonic()
                yield rounds_now
                suspended_since[0] = None
    finally:
        stop.set()
        worker.join(timeout=10)


def unchanged_charts() -> tuple:
    """The four charts and the trace left as they are (fresh objects: Gradio may consume an update)."""
    return tuple(gr.skip() for _ in range(5))


def stream_run(request: RunRequest, target: LoadedModel, draft: LoadedModel | None, prompt_ids) -> Iterator[tuple]:
    """Yield (tokens, summary, four charts, trace) as rounds arrive, then while the comparisons run; the last
    update carries every output."""
    deadline = time.monotonic() + RUN_TIME_BUDGET_SECONDS
    rounds, tokens_html, summary = yield from stream_speculative(request, target, draft, prompt_ids, deadline)
    baseline: list[Round] = []
    draft_alone: list[Round] = []
    out_of_time = time.monotonic() > deadline
    if request.compare and not out_of_time:
        yield tokens_html, summary, *charts(rounds, request.speculative.num_draft_tokens), gr.skip()
        for label, collected, model, sampling in comparison_runs(request, target, draft, baseline, draft_alone):
            engine = autoregressive_generate(
                model.model, prompt_ids, sampling, request.speculative.max_new_tokens, model.eos_token_ids
            )
            for batch in rounds_in_background(engine, CHART_INTERVAL_SECONDS):  # Stop works here too
                collected.extend(batch)
                note = f"\n\n*Now decoding with the {label}, to compare: {len(collected)} tokens…*"
                yield tokens_html, summary + note, *unchanged_charts()
                out_of_time = time.monotonic() > deadline
                if out_of_time:
                    break
        if out_of_time:  # an unfinished comparison would compare unlike things
            baseline.clear()
            draft_alone.clear()
    num_draft_tokens = request.speculative.num_draft_tokens
    summary = summary_markdown(
        run_stats(rounds),
        num_draft_tokens,
        baseline=run_stats(baseline) if baseline else None,
        comparison=compare_runs(rounds, baseline, num_draft_tokens) if baseline else None,
        draft_alone=run_stats(draft_alone) if draft_alone else None,
        greedy=request.sampling.is_greedy,
    )
    if out_of_time:
        note = (
            f"Stopped after {RUN_TIME_BUDGET_SECONDS:g} s, the time budget of one run: lower max new tokens, "
            "turn off the comparison, or pick a faster pair."
        )
        gr.Warning(note)
        summary = f"**{note}**\n\n{summary}"
    trace = _trace_file(request, target, prompt_ids[0].tolist(), rounds, baseline)
    yield tokens_html, summary, *charts(rounds, num_draft_tokens, baseline), gr.update(value=trace, visible=True)


def stream_speculative(
    request: RunRequest, target: LoadedModel, draft: LoadedModel | None, prompt_ids, deadline: float
) -> Generator[tuple, None, tuple[list[Round], str, str]]:
    """The speculative run, streamed: tokens every batch, charts at most twice a second, until done or the
    deadline. Returns its rounds, token HTML and summary."""
    sampling, speculative = request.sampling, request.speculative
    decode = partial(target.tokenizer.decode, skip_special_tokens=False)
    drafter = make_drafter(target, draft, sampling, speculative)
    rounds: list[Round] = []
    emitted: list[int] = []
    tokens_html, summary, last_chart = "", "", 0.0
    engine = speculative_generate(target.model, drafter, prompt_ids, sampling, speculative, target.eos_token_ids)
    for batch in rounds_in_background(engine, TOKENS_INTERVAL_SECONDS):
        rounds.extend(batch)
        tokens_html += "".join(html_spans(round_spans(round_, decode, emitted)) for round_ in batch)
        summary = summary_markdown(run_stats(rounds), speculative.num_draft_tokens)
        if time.monotonic() - last_chart >= CHART_INTERVAL_SECONDS:
            last_chart = time.monotonic()
            yield tokens_html, summary, *charts(rounds, speculative.num_draft_tokens), gr.skip()
        else:
            yield tokens_html, summary, *unchanged_charts()
        if time.monotonic() > deadline:
            break
    return rounds, tokens_html, summary


def comparison_runs(
    request: RunRequest, target: LoadedModel, draft: LoadedModel | None, baseline: list, draft_alone: list
) -> list[tuple[str, list, LoadedModel, SamplingConfig]]:
    """What to decode alone after the speculative run: the target, and the draft model when there is one."""
    runs = [("target alone", baseline, target, request.sampling)]
    if draft is not None and draft is not target:
        runs.append(("draft alone", draft_alone, draft, request.speculative.draft_sampling(request.sampling)))
    return runs


def charts(rounds: list[Round], num_draft_tokens: int, baseline: list[Round] | None = None) -> tuple:
    return (
        acceptance_figure(rounds),
        latency_figure(rounds),
        positions_figure(rounds, num_draft_tokens),
        throughput_figure(rounds, baseline or []),
    )
