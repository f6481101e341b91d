"""The One prompt tab and /generate: one prompt decoded speculatively, streamed round by round, then the target (and
a draft model) alone to compare; the summary explains the speedup with measured parts."""

from __future__ import annotations

import html
import inspect
import time
from collections.abc import Callable, Generator, Iterator
from functools import partial

import gradio as gr

from specdemo.app.form import RUN_FIELDS, UI_MAX_NEW_TOKENS, names, parse_request, signature
from specdemo.app.panels import step_view
from specdemo.app.panels.lessons import LessonRow
from specdemo.app.serving.divergence import divergence
from specdemo.app.serving.handlers import stop_signal, stoppable
from specdemo.app.serving.messages import failure_sentence, user_error
from specdemo.app.serving.runs import (
    CHART_INTERVAL_SECONDS,
    QUEUE_SIZE,
    RUN_CONCURRENCY,
    RUN_TIME_BUDGET_SECONDS,
    Run,
    Server,
    check_values,
    decode_fn,
    in_progress,
    read_values,
    requested_seconds,
    stopped_summary,
    sweep_caption,
    trace_record,
)
from specdemo.app.serving.share import link_js
from specdemo.app.serving.zerogpu import gpu_function
from specdemo.app.views.plots import candidates_sweep_figure, latency_figure, run_charts, throughput_figure, waiting
from specdemo.app.views.render import (
    THEME_CSS,
    alone_html,
    candidates_html,
    html_spans,
    round_spans,
)
from specdemo.app.views.summary import (
    HEADLINE_CSS,
    coupled_chances,
    cut_note,
    headline_html,
    sharing_note,
    summary_markdown,
)
from specdemo.config import (
    MAX_NUM_DRAFT_TOKENS,
    MAX_PROMPT_CHARACTERS,
    MAX_PROMPT_TOKENS,
    SpeculativeConfig,
)
from specdemo.core.rounds import Round
from specdemo.core.stats import compare_runs, emitted_ids, run_stats
from specdemo.engine.scheduler import DecodeRequest
from specdemo.pairs import DEFAULT_PAIR

TOKENS_INTERVAL_SECONDS = 0.1  # tokens stream in batches of rounds, so the page's work never slows the engine
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
PROMPT = inspect.Parameter("prompt", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=str)


def build_tab(server: Server, settings: dict[str, gr.components.Component], lessons: LessonRow) -> gr.Textbox:
    """The tab's prompt, buttons, tokens, summary and charts, and its events (/generate, and the lessons' runs);
    returns the prompt."""
    prompt, run, stop, copy_link, link = prompt_row(settings)
    outputs, candidates_box = run_outputs(server)
    tokens, summary, trace = outputs[0], outputs[1], outputs[6]
    inputs = [prompt, *settings.values()]
    steps = gpu_function(partial(run_steps, server), partial(requested_seconds, "prompt"))  # a ZeroGPU call each
    events = wire_runs(server, steps, inputs, outputs, [run.click, prompt.submit])
    events += wire_lessons(server, steps, inputs, outputs, lessons, candidates_box)
    step_view.build(server, trace, tokens, events, THEME_CSS, inputs)
    copy_link.click(None, inputs=inputs, outputs=link, js=link_js(), api_visibility="private")
    copy_link.click(lambda: gr.update(visible=True), outputs=link, queue=False, api_visibility="private")
    # The note comes after the cancel, so no update of the stopped run that was already on its way overwrites it.
    stop.click(None, cancels=events, api_visibility="private").then(
        stopped_summary, inputs=summary, outputs=summary, queue=False, api_visibility="private"
    )
    return prompt


def prompt_row(settings: dict[str, gr.components.Component]) -> tuple:
    """The prompt, the Run, Stop and Copy link buttons, the link box, the limits and the examples: (prompt, run, stop,
    copy_link, link)."""
    prompt = gr.Textbox(
        lines=5,
        label="Prompt",
        elem_id="prompt",
        placeholder="Text to continue; input-grounded tasks (edit, summarise) draft best",
    )
    with gr.Row():
        run = gr.Button("Run", variant="primary", elem_id="run")
        stop = gr.Button("Stop", variant="stop", elem_id="stop")
        copy_link = gr.Button("Copy link", elem_id="copy-link", scale=0, min_width=120)
    link = gr.Textbox(
        label="A link that opens this run (copied where the browser allows)",
        elem_id="share-link",
        visible=False,
        buttons=["copy"],
    )
    gr.Markdown(LIMITS, elem_id="limits")
    with gr.Column(elem_id="examples"):
        gr.Examples(EXAMPLES, inputs=[prompt, settings["pair"], settings["temperature"]], cache_examples=False)
    return prompt, run, stop, copy_link, link


