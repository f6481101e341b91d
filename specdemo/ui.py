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
import torch

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
from specdemo.model_cache import ModelCache
from specdemo.models import (
    LOCAL_PATHS_VARIABLE,
    OFFLINE_DEFAULT,
    LoadedModel,
    bound_allocator_arenas,
    chat_prompt_ids,
)
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
RUN_CONCURRENCY = 1  # runs decoding at once: they share the CPU's cores, so a second run only slows the first
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


@dataclass(frozen=True)
class Run:
    """One run: its checked request, models and prompt, what it shares with other runs, and when it must end."""

    request: RunRequest
    target: LoadedModel
    draft: LoadedModel | None
    prompt_ids: torch.Tensor  # [1, T]
    models_in_use: threading.Semaphore  # held by an engine thread for as long as it runs the shared models
    deadline: float  # time.monotonic() at which the run's time budget ends, comparisons included


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
    bound_allocator_arenas()  # before the queue starts its worker threads
    # The default pair is ready before the first visitor (and ZeroGPU wants models loaded outside GPU functions).
    load_pair(DEFAULT_PAIR, cache, progress=print)

    models_in_use = threading.Semaphore(RUN_CONCURRENCY)  # held by each engine thread while it runs the models

    @on_gpu
    def generate(
        prompt: str,
        pair: str,
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
        progress: gr.Progress = gr.Progress(),
    ) -> Iterator[tuple]:
        """Speculative decoding of `prompt` with the draft/target `pair`, streamed; then, with `compare`, the
        target (and draft model) alone. Each parameter but `prompt` defaults to the form's value."""
        try:
            request = parse_request(
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
            )
            target, draft = load_pair(
                request.pair, cache, lambda message: progress(0.0, desc=message), allow_local=request.allow_local
            )
            prompt_ids = chat_prompt_ids(target, request.prompt, chat=request.chat)  # [1, T]
            check_prompt_fits(prompt_ids.shape[1], request.speculative.max_new_tokens, target.context_length)
        except ValueError as error:
            raise user_error(str(error)) from error
        deadline = time.monotonic() + RUN_TIME_BUDGET_SECONDS
        try:
            yield from stream_run(Run(request, target, draft, prompt_ids, models_in_use, deadline))
        except Exception as error:  # a model error, out of memory...: this run fails, the app and its models stay
            message = f"The run failed ({error.__class__.__name__}: {str(error)[:200]})"
            yield gr.skip(), html.escape(f"**{message}.**", quote=False), *unchanged_charts()  # the why, kept
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
                    "",  # a value, so API clients may leave it out
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

        pair.change(  # queue=False: the note changes at once, even while a run holds the queue's run slot
            describe_pair,
            inputs=pair,
            outputs=[note, custom_target, custom_draft, draft_temperature],
            queue=False,
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
                    concurrency_limit=RUN_CONCURRENCY,
                    concurrency_id="generate",  # Run and Enter share the run slots
                    preprocess=False,
                    api_name="generate" if trigger == run.click else False,
                )
            )
        # The note comes after the cancel, so no update of the stopped run that was already on its way overwrites it;
        # queue=False: it must not wait behind other runs.
        stop.click(None, cancels=run_events, api_visibility="private").then(
            stopped_summary, inputs=summary, outputs=summary, queue=False, api_visibility="private"
        )
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


class EngineThread:
    """An engine (an iterator of rounds) run in its own thread, so a slow page or network never slows or stops it.

    It stops after the round in progress at the deadline, or once `batches()` is closed: Gradio closes a run's
    generator on Stop and when its client disconnects. It holds `models_in_use` while it runs the models.
    """

    def __init__(self, rounds: Iterator[Round], models_in_use: threading.Semaphore, deadline: float) -> None:
        self.rounds, self.models_in_use, self.deadline = rounds, models_in_use, deadline
        self.out_of_time = False  # True when the deadline, not the engine, ended the rounds
        self.arrived: queue.Queue = queue.Queue()
        self.stop = threading.Event()
        self.worker = threading.Thread(target=self._work, name="specdemo-engine", daemon=True)

    def _work(self) -> None:
        try:
            with self.models_in_use:  # a stopped run's engine may still be in a forward pass: wait for it
                self._run_rounds()
        except Exception as error:  # handed to the consumer's thread, which raises it there
            self.arrived.put(error)
        finally:
            self.arrived.put(_DONE)  # after the release: a consumer that sees it may start the next engine

    def _run_rounds(self) -> None:
        try:
            while not self.stop.is_set():
                if time.monotonic() >= self.deadline:
                    self.out_of_time = True
                    return
                round_ = next(self.rounds, None)
                if round_ is None:
                    return
                self.arrived.put(round_)
        finally:
            self.rounds.close()  # type: ignore[attr-defined]

    def batches(self, interval: float) -> Iterator[list[Round]]:
        """The rounds that arrived, at most every `interval` seconds, until the engine has finished."""
        self.worker.start()
        try:
            done = False
            while not done:
                batch, done = self._next_batch(interval)
                if batch:
                    yield batch
            self.worker.join()  # it has put _DONE, so it only has to return
        finally:
            # On Stop or a disconnect Gradio closes the run's generator from its event loop
            # (gradio/queueing.py reset_iterators -> utils.SyncToAsyncIterator.aclose -> close()): waiting here for
            # the forward pass in progress would stall every page, so the next engine waits for models_in_use.
            self.stop.set()

    def _next_batch(self, interval: float) -> tuple[list[Round], bool]:
        """The rounds that arrive within `interval` of the first one, and whether the engine is done."""
        batch: list[Round] = []
        item, deadline = self.arrived.get(), time.monotonic() + interval
        while item is not _DONE:
            if isinstance(item, Exception):
                raise item
            batch.append(item)
            try:
                item = self.arrived.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return batch, False
        return batch, True


