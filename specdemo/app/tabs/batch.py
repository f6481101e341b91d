"""The Batch tab and /generate_batch: up to 8 prompts decoded as rows of one batch, one lane each, beside the measured
sweep of batch sizes."""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterator
from dataclasses import replace
from functools import partial

import gradio as gr

from specdemo.app.form import RUN_FIELDS, names, parse_request, signature
from specdemo.app.serving.handlers import stop_signal, stoppable
from specdemo.app.serving.messages import failure_sentence, user_error
from specdemo.app.serving.runs import (
    CHART_INTERVAL_SECONDS,
    Run,
    Server,
    decode_fn,
    in_progress,
    read_values,
    requested_seconds,
    stopped_summary,
    sweep_caption,
)
from specdemo.app.serving.zerogpu import gpu_function
from specdemo.app.views.plots import batch_sweep_figure, candidates_sweep_figure
from specdemo.app.views.render import THEME_CSS, lanes_html
from specdemo.config import check_prompt, check_row_seeds
from specdemo.core.rounds import Round
from specdemo.core.stats import emitted_ids, run_stats
from specdemo.engine.scheduler import MAX_BATCH_ROWS, DecodeRequest

BATCH_EXAMPLE = "\n".join(
    [
        "Correct the spelling: The quartely planing meeting is moved to Thursday.",
        "Turn into a Markdown table: name,age / Ann,31 / Bo,27 / Cy,45",
        "Write a haiku about autumn rain.",
        "Summarise in one sentence: The train leaves at 9:40 from platform 3 and arrives in Lyon at 13:05.",
    ]
)
PROMPTS = inspect.Parameter("prompts", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=str | list[str])


def build_tab(server: Server, settings: dict[str, gr.components.Component]) -> None:
    """The tab's prompts box, buttons, lanes, summary and sweep charts, and its events (/generate_batch)."""
    prompts = gr.Textbox(
        lines=6,
        label=f"Prompts, one per line (up to {MAX_BATCH_ROWS}); prompt i uses seed + i",
        elem_id="batch-prompts",
    )
    with gr.Row():
        run = gr.Button("Run the batch", variant="primary", elem_id="batch-run")
        stop = gr.Button("Stop", variant="stop", elem_id="batch-stop")
        gr.Button("Example set", elem_id="batch-example").click(
            lambda: BATCH_EXAMPLE, outputs=prompts, queue=False, api_visibility="private"
        )
    lanes = gr.HTML("", css_template=THEME_CSS, elem_id="batch-lanes")
    summary = gr.Markdown(elem_id="batch-summary")
    results = gr.JSON(visible=False)
    with gr.Row():
        sweep = server.sweep
        chart = gr.Plot(batch_sweep_figure(sweep) if sweep else None, elem_id="batch-chart", show_label=False)
        if sweep is not None:
            gr.Plot(candidates_sweep_figure(sweep), show_label=False)
    gr.Markdown(sweep_caption(sweep))
    handler = stoppable(
        gpu_function(
            partial(batch_steps, server),
            partial(requested_seconds, "prompts"),
            "The batch",
            "lower max new tokens or the number of prompts",
        ),
        signature([PROMPTS], RUN_FIELDS, compare=False),  # compare is ignored; its default stays as it was
        "generate_batch",
        batch_steps.__doc__,
    )
    event = run.click(
        handler,
        inputs=[prompts, *settings.values()],
        outputs=[lanes, summary, chart, results],
        concurrency_limit=server.run_concurrency,
        concurrency_id="generate",
        preprocess=False,
        api_name="generate_batch",
    )
    stop.click(None, cancels=[event], api_visibility="private").then(
        stopped_summary, inputs=summary, outputs=summary, queue=False, api_visibility="private"
    )


def batch_steps(server: Server, *values: object, run_id: str) -> Iterator[tuple]:
    """Up to 8 `prompts` (a list, or one per line) decoded as rows of one batch, prompt i with seed + i; the other
    parameters as for /generate (`compare` is ignored). Returns one result per prompt."""
    named, progress = read_values(["prompts", *names()], values)
    with stop_signal(run_id) as stop:
        try:
            texts = batch_prompts(named.pop("prompts"))
            request = parse_request(texts[0], named)  # every setting checked before any model loads
            check_row_seeds(request.sampling.seed, len(texts), f"the batch's {len(texts)} prompts")
            run = server.prepare(texts, named | {"compare": False}, progress, stop)
        except ValueError as error:
            raise user_error(str(error)) from error
        try:
            yield from stream_batch(run, texts, server.sweep)
        except Exception as error:  # a row's own sentence (out of the device's memory, say) or a model error
            raise user_error(failure_sentence(error, "The batch"), log=True) from error


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


def stream_batch(run: Run, texts: list[str], sweep: dict | None) -> Iterator[tuple]:
    """Yield (lanes, summary, chart, results) as the batch's rows decode, prompt i with seed + i; the last update
    has one result per prompt."""
    request, decode = run.request, decode_fn(run.target)
    rows = [
        DecodeRequest(ids, replace(request.sampling, seed=request.sampling.seed + i), request.speculative)
        for i, ids in enumerate(run.prompts)
    ]
    lanes: list[list[Round]] = [[] for _ in texts]
    yield lanes_html(texts, lanes, decode), in_progress("", "Decoding the batch"), gr.skip(), gr.skip()
    started = time.perf_counter()
    stream = run.submit(run.target, rows)
    for batch in stream.batches(CHART_INTERVAL_SECONDS):
        for index, round_ in batch:
            lanes[index].append(round_)
        note = f"Decoding: {sum(len(emitted_ids(lane)) for lane in lanes)} tokens so far"
        yield lanes_html(texts, lanes, decode), in_progress("", note), gr.skip(), gr.skip()
    if run.stop.is_set():
        return
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
        summary = f"**Stopped after {run.budget_seconds:g} s, the time budget of one run.**\n\n{summary}"
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
    cut_note = (
        f"; {cut} lane rounds drafted less than they could, because every row of a pass is padded to the widest "
        "(hover a token for its round's cut)."
        if cut
        else "."
    )
    lines += [
        "",
        f"**The batch: {total_tokens} tokens in {seconds:.2f} s, {total_tokens / seconds:.1f} tokens/s in all**; the "
        f"widest pass held {widest} rows (this batch's and other runs' rows share the model's passes){cut_note}",
        "",
        f"The batch took as many rounds as its longest lane, lane {longest + 1}: {len(lanes[longest])} target passes "
        f"for {len(emitted_ids(lanes[longest]))} tokens. Drafting shortens a batch only as far as it shortens that "
        "lane; drafts in the other lanes make the shared passes wider.",
        "",
        f"Number format: {number_format}.",
    ]
    return "\n".join(lines)