def run_outputs(server: Server) -> tuple[list[gr.components.Component], gr.Accordion]:
    """What a run fills, laid out (the headline, the tokens, the summary, the four charts, the candidates and the
    trace), in the order run_steps yields them; and the candidates' accordion."""
    headline = gr.HTML("", css_template=HEADLINE_CSS, elem_id="headline")
    tokens = gr.HTML(
        "",
        label="Tokens",
        css_template=THEME_CSS + step_view.STEP_CSS,
        elem_id="tokens",
        elem_classes=["tokens"],
        min_height=80,
        js_on_load=step_view.INSPECT_JS,
    )
    summary = gr.Markdown(elem_id="summary")
    empty = [waiting(figure) for figure in run_charts([], SpeculativeConfig().num_draft_tokens)]
    with gr.Row():
        acceptance = gr.Plot(empty[0], elem_id="acceptance-chart", show_label=False)
        latency = gr.Plot(empty[1], elem_id="latency-chart", show_label=False)
    with gr.Row():
        positions = gr.Plot(empty[2], elem_id="positions-chart", show_label=False)
        throughput = gr.Plot(empty[3], elem_id="throughput-chart", show_label=False)
    with gr.Accordion("Candidates of each round (W)", open=False) as candidates_box:
        candidates = gr.HTML("", css_template=THEME_CSS, elem_id="candidates")
        if server.sweep is not None:
            gr.Plot(candidates_sweep_figure(server.sweep), elem_id="candidates-chart", show_label=False)
            gr.Markdown(sweep_caption(server.sweep, "candidates"))
    trace = gr.DownloadButton("Download the trace (JSON)", visible=False, elem_id="trace")
    return [tokens, summary, acceptance, latency, positions, throughput, trace, candidates, headline], candidates_box


def wire_runs(
    server: Server, steps: Callable[..., Iterator[tuple]], inputs: list, outputs: list, triggers: list
) -> list:
    """Run's click (/generate) and the prompt's Enter: each checks the form, then runs `steps`; returns the runs."""
    handler = stoppable(steps, signature([PROMPT], RUN_FIELDS), "generate", run_steps.__doc__)
    check = check_values(["prompt", *names()], partial(check_run, server=server))
    # preprocess=False: the handler checks the raw values itself, so every refusal names its setting (Gradio's own
    # range check says only "Value -1.0 is less than minimum value 0."). The check comes first, in an event with no
    # outputs, so a refusal is a message and the last run's tokens and charts stay; /generate checks again.
    events = []
    for trigger in triggers:
        checked = trigger(check, inputs=inputs, outputs=None, preprocess=False, api_visibility="private")
        events.append(
            checked.success(
                handler,
                inputs=inputs,
                outputs=outputs,
                concurrency_limit=server.run_concurrency,
                concurrency_id="generate",  # Run, Enter and the batch share the run slots
                preprocess=False,
                api_name="generate" if trigger == triggers[0] else False,
            )
        )
    return events


def wire_lessons(
    server: Server,
    steps: Callable[..., Iterator[tuple]],
    inputs: list,
    outputs: list,
    lessons: LessonRow,
    candidates_box: gr.Accordion,
) -> list:
    """The lessons of this tab: each sets the form and runs `steps` with its settings (a candidates lesson opens the
    candidates' tree); returns the runs."""
    wired = lessons.wire(
        "one",
        inputs,
        lambda lesson: [lesson.prompt, *lesson.values(RUN_FIELDS)],
        steps,
        outputs,
        concurrency_limit=server.run_concurrency,
        concurrency_id="generate",
    )
    for lesson, loaded, _ in wired:
        if lesson.settings.get("num_candidates", 1) > 1:  # the lesson is in the candidates' tree
            loaded.then(lambda: gr.Accordion(open=True), outputs=candidates_box, queue=False, api_visibility="private")
    return [ran for _, _, ran in wired]


def check_run(values: dict, server: Server | None = None) -> None:
    """What the page checks before a run: the prompt and every setting, read as /generate reads them, and on ZeroGPU
    that the pair was loaded at startup (before the visitor's GPU time is spent on a refusal)."""
    request = parse_request(values.pop("prompt"), values)
    if server is not None:
        server.check_runnable(request.pair, request.dtype)


