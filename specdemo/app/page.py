"""The Gradio app: the page, its One prompt and Batch tabs and their handlers; the engine does the work (the Audit
tab is audit_tab.py, the refusal message messages.py: the only other modules importing gradio)."""

from __future__ import annotations

import html
import json
import os
import tempfile
import time
from collections.abc import Generator, Iterator
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path

import gradio as gr
import torch

from specdemo.app.audit_tab import build_audit_tab
from specdemo.app.messages import user_error
from specdemo.app.plots import (
    acceptance_figure,
    batch_sweep_figure,
    candidates_sweep_figure,
    latency_figure,
    positions_figure,
    throughput_figure,
    waiting,
)
from specdemo.app.render import (
    CANDIDATES_CSS,
    LANES_CSS,
    LEGEND_HTML,
    TOKEN_CSS,
    Divergence,
    alone_html,
    candidates_html,
    cut_note,
    first_difference,
    html_spans,
    lanes_html,
    round_spans,
    sharing_note,
    summary_markdown,
    token_text,
)
from specdemo.config import (
    MAX_NUM_CANDIDATES,
    MAX_NUM_DRAFT_TOKENS,
    MAX_PROMPT_CHARACTERS,
    MAX_PROMPT_TOKENS,
    SamplingConfig,
    SpeculativeConfig,
    check_prompt,
    check_prompt_fits,
    whole_number,
)
from specdemo.core.rounds import Round
from specdemo.core.sampling import penalised_scores
from specdemo.core.stats import compare_runs, emitted_ids, round_record, run_stats
from specdemo.drafters.registry import drafter_names
from specdemo.engine.resources import bound_allocator_arenas, openmp_workers_released
from specdemo.engine.scheduler import MAX_BATCH_ROWS, DecodeRequest, RowStream, Schedulers, measure_for_sharing
from specdemo.models.loading import (
    DTYPE_CHOICES,
    LOCAL_PATHS_VARIABLE,
    OFFLINE_DEFAULT,
    LoadedModel,
    chat_prompt_ids,
    dtype_reason,
    pick_device,
    resolve_dtype,
)
from specdemo.models.shared import ModelCache
from specdemo.pairs import DEFAULT_PAIR, NGRAM, PAIRS, Pair, custom_pair, find_pair, load_pair

try:  # On a ZeroGPU Space, GPU work runs inside @spaces.GPU; elsewhere the package is absent and this is a no-op.
    import spaces

    on_gpu = spaces.GPU(duration=120)
    ON_ZEROGPU = True  # each call runs in its own GPU worker: runs cannot share a batch there
except ImportError:
    ON_ZEROGPU = False

    def on_gpu(function):  # type: ignore[no-redef]
        return function