def unchanged_charts() -> tuple:
    """The four charts and the trace left as they are (fresh objects: Gradio may consume an update)."""
    return tuple(gr.skip() for _ in range(5))


IN_PROGRESS_END = "…*"  # how every streamed summary but the last ends


def in_progress(summary: str, what: str) -> str:
    """A streamed summary says it is not the last, so a client whose stream was cut short can tell."""
    return f"{summary}\n\n*{what}{IN_PROGRESS_END}"


def stopped_summary(summary: str) -> str:
    """The summary once Stop is pressed: a run still in progress says that it was stopped, and what that leaves
    out; a finished run's summary stays as it is."""
    if not summary.endswith(IN_PROGRESS_END):
        return summary
    return (
        summary[: summary.rindex("\n\n*")]
        + "\n\n**Stopped: you pressed Stop.** The figures above cover the rounds decoded until then; the rest of the "
        "run and the comparison with the target alone did not run."
    )


def stream_run(run: Run) -> Iterator[tuple]:
    """Yield (tokens, summary, four charts, trace) as rounds arrive, then while the comparisons run; the last
    update carries every output, and its summary says why the run ended when it ended early."""
    request = run.request
    # Stop can close a generator only once Gradio holds it, which is after its first update (gradio/route_utils.py,
    # call_process_api stores it in app.iterators; a cancel before that drops it unclosed): so no engine starts
    # before a first, cheap update.
    yield "", in_progress("", "Decoding"), *unchanged_charts()
    rounds, tokens_html, summary, out_of_time = yield from stream_speculative(run)
    baseline: list[Round] = []
    draft_alone: list[Round] = []
    if request.compare and not out_of_time:
        streamed = in_progress(summary, "Now decoding alone, to compare")
        yield tokens_html, streamed, *charts(rounds, request.speculative.num_draft_tokens), gr.skip()
        baseline, draft_alone, out_of_time = yield from stream_comparisons(run, tokens_html, summary)
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
    trace = _trace_file(request, run.target, run.prompt_ids[0].tolist(), rounds, baseline)
    yield tokens_html, summary, *charts(rounds, num_draft_tokens, baseline), gr.update(value=trace, visible=True)


def stream_speculative(run: Run) -> Generator[tuple, None, tuple[list[Round], str, str, bool]]:
    """The speculative run, streamed: tokens every batch, charts at most twice a second, until done or the
    deadline. Returns its rounds, token HTML, summary, and whether the deadline ended it."""
    target, sampling, speculative = run.target, run.request.sampling, run.request.speculative
    decode = partial(target.tokenizer.decode, skip_special_tokens=False)
    drafter = make_drafter(target, run.draft, speculative)
    rounds: list[Round] = []
    emitted: list[int] = []
    tokens_html, summary, last_chart = "", "", 0.0
    engine = EngineThread(
        speculative_generate(target.model, drafter, run.prompt_ids, sampling, speculative, target.eos_token_ids),
        run.models_in_use,
        run.deadline,
    )
    for batch in engine.batches(TOKENS_INTERVAL_SECONDS):
        rounds.extend(batch)
        tokens_html += "".join(html_spans(round_spans(round_, decode, emitted)) for round_ in batch)
        summary = summary_markdown(run_stats(rounds), speculative.num_draft_tokens)
        streamed = in_progress(summary, f"Decoding: {len(emitted)} tokens so far")
        if time.monotonic() - last_chart >= CHART_INTERVAL_SECONDS:
            last_chart = time.monotonic()
            yield tokens_html, streamed, *charts(rounds, speculative.num_draft_tokens), gr.skip()
        else:
            yield tokens_html, streamed, *unchanged_charts()
    return rounds, tokens_html, summary, engine.out_of_time


def stream_comparisons(
    run: Run, tokens_html: str, summary: str
) -> Generator[tuple, None, tuple[list[Round], list[Round], bool]]:
    """Decode with the target alone, then the draft model alone; none starts after the deadline and a running one
    stops at it. Returns their rounds (none when the deadline came first) and whether it did."""
    collected: dict[str, list[Round]] = {}  # by label
    for label, model, sampling in comparison_runs(run.request, run.target, run.draft):
        rounds = collected.setdefault(label, [])
        engine = EngineThread(
            autoregressive_generate(
                model.model, run.prompt_ids, sampling, run.request.speculative.max_new_tokens, model.eos_token_ids
            ),
            run.models_in_use,
            run.deadline,
        )
        for batch in engine.batches(CHART_INTERVAL_SECONDS):  # Stop works here too
            rounds.extend(batch)
            note = f"Now decoding with the {label}, to compare: {len(rounds)} tokens"
            yield tokens_html, in_progress(summary, note), *unchanged_charts()
        if engine.out_of_time:  # an unfinished comparison would compare unlike things
            return [], [], True
    return collected["target alone"], collected.get("draft alone", []), False


def comparison_runs(
    request: RunRequest, target: LoadedModel, draft: LoadedModel | None
) -> list[tuple[str, LoadedModel, SamplingConfig]]:
    """What to decode alone after the speculative run: the target, and the draft model when there is one."""
    runs = [("target alone", target, request.sampling)]
    if draft is not None and draft is not target:
        runs.append(("draft alone", draft, request.speculative.draft_sampling(request.sampling)))
    return runs


def charts(rounds: list[Round], num_draft_tokens: int, baseline: list[Round] | None = None) -> tuple:
    """The four charts of the run (the throughput one against the target alone, when it ran)."""
    return (
        acceptance_figure(rounds),
        latency_figure(rounds),
        positions_figure(rounds, num_draft_tokens),
        throughput_figure(rounds, baseline or []),
    )