def run_steps(server: Server, *values: object, run_id: str) -> Iterator[tuple]:
    """The steps of /generate: speculative decoding of `prompt` with the draft/target `pair` and W = `num_candidates`
    drafts per round, in the number format `dtype` (auto, float32, bfloat16 or float16), streamed; then, with
    `compare`, the target (and draft model) alone. Each parameter but `prompt` defaults to the form's value. Runs that
    arrive together share the model's passes."""
    named, progress = read_values(["prompt", *names()], values)
    with stop_signal(run_id) as stop:
        try:
            run = server.prepare([named.pop("prompt")], named, progress, stop)
        except ValueError as error:
            raise user_error(str(error)) from error
        yield from failures_said(stream_run(server, run), run.request.pair.label)


def failures_said(updates: Iterator[tuple], pair: str) -> Iterator[tuple]:
    """A run's updates; a failure ends the run with its sentence on the page (an overflow names the `pair`), and the
    app and its models stay."""
    try:
        yield from updates
    except Exception as error:  # the run's own sentence (out of the device's memory, say) or a model error
        sentence = failure_sentence(error, "The run", pair)
        yield gr.skip(), html.escape(f"**{sentence}**", quote=False), *unchanged_charts()
        raise user_error(sentence, log=True) from error


def unchanged_charts() -> tuple:
    """The four charts, the trace, the candidates and the headline left as they are (fresh objects: Gradio may consume
    an update)."""
    return tuple(gr.skip() for _ in range(7))


def stream_run(server: Server, run: Run) -> Iterator[tuple]:
    """Yield (tokens, summary, four charts, trace, candidates, headline) as rounds arrive, then while the comparisons
    run; the last update carries every output, and its summary says why the run ended when it ended early."""
    request = run.request
    # At once: the page holds the run from here on, and the last run's three numbers go (its tokens went)
    yield "", in_progress("", "Decoding"), *unchanged_charts()[:-1], ""
    rounds, tokens_html, summary, out_of_time = yield from stream_speculative(run)
    alone: dict[str, list[Round]] = {}
    if request.compare and not out_of_time and not run.stop.is_set():
        alone, out_of_time = yield from stream_comparisons(run, rounds, tokens_html, summary)
    if run.stop.is_set():
        return
    baseline = alone.get("target alone", [])
    summary, headline = final_summary(run, rounds, baseline, alone.get("draft alone", []), out_of_time)
    if out_of_time:
        note = (
            f"Stopped after {run.budget_seconds:g} s, the time budget of one run: lower max new tokens, "
            "turn off the comparison, or pick a faster pair."
        )
        gr.Warning(note)
        summary = f"**{note}**\n\n{summary}"
    tokens_html += alone_blocks(run, alone, running=None)
    record = trace_record(request, run.target, run.prompts[0], rounds, baseline)
    trace = server.downloads.write_json("specdemo-trace", record)
    num_draft_tokens = request.speculative.num_draft_tokens
    yield (
        tokens_html,
        summary,
        *run_charts(rounds, num_draft_tokens, baseline),
        gr.update(value=trace, visible=True),
        gr.skip(),
        headline,
    )


def final_summary(
    run: Run, rounds: list[Round], baseline: list[Round], draft_alone: list[Round], out_of_time: bool
) -> tuple[str, str]:
    """The summary once the run and its comparisons are done (the speedup explained, and what sharing changed), and
    the headline's three numbers."""
    request = run.request
    num_draft_tokens = request.speculative.num_draft_tokens
    shared = sharing_note(rounds, baseline) if baseline else None
    comparison = compare_runs(rounds, baseline, num_draft_tokens) if baseline and not shared else None
    sampling = request.sampling
    greedy, coupled = sampling.is_greedy, sampling.is_coupled  # either way, the target alone's very text
    differ = (greedy or coupled) and comparison is not None and not comparison.identical  # then say where
    stats = run_stats(rounds)
    summary = summary_markdown(
        stats,
        num_draft_tokens,
        baseline=run_stats(baseline) if baseline else None,
        comparison=comparison,
        draft_alone=run_stats(draft_alone) if draft_alone else None,
        greedy=greedy,
        number_format=request.dtype_reason,
        divergence=divergence(run, rounds, baseline) if differ else None,
        coupled_seed=sampling.seed if coupled else None,
        chances=coupled_chances(rounds),
    )
    for note in (shared, cut_note(rounds, greedy, coupled)):
        if note:
            summary += f"\n\n{note}"
    why = "not measured: " + (
        "passes were shared" if shared else "the run hit its time budget" if out_of_time else "the comparison was off"
    )
    return summary, headline_html(stats, comparison, "" if comparison else why)