CUSTOM = "custom"
UI_MAX_NEW_TOKENS = 512  # the slider's end: a run stays well under a minute on a CPU
CHART_INTERVAL_SECONDS = 0.5  # charts are re-sent whole (~3 ms to build four): at most 2 updates a second, shared
# by the rows of a batch (each of 8 rows' pages gets one every 4 s), as are the tokens' updates. The target alone
# redraws the two charts it changes twice as often, so both timed runs load a browser on the server's cores alike
# (`make demo` on a laptop): plotly is most of the page's script time.
TOKENS_INTERVAL_SECONDS = 0.1  # tokens stream in batches of rounds, so the page's work never slows the engine
RUN_CONCURRENCY = MAX_BATCH_ROWS  # runs decoding at once, as rows of one batch per model (one at a time on ZeroGPU)
QUEUE_SIZE = 16  # waiting runs beyond this are told the queue is full
# Gradio's queue looks for new events every 1 ms while it has none to start, and for progress every 10 ms; each look
# takes the GIL from the engine's thread. The idle server's thread used 0.8 s of CPU in 8 s, 0.09 s at these periods.
# An event now waits up to 20 ms to start.
QUEUE_POLL_SECONDS = {"sleep_when_free": 0.02, "progress_update_sleep_when_free": 0.1}
RUN_TIME_BUDGET_SECONDS = 120.0  # one run, comparison included; then it stops and says so
SWEEP_FILE = "assets/batch-sweep.json"  # bench --batch-sizes, measured, drawn on the Batch tab
LIMITS = (
    f"Limits: a prompt of up to {MAX_PROMPT_TOKENS:,} tokens ({MAX_PROMPT_CHARACTERS:,} characters), up to "
    f"{UI_MAX_NEW_TOKENS} new tokens, up to {MAX_NUM_DRAFT_TOKENS} draft tokens per round, "
    f"{RUN_TIME_BUDGET_SECONDS:.0f} s per run. Up to {RUN_CONCURRENCY} runs share each model pass; up to {QUEUE_SIZE} "
    "more can wait."
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
    dtype: torch.dtype  # weights and activations, from the form's Number format on this device
    dtype_reason: str  # what the page says, e.g. "float32 (auto: this CPU has no native bfloat16)"


@dataclass(frozen=True)
class Run:
    """One run: its checked request, models and prompt, what it shares with other runs, and when it must end."""

    request: RunRequest
    target: LoadedModel
    draft: LoadedModel | None
    prompt_ids: torch.Tensor  # [1, T]
    schedulers: Schedulers  # where its rows join other runs' batches
    deadline: float  # time.monotonic() at which the run's time budget ends, comparisons included

    def submit(self, model: LoadedModel, draft: LoadedModel | None, request: DecodeRequest) -> RowStream:
        return self.schedulers.get(model, draft, self.request.pair.drafter).submit([request], self.deadline)


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
    num_candidates: float = 1,
    dtype: str = "auto",
) -> RunRequest:
    """The form's values as checked settings; a ValueError names the first bad one."""
    check_prompt(prompt)
    if whole_number("max new tokens", max_new_tokens) > UI_MAX_NEW_TOKENS:
        raise ValueError(f"max new tokens must be between 1 and {UI_MAX_NEW_TOKENS} here, got {max_new_tokens}.")
    allow_local = os.environ.get(LOCAL_PATHS_VARIABLE) == "1"
    pair = (
        custom_pair(str(custom_target or "").strip(), str(custom_draft or "").strip() or NGRAM, allow_local)
        if pair_key == CUSTOM
        else find_pair(pair_key)
    )
    sampling = SamplingConfig(
        temperature=temperature,
        top_k=whole_number("top-k", top_k),
        top_p=top_p,
        repetition_penalty=repetition_penalty,
        seed=whole_number("seed", seed),
    )
    speculative = SpeculativeConfig(
        num_draft_tokens=whole_number("draft tokens per round", num_draft_tokens),
        max_new_tokens=whole_number("max new tokens", max_new_tokens),
        draft_temperature=draft_temperature if pair.uses_draft_model else None,
        num_candidates=whole_number("candidates per round (W)", num_candidates),
    )
    if speculative.max_new_tokens > UI_MAX_NEW_TOKENS:
        raise ValueError(
            f"max new tokens must be between 1 and {UI_MAX_NEW_TOKENS} here, got {speculative.max_new_tokens}."
        )
    device = pick_device()  # where the cache loads models
    resolved, reason = resolve_dtype(str(dtype), device), dtype_reason(str(dtype), device)
    return RunRequest(prompt, pair, sampling, speculative, bool(chat), bool(compare), allow_local, resolved, reason)


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
        "dtype_reason": request.dtype_reason,
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


def check_settings(*values: object) -> None:
    """The form's values, checked before anything runs; the refusal names the setting."""
    try:
        parse_request(*values)  # type: ignore[arg-type]
    except ValueError as error:
        raise user_error(str(error)) from error


BATCH_EXAMPLE = "\n".join(
    [
        "Correct the spelling: The quartely planing meeting is moved to Thursday.",
        "Turn into a Markdown table: name,age / Ann,31 / Bo,27 / Cy,45",
        "Write a haiku about autumn rain.",
        "Summarise in one sentence: The train leaves at 9:40 from platform 3 and arrives in Lyon at 13:05.",
    ]
)


def load_sweep() -> dict | None:
    """The measured batch sweep shipped with the app (bench --batch-sizes), or None when absent."""
    path = Path(__file__).resolve().parents[2] / SWEEP_FILE
    return json.loads(path.read_text()) if path.is_file() else None


SWEEP_LESSONS = {  # what each of the sweep's charts teaches, after the sentence that says how it was measured
    "batch": "Where the speculative line falls under target-only, drafting costs more than it wins at that batch size. "
    "Batches here cut their drafts for shared passes, as the sweep's line of that name did.",
    "candidates": "More candidates per round win more tokens per target pass, and every one of them widens the pass: "
    "the batch chart on the Batch tab shows what that costs in tokens/s.",
}


def sweep_caption(sweep: dict | None, chart: str = "batch") -> str:
    if sweep is None:
        return "No measured sweep here: run `python -m specdemo bench --batch-sizes 1,2,4,8 --num-candidates 1,2,4`."
    return (
        f"Measured{' on ' + sweep['date'] if 'date' in sweep else ''} with `bench --batch-sizes` on "
        f"{sweep.get('model', 'this machine')}: {sweep['pair']}, greedy, "
        f"{sweep['max_new_tokens']} new tokens, the same {sweep['rows'][0]['num_prompts']} prompts at every B. "
        + SWEEP_LESSONS[chart]
    )


def build_demo(cache: ModelCache | None = None) -> gr.Blocks:
    """The whole page. `cache` holds loaded models across runs and users (a fresh one by default)."""
    cache = cache or ModelCache(pinned=OFFLINE_DEFAULT)
    bound_allocator_arenas()  # before the queue starts its worker threads
    # The default pair is ready before the first visitor (and ZeroGPU wants models loaded outside GPU functions).
    with openmp_workers_released():  # this thread then waits for the server; the runs' threads decode
        default_target, _ = load_pair(DEFAULT_PAIR, cache, progress=print)
        if not ON_ZEROGPU:  # where runs share passes, their drafts are cut by this device's pass costs
            measure_for_sharing(default_target, print)
    shared_schedulers = Schedulers()  # runs of the same models share their passes
    sweep = load_sweep()

    def prepare(prompts: list[str], values: tuple, progress: gr.Progress) -> tuple[RunRequest, Run, list[torch.Tensor]]:
        """The checked request, its models and encoded prompts; a ValueError names the problem."""
        request = parse_request(prompts[0], *values)
        with openmp_workers_released():  # a Gradio worker thread: it lives on, idle
            target, draft = load_pair(
                request.pair,
                cache,
                lambda message: progress(0.0, desc=message),
                allow_local=request.allow_local,
                dtype=request.dtype,  # the comparisons run on these same models, so in the same format
            )
        encoded = []
        for number, text in enumerate(prompts, start=1):
            prompt_ids = chat_prompt_ids(target, text, chat=request.chat)  # [1, T]
            try:
                check_prompt_fits(prompt_ids.shape[1], request.speculative.max_new_tokens, target.context_length)
            except ValueError as error:
                raise ValueError(f"Prompt {number}: {error}" if len(prompts) > 1 else str(error)) from None
            encoded.append(prompt_ids)
        schedulers = Schedulers() if ON_ZEROGPU else shared_schedulers  # ZeroGPU: each call in its own worker
        if not ON_ZEROGPU:
            with openmp_workers_released():
                measure_for_sharing(target, lambda message: progress(0.0, desc=message))
        deadline = time.monotonic() + RUN_TIME_BUDGET_SECONDS
        return request, Run(request, target, draft, encoded[0], schedulers, deadline), encoded

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
        num_candidates: float = 1,
        dtype: str = "auto",
        progress: gr.Progress = gr.Progress(),
    ) -> Iterator[tuple]:
        """Speculative decoding of `prompt` with the draft/target `pair` and W = `num_candidates` drafts per round, in
        the number format `dtype` (auto, float32 or bfloat16), streamed; then, with `compare`, the target (and draft
        model) alone. Each parameter but `prompt` defaults to the form's value. Runs that arrive together share the
        model's passes."""
        values = (pair, custom_target, custom_draft, temperature, top_k, top_p, repetition_penalty)
        values += (draft_temperature, num_draft_tokens, max_new_tokens, seed, chat, compare, num_candidates, dtype)
        try:
            _, run, _ = prepare([prompt], values, progress)
        except ValueError as error:
            raise user_error(str(error)) from error
        try:
            yield from stream_run(run)
        except Exception as error:  # a model error, out of memory...: this run fails, the app and its models stay
            message = f"The run failed ({error.__class__.__name__}: {str(error)[:200]})"
            yield gr.skip(), html.escape(f"**{message}.**", quote=False), *unchanged_charts()
            raise user_error(
                f"{message}. The app is still serving: try again, or fewer tokens or a smaller pair.", log=True
            ) from error

    @on_gpu
    def generate_batch(
        prompts: str | list[str],
        pair: str = DEFAULT_PAIR.key,
        custom_target: str = "",
        custom_draft: str = NGRAM,
        temperature: float = 0.0,
        top_k: float = 0,
        top_p: float = 1.0,
        repetition_penalty: float = 1.0,
        draft_temperature: float = 1.5,
        num_draft_tokens: float = 5,
        max_new_tokens: float = 128,
        seed: float = 0,
        chat: bool = True,
        compare: bool = False,
        num_candidates: float = 1,
        dtype: str = "auto",
        progress: gr.Progress = gr.Progress(),
    ) -> Iterator[tuple]:
        """Up to 8 `prompts` (a list, or one per line) decoded as rows of one batch, prompt i with seed + i; the
        other parameters as for /generate (`compare` is ignored). Returns one result per prompt."""
        values = (pair, custom_target, custom_draft, temperature, top_k, top_p, repetition_penalty)
        values += (draft_temperature, num_draft_tokens, max_new_tokens, seed, chat, False, num_candidates, dtype)
        try:
            texts = batch_prompts(prompts)
            _, run, encoded = prepare(texts, values, progress)
        except ValueError as error:
            raise user_error(str(error)) from error
        try:
            yield from stream_batch(run, texts, encoded, sweep)
        except Exception as error:  # one prompt's row failed: this batch fails, the app and other runs go on
            message = f"The batch failed ({error.__class__.__name__}: {str(error)[:200]})"
            raise user_error(
                f"{message}. The app is still serving: try again, or fewer prompts or tokens.", log=True
            ) from error

    theme_css = TOKEN_CSS + CANDIDATES_CSS + LANES_CSS
    with gr.Blocks(title="specdemo: speculative decoding, made visible") as demo:
        gr.HTML(HEADER, css_template=theme_css, elem_id="header")
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
                    label=f"Drafter (a Hub id, or {drafter_names()})",
                    value=NGRAM,
                    visible=False,
                    elem_id="custom-draft",
                )
                temperature = gr.Slider(0, 2, value=0, step=0.05, label="Temperature (0 = greedy)")
                top_k = gr.Number(0, minimum=0, step=1, label="Top-k (0 = off)")
                top_p = gr.Slider(0.05, 1, value=1, step=0.01, label="Top-p (1 = off)")
                repetition_penalty = gr.Slider(1, 2, value=1, step=0.05, label="Repetition penalty (1 = off)")
                draft_temperature = gr.Slider(
                    0, 2, value=1.5, step=0.05, visible=False, label="Draft temperature (the draft samples at its own)"
                )
                num_draft_tokens = gr.Slider(
                    1,
                    MAX_NUM_DRAFT_TOKENS,
                    value=5,
                    step=1,
                    label="Draft tokens per round (γ; the most, for a cost-aware drafter)",
                    elem_id="num-draft-tokens",
                )
                num_candidates = gr.Slider(
                    1,
                    MAX_NUM_CANDIDATES,
                    value=1,
                    step=1,
                    label="Candidates per round (W): drafts the target checks together",
                    elem_id="num-candidates",
                )
                max_new_tokens = gr.Slider(
                    1, UI_MAX_NEW_TOKENS, value=128, step=1, label="Max new tokens", elem_id="max-new-tokens"
                )
                seed = gr.Number(0, minimum=0, step=1, label="Seed")
                dtype = gr.Dropdown(
                    list(DTYPE_CHOICES),
                    value="auto",
                    label="Number format (auto: bfloat16 where the device computes in it natively, else float32)",
                    elem_id="dtype",
                )
                chat = gr.Checkbox(True, label="Apply the chat template")
                compare = gr.Checkbox(True, label="Then run the target alone, to compare")
            with gr.Column(scale=2), gr.Tabs():
                with gr.Tab("One prompt", id="one"):
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
                        "",
                        label="Tokens",
                        css_template=theme_css,
                        elem_id="tokens",
                        elem_classes=["tokens"],
                        min_height=80,
                    )
                    summary = gr.Markdown(elem_id="summary")
                    empty = [waiting(figure) for figure in charts([], SpeculativeConfig().num_draft_tokens)]
                    with gr.Row():
                        acceptance = gr.Plot(empty[0], elem_id="acceptance-chart", show_label=False)
                        latency = gr.Plot(empty[1], elem_id="latency-chart", show_label=False)
                    with gr.Row():
                        positions = gr.Plot(empty[2], elem_id="positions-chart", show_label=False)
                        throughput = gr.Plot(empty[3], elem_id="throughput-chart", show_label=False)
                    with gr.Accordion("Candidates of each round (W)", open=False):
                        candidates = gr.HTML("", css_template=theme_css, elem_id="candidates")
                        if sweep is not None:
                            gr.Plot(candidates_sweep_figure(sweep), elem_id="candidates-chart", show_label=False)
                            gr.Markdown(sweep_caption(sweep, "candidates"))
                    trace = gr.DownloadButton("Download the trace (JSON)", visible=False, elem_id="trace")
                with gr.Tab("Batch", id="batch"):
                    batch_prompts_box = gr.Textbox(
                        lines=6,
                        label=f"Prompts, one per line (up to {MAX_BATCH_ROWS}); prompt i uses seed + i",
                        elem_id="batch-prompts",
                    )
                    with gr.Row():
                        batch_run = gr.Button("Run the batch", variant="primary", elem_id="batch-run")
                        batch_stop = gr.Button("Stop", variant="stop", elem_id="batch-stop")
                        gr.Button("Example set", elem_id="batch-example").click(
                            lambda: BATCH_EXAMPLE, outputs=batch_prompts_box, queue=False, api_visibility="private"
                        )
                    batch_lanes = gr.HTML("", css_template=theme_css, elem_id="batch-lanes")
                    batch_summary = gr.Markdown(elem_id="batch-summary")
                    batch_results = gr.JSON(visible=False)
                    with gr.Row():
                        batch_chart = gr.Plot(
                            batch_sweep_figure(sweep) if sweep else None, elem_id="batch-chart", show_label=False
                        )
                        if sweep is not None:
                            gr.Plot(candidates_sweep_figure(sweep), show_label=False)
                    gr.Markdown(sweep_caption(sweep))
                with gr.Tab("Audit: is it lossless?", id="audit"):
                    build_audit_tab(cache, shared_schedulers.models_lock)

        pair.change(  # queue=False: the note changes at once, even while a run holds the queue's run slot
            describe_pair,
            inputs=pair,
            outputs=[note, custom_target, custom_draft, draft_temperature],
            queue=False,
            api_visibility="private",
        )
        settings = [pair, custom_target, custom_draft, temperature, top_k, top_p, repetition_penalty]
        settings += [draft_temperature, num_draft_tokens, max_new_tokens, seed, chat, compare, num_candidates, dtype]
        inputs = [prompt, *settings]
        outputs = [tokens, summary, acceptance, latency, positions, throughput, trace, candidates]
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
                    concurrency_id="generate",  # Run, Enter and the batch share the run slots
                    preprocess=False,
                    api_name="generate" if trigger == run.click else False,
                )
            )
        # The note comes after the cancel, so no update of the stopped run that was already on its way overwrites it;
        # queue=False: it must not wait behind other runs.
        stop.click(None, cancels=run_events, api_visibility="private").then(
            stopped_summary, inputs=summary, outputs=summary, queue=False, api_visibility="private"
        )
        batch_event = batch_run.click(
            generate_batch,
            inputs=[batch_prompts_box, *settings],
            outputs=[batch_lanes, batch_summary, batch_chart, batch_results],
            concurrency_limit=RUN_CONCURRENCY,
            concurrency_id="generate",
            preprocess=False,
            api_name="generate_batch",
        )
        batch_stop.click(None, cancels=[batch_event], api_visibility="private").then(
            stopped_summary, inputs=batch_summary, outputs=batch_summary, queue=False, api_visibility="private"
        )
    demo.queue(max_size=QUEUE_SIZE, default_concurrency_limit=1)  # explicit: ZeroGPU would default to 1
    calm_queue_polling(demo)
    return demo