def stream_speculative(run: Run) -> Generator[tuple, None, tuple[list[Round], str, str, bool]]:
    """The speculative run, streamed: tokens every batch, charts and candidates at most twice a second, until done or
    the deadline. Returns its rounds, token HTML, summary, and whether the deadline ended it."""
    sampling, speculative = run.request.sampling, run.request.speculative
    decode = decode_fn(run.target)
    rounds: list[Round] = []
    emitted: list[int] = []
    tokens_html, summary, last_chart = "", "", 0.0
    stream = run.submit(run.target, [DecodeRequest(run.prompts[0], sampling, speculative)])
    for batch in stream.rounds(TOKENS_INTERVAL_SECONDS):
        rounds.extend(batch)
        tokens_html += "".join(html_spans(round_spans(round_, decode, emitted), clickable=True) for round_ in batch)
        stats = run_stats(rounds)  # once per update: the summary and the headline read it
        summary = summary_markdown(
            stats,
            speculative.num_draft_tokens,
            number_format=run.request.dtype_reason,
            chances=coupled_chances(rounds),
        )
        streamed = in_progress(summary, f"Decoding: {len(emitted)} tokens so far")
        if time.monotonic() - last_chart >= CHART_INTERVAL_SECONDS * max(1, stream.scheduler.num_rows):
            last_chart = time.monotonic()
            candidates = candidates_html(rounds, decode)
            headline = headline_html(stats, None)
            yield (
                tokens_html,
                streamed,
                *run_charts(rounds, speculative.num_draft_tokens),
                gr.skip(),
                candidates,
                headline,
            )
        else:
            yield tokens_html, streamed, *unchanged_charts()
    candidates = candidates_html(rounds, decode)  # every round's, the last included
    final = in_progress(summary, f"Decoded {len(emitted)} tokens")
    headline = headline_html(run_stats(rounds), None) if rounds else ""
    yield tokens_html, final, *run_charts(rounds, speculative.num_draft_tokens), gr.skip(), candidates, headline
    return rounds, tokens_html, summary, stream.out_of_time


def stream_comparisons(
    run: Run, speculative_rounds: list[Round], tokens_html: str, summary: str
) -> Generator[tuple, None, tuple[dict[str, list[Round]], bool]]:
    """Decode with the target alone, then the draft model alone, as rows that draft nothing in the same schedulers
    as other runs, streamed as the speculative run was: the text under its tokens at the same pace, and the two charts
    it changes redrawn twice as often as that run's four (see CHART_INTERVAL_SECONDS), so the speedup compares runs
    that loaded the page alike. None starts after the deadline and a running one stops at it. Returns their rounds by
    label (none when the deadline came first) and whether it did."""
    collected: dict[str, list[Round]] = {}
    for label, model, sampling in comparison_runs(run):
        rounds = collected.setdefault(label, [])
        speculative = SpeculativeConfig(max_new_tokens=run.request.speculative.max_new_tokens)
        stream = run.submit(model, [DecodeRequest(run.prompts[0], sampling, speculative, drafting=False)])
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
                yield page, streamed, gr.skip(), live[0], gr.skip(), live[1], gr.skip(), gr.skip(), gr.skip()
            else:
                yield page, streamed, *unchanged_charts()
        if stream.out_of_time:  # an unfinished comparison would compare unlike things
            return {}, True
    return collected, False


def comparison_runs(run: Run) -> list[tuple[str, object, object]]:
    """What to decode alone after the speculative run: the target, and the draft model when there is one (label,
    model, its sampling settings)."""
    runs = [("target alone", run.target, run.request.sampling)]
    if run.draft is not None and run.draft is not run.target:
        runs.append(("draft alone", run.draft, run.request.speculative.draft_sampling(run.request.sampling)))
    return runs


def alone_blocks(run: Run, alone: dict[str, list[Round]], running: str | None) -> str:
    """The comparison runs' texts, in the order they ran; `running` names the one still decoding."""
    decode = decode_fn(run.target)  # a draft model shares the tokenizer
    return "".join(
        alone_html(label, decode(ids := emitted_ids(rounds)), len(ids), running=label == running)
        for label, rounds in alone.items()
        if rounds
    )