def calm_queue_polling(demo: gr.Blocks) -> None:
    """Poll Gradio's queue at QUEUE_POLL_SECONDS (private attributes of gradio.queueing.Queue, which has no setting
    for them; one that Gradio renames is left alone, and tests/test_app.py fails)."""
    for name, seconds in QUEUE_POLL_SECONDS.items():
        if hasattr(demo._queue, name):
            setattr(demo._queue, name, seconds)


def batch_prompts(prompts: str | list[str]) -> list[str]:
    """The batch's prompts, from the page (one per line) or an API client (a list), each checked with its line."""
    lines = prompts.splitlines() if isinstance(prompts, str) else list(prompts)
    while lines and not str(lines[-1]).strip():  # a trailing newline is not a prompt
        lines.pop()
    if not lines:
        raise ValueError("The batch is empty: write one prompt per line, or press Example set.")
    if len(lines) > MAX_BATCH_ROWS:
        raise ValueError(
            f"The batch has {len(lines)} prompts; at most {MAX_BATCH_ROWS} run together: remove "
            f"{len(lines) - MAX_BATCH_ROWS}, or run them in two batches."
        )
    if not all(isinstance(line, str) for line in lines):
        raise ValueError("Every prompt of the batch must be text: send a list of strings.")
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            raise ValueError(f"Line {number} of the batch is empty: remove it or write a prompt on it.")
        try:
            check_prompt(line)
        except ValueError as error:
            raise ValueError(f"Line {number} of the batch: {error}") from None
    return lines


def stream_batch(run: Run, texts: list[str], encoded: list[torch.Tensor], sweep: dict | None) -> Iterator[tuple]:
    """Yield (lanes, summary, chart, results) as the batch's rows decode, prompt i with seed + i; the last update
    has one result per prompt."""
    request = run.request
    decode = partial(run.target.tokenizer.decode, skip_special_tokens=False)
    rows = [
        DecodeRequest(ids[0].tolist(), replace(request.sampling, seed=request.sampling.seed + i), request.speculative)
        for i, ids in enumerate(encoded)
    ]
    lanes: list[list[Round]] = [[] for _ in texts]
    yield lanes_html(texts, lanes, decode), in_progress("", "Decoding the batch"), gr.skip(), gr.skip()
    started = time.perf_counter()
    stream = run.schedulers.get(run.target, run.draft, run.request.pair.drafter).submit(rows, run.deadline)
    for batch in stream.batches(CHART_INTERVAL_SECONDS):
        for index, round_ in batch:
            lanes[index].append(round_)
        note = f"Decoding: {sum(len(emitted_ids(lane)) for lane in lanes)} tokens so far"
        yield lanes_html(texts, lanes, decode), in_progress("", note), gr.skip(), gr.skip()
    seconds = time.perf_counter() - started
    results = [
        {
            "prompt": text,
            "seed": row.sampling.seed,
            "token_ids": emitted_ids(lane),
            "text": run.target.tokenizer.decode(emitted_ids(lane), skip_special_tokens=True),
            "stats": run_stats(lane).as_dict() if lane else None,
        }
        for text, row, lane in zip(texts, rows, lanes, strict=True)
    ]
    total = sum(len(result["token_ids"]) for result in results)
    summary = batch_summary(lanes, total, seconds, request.dtype_reason)
    if stream.out_of_time:
        summary = f"**Stopped after {RUN_TIME_BUDGET_SECONDS:g} s, the time budget of one run.**\n\n{summary}"
    chart = batch_sweep_figure(sweep, (len(texts), total / seconds)) if sweep else gr.skip()
    yield lanes_html(texts, lanes, decode), summary, chart, results


def batch_summary(lanes: list[list[Round]], total_tokens: int, seconds: float, number_format: str) -> str:
    """Per lane its tokens, passes, α and tokens per pass; the batch's aggregate tokens/s, how it was shared, and its
    number format (e.g. "float32 (auto: this CPU has no native bfloat16)")."""
    lines = ["| lane | tokens | target passes | α | tokens/pass |", "|---|---|---|---|---|"]
    for number, lane in enumerate(lanes, start=1):
        stats = run_stats(lane)
        per_pass = stats.mean_tokens_per_round
        lines.append(f"| {number} | {stats.num_generated} | {len(lane)} | {stats.alpha:.2f} | {per_pass:.2f} |")
    widest = max((r.num_rows for lane in lanes for r in lane), default=1)
    cut = sum(r.cut is not None for lane in lanes for r in lane)
    longest = max(range(len(lanes)), key=lambda i: len(lanes[i]))  # its rounds are the batch's
    lines += [
        "",
        f"**The batch: {total_tokens} tokens in {seconds:.2f} s, {total_tokens / seconds:.1f} tokens/s in all**; the "
        f"widest pass held {widest} rows (this batch's and other runs' rows share the model's passes)"
        + (
            f"; {cut} lane rounds drafted less than they could, because every row of a pass is padded to the widest "
            "(hover a token for its round's cut)."
            if cut
            else "."
        ),
        "",
        f"The batch took as many rounds as its longest lane, lane {longest + 1}: {len(lanes[longest])} target passes "
        f"for {len(emitted_ids(lanes[longest]))} tokens. Drafting shortens a batch only as far as it shortens that "
        "lane; drafts in the other lanes make the shared passes wider.",
        "",
        f"Number format: {number_format}.",
    ]
    return "\n".join(lines)


def describe_pair(pair_key: str) -> tuple:
    """The pair's note, the custom id fields when 'custom' is picked, the draft temperature for draft models."""
    if pair_key == CUSTOM:
        return (
            f"Type a target and a drafter that share a tokenizer, or {drafter_names()} as the drafter.",
            gr.update(visible=True),
            gr.update(visible=True),
            gr.update(visible=True),
        )
    pair = find_pair(pair_key)
    draft_temperature = gr.update(visible=pair.uses_draft_model, value=pair.draft_temperature or 0.0)
    return pair.note, gr.update(visible=False), gr.update(visible=False), draft_temperature


def unchanged_charts() -> tuple:
    """The four charts, the trace and the candidates left as they are (fresh objects: Gradio may consume an
    update)."""
    return tuple(gr.skip() for _ in range(6))


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
    """Yield (tokens, summary, four charts, trace, candidates) as rounds arrive, then while the comparisons run; the
    last update carries every output, and its summary says why the run ended when it ended early."""
    request = run.request
    # Stop can close a generator only once Gradio holds it, which is after its first update (gradio/route_utils.py,
    # call_process_api stores it in app.iterators; a cancel before that drops it unclosed): so no row is submitted
    # before a first, cheap update.
    yield "", in_progress("", "Decoding"), *unchanged_charts()
    rounds, tokens_html, summary, out_of_time = yield from stream_speculative(run)
    alone: dict[str, list[Round]] = {}
    if request.compare and not out_of_time:
        alone, out_of_time = yield from stream_comparisons(run, rounds, tokens_html, summary)
    baseline, draft_alone = alone.get("target alone", []), alone.get("draft alone", [])
    num_draft_tokens = request.speculative.num_draft_tokens
    shared = sharing_note(rounds, baseline) if baseline else None
    comparison = compare_runs(rounds, baseline, num_draft_tokens) if baseline and not shared else None
    greedy = request.sampling.is_greedy
    differ = greedy and comparison is not None and not comparison.identical  # then say where, and how near a tie
    summary = summary_markdown(
        run_stats(rounds),
        num_draft_tokens,
        baseline=run_stats(baseline) if baseline else None,
        comparison=comparison,
        draft_alone=run_stats(draft_alone) if draft_alone else None,
        greedy=greedy,
        number_format=request.dtype_reason,
        divergence=greedy_divergence(run, rounds, baseline) if differ else None,
    )
    for note in (shared, cut_note(rounds, greedy)):
        if note:
            summary += f"\n\n{note}"
    if out_of_time:
        note = (
            f"Stopped after {RUN_TIME_BUDGET_SECONDS:g} s, the time budget of one run: lower max new tokens, "
            "turn off the comparison, or pick a faster pair."
        )
        gr.Warning(note)
        summary = f"**{note}**\n\n{summary}"
    tokens_html += alone_blocks(run, alone, running=None)
    trace = _trace_file(request, run.target, run.prompt_ids[0].tolist(), rounds, baseline)
    yield (
        tokens_html,
        summary,
        *charts(rounds, num_draft_tokens, baseline),
        gr.update(value=trace, visible=True),
        gr.skip(),
    )


def stream_speculative(run: Run) -> Generator[tuple, None, tuple[list[Round], str, str, bool]]:
    """The speculative run, streamed: tokens every batch, charts and candidates at most twice a second, until done or
    the deadline. Returns its rounds, token HTML, summary, and whether the deadline ended it."""
    target, sampling, speculative = run.target, run.request.sampling, run.request.speculative
    decode = partial(target.tokenizer.decode, skip_special_tokens=False)
    rounds: list[Round] = []
    emitted: list[int] = []
    tokens_html, summary, last_chart = "", "", 0.0
    stream = run.submit(target, run.draft, DecodeRequest(run.prompt_ids[0].tolist(), sampling, speculative))
    for batch in stream.rounds(TOKENS_INTERVAL_SECONDS):
        rounds.extend(batch)
        tokens_html += "".join(html_spans(round_spans(round_, decode, emitted)) for round_ in batch)
        summary = summary_markdown(
            run_stats(rounds), speculative.num_draft_tokens, number_format=run.request.dtype_reason
        )
        streamed = in_progress(summary, f"Decoding: {len(emitted)} tokens so far")
        if time.monotonic() - last_chart >= CHART_INTERVAL_SECONDS * max(1, stream.scheduler.num_rows):
            last_chart = time.monotonic()
            candidates = candidates_html(rounds, decode)
            yield tokens_html, streamed, *charts(rounds, speculative.num_draft_tokens), gr.skip(), candidates
        else:
            yield tokens_html, streamed, *unchanged_charts()
    candidates = candidates_html(rounds, decode)  # every round's, the last included
    final = in_progress(summary, f"Decoded {len(emitted)} tokens")
    yield tokens_html, final, *charts(rounds, speculative.num_draft_tokens), gr.skip(), candidates
    return rounds, tokens_html, summary, stream.out_of_time


def stream_comparisons(
    run: Run, speculative_rounds: list[Round], tokens_html: str, summary: str
) -> Generator[tuple, None, tuple[dict[str, list[Round]], bool]]:
    """Decode with the target alone, then the draft model alone, as rows that draft nothing in the same schedulers
    as other runs, streamed as the speculative run was: the text under its tokens at the same pace, and the two charts
    it changes redrawn twice as often as that run's four (see CHART_INTERVAL_SECONDS), so the speedup compares runs
    that loaded the page alike.
    None starts after the deadline and a running one stops at it. Returns their rounds by label (none when the
    deadline came first) and whether it did."""
    collected: dict[str, list[Round]] = {}
    prompt_ids = run.prompt_ids[0].tolist()
    for label, model, draft, sampling in comparison_runs(run.request, run.target, run.draft):
        rounds = collected.setdefault(label, [])
        speculative = SpeculativeConfig(max_new_tokens=run.request.speculative.max_new_tokens)
        stream = run.submit(model, draft, DecodeRequest(prompt_ids, sampling, speculative, drafting=False))
        last_chart = 0.0
        for batch in stream.rounds(TOKENS_INTERVAL_SECONDS):  # Stop works here too
            rounds.extend(batch)
            page = tokens_html + alone_blocks(run, collected, running=label)
            streamed = in_progress(summary, f"Now decoding with the {label}, to compare: {len(rounds)} tokens")
            # the two charts it changes, twice as often: as many charts a second as the speculative run's four
            if time.monotonic() - last_chart >= CHART_INTERVAL_SECONDS / 2 * max(1, stream.scheduler.num_rows):
                last_chart = time.monotonic()
                baseline = collected["target alone"]
                live = latency_figure(speculative_rounds, baseline), throughput_figure(speculative_rounds, baseline)
                yield page, streamed, gr.skip(), live[0], gr.skip(), live[1], gr.skip(), gr.skip()
            else:
                yield page, streamed, *unchanged_charts()
        if stream.out_of_time:  # an unfinished comparison would compare unlike things
            return {}, True
    return collected, False


def alone_blocks(run: Run, alone: dict[str, list[Round]], running: str | None) -> str:
    """The comparison runs' texts, in the order they ran; `running` names the one still decoding."""
    decode = partial(run.target.tokenizer.decode, skip_special_tokens=False)  # a draft model shares the tokenizer
    return "".join(
        alone_html(label, decode(ids := emitted_ids(rounds)), len(ids), running=label == running)
        for label, rounds in alone.items()
        if rounds
    )


def comparison_runs(
    request: RunRequest, target: LoadedModel, draft: LoadedModel | None
) -> list[tuple[str, LoadedModel, LoadedModel | None, SamplingConfig]]:
    """What to decode alone after the speculative run: the target (in the speculative run's scheduler, beside other
    runs of the pair), and the draft model when there is one: (label, model, its scheduler's draft, settings)."""
    runs = [("target alone", target, draft, request.sampling)]
    if draft is not None and draft is not target:
        runs.append(("draft alone", draft, None, request.speculative.draft_sampling(request.sampling)))
    return runs


@torch.inference_mode()
def greedy_divergence(run: Run, rounds: list[Round], baseline: list[Round]) -> Divergence | None:
    """Where a greedy run's tokens first differ from the target alone's, with the target's top two there, from one
    pass over the shared prefix (only taken when they differ); None where one run's tokens begin the other's."""
    speculative_ids, target_ids = emitted_ids(rounds), emitted_ids(baseline)
    first = first_difference(speculative_ids, target_ids)
    if first is None:
        return None
    context = [*run.prompt_ids[0].tolist(), *target_ids[:first]]
    context_ids = torch.tensor([context], device=run.target.device)  # [1, T + first]
    with run.schedulers.models_lock, openmp_workers_released():  # apart from other runs' passes; a Gradio thread
        logits = run.target.model(input_ids=context_ids, logits_to_keep=1).logits  # [1, 1, V]
    scores = penalised_scores(logits, context_ids, run.request.sampling)[0, 0]  # [V] what greedy takes the argmax of
    top_logits = scores.topk(2).values  # [2]
    top_probs = scores.softmax(dim=-1).topk(2).values  # [2]
    decode = partial(run.target.tokenizer.decode, skip_special_tokens=False)
    return Divergence(
        position=first + 1,
        speculative_text=token_text(decode, context, speculative_ids[first]),
        target_text=token_text(decode, context, target_ids[first]),
        top2_logit_gap=float(top_logits[0] - top_logits[1]),
        top2_probs=(float(top_probs[0]), float(top_probs[1])),
        dtype=str(run.target.model.dtype).removeprefix("torch."),
    )


def charts(rounds: list[Round], num_draft_tokens: int, baseline: list[Round] | None = None) -> tuple:
    """The four charts of the run (the throughput one against the target alone, when it ran)."""
    return (
        acceptance_figure(rounds),
        latency_figure(rounds, baseline or []),
        positions_figure(rounds, num_draft_tokens),
        throughput_figure(rounds, baseline or []),
    )
