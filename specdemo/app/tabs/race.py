"""The Race tab and /race: one prompt decoded at once by the target alone and by several drafters, each lane a row of
one batch, streamed side by side with a finish chart; then a line per lane, whether the texts agree, and how each
lane's time alone is estimated."""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterator, Sequence
from contextlib import closing, contextmanager
from functools import partial

import gradio as gr

from specdemo.app.form import CUSTOM, RUN_FIELDS, names, parse_request, signature
from specdemo.app.panels.lessons import LessonRow
from specdemo.app.serving.handlers import stop_signal, stoppable
from specdemo.app.serving.messages import failure_sentence, user_error
from specdemo.app.serving.runs import (
    CHART_INTERVAL_SECONDS,
    Run,
    Server,
    decode_fn,
    in_progress,
    read_values,
    stopped_summary,
)
from specdemo.app.serving.share import RACE_TAB, link_js
from specdemo.app.serving.startup import DRAFTER_MISMATCH
from specdemo.app.serving.zerogpu import MIN_SECONDS, gpu_function, run_seconds
from specdemo.app.views.plots import race_figure, waiting
from specdemo.app.views.render import THEME_CSS, race_html
from specdemo.core.race import TARGET_LANE, LaneFigures, agreement, lane_record, speedup
from specdemo.drafters.registry import DRAFTER_KINDS, drafter_options
from specdemo.engine.race import MAX_LANES, LaneRun, check_lanes, lane_choices, race, race_costs
from specdemo.engine.resources import openmp_workers_released
from specdemo.models.graphs import DeviceLock
from specdemo.pairs import DEFAULT_PAIR, PAIRS, Pair, find_pair

PROMPT = inspect.Parameter("prompt", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=str)
LEADING = ["prompt", "lanes"]  # the handler's values before the settings
ESTIMATE_NOTE = (
    "Each lane's seconds are estimated as it would run alone: its target passes, each priced at this device's measured "
    "cost of a pass of its width (the tokens it read), plus its own drafting time. The lanes shared the passes, so "
    "the race's wall clock ({wall:.2f} s) is the batch's, not any lane's."
)


def build_tab(
    server: Server, settings: dict[str, gr.components.Component], lessons: LessonRow
) -> tuple[gr.Textbox, gr.CheckboxGroup]:
    """The tab's prompt, lanes, buttons, lanes' view, summary and finish chart, and its events (/race, its lessons and
    its Copy link); returns the prompt and the lanes' control, for a shared link."""
    prompt = gr.Textbox(lines=4, label="Prompt", elem_id="race-prompt", placeholder="One prompt, raced by every lane")
    offered = offered_lanes(server, DEFAULT_PAIR)
    lanes = gr.CheckboxGroup(
        offered,
        value=offered[: MAX_LANES - 1],
        label=f"Lanes: up to {MAX_LANES - 1} drafters (the target alone always races: every speedup is against it)",
        elem_id="race-lane-choice",
    )
    with gr.Row():
        run = gr.Button("Run the race", variant="primary", elem_id="race-run")
        stop = gr.Button("Stop", variant="stop", elem_id="race-stop")
        copy_link = gr.Button("Copy link", elem_id="race-copy-link", scale=0, min_width=120)
    link = gr.Textbox(label="A link that re-runs this race", elem_id="race-share-link", visible=False)
    view = gr.HTML("", css_template=THEME_CSS, elem_id="race-lanes")
    summary = gr.Markdown(elem_id="race-summary")
    chart = gr.Plot(waiting(race_figure({})), elem_id="race-chart", show_label=False)
    results = gr.JSON(visible=False)
    inputs, outputs = [prompt, lanes, *settings.values()], [view, summary, chart, results]
    steps = gpu_function(partial(race_steps, server), race_seconds, "The race", "lower max new tokens or drop lanes")
    chosen = inspect.Parameter("lanes", PROMPT.kind, default=offered[: MAX_LANES - 1], annotation=str | list[str])
    handler = stoppable(steps, signature([PROMPT, chosen], RUN_FIELDS, compare=False), "race", race_steps.__doc__)
    queueing = {"concurrency_limit": server.run_concurrency, "concurrency_id": "generate"}
    ran = run.click(handler, inputs=inputs, outputs=outputs, preprocess=False, api_name="race", **queueing)
    lesson_lanes = lambda lesson: [name for name in lesson.lanes if name in offered]  # noqa: E731
    values = lambda lesson: [lesson.prompt, lesson_lanes(lesson), *lesson.values(RUN_FIELDS)]  # noqa: E731
    wired = lessons.wire("race", inputs, values, steps, outputs, **queueing)
    settings["pair"].change(
        partial(lanes_for_pair, server),
        inputs=[settings["pair"], lanes],
        outputs=lanes,
        queue=False,
        api_visibility="private",
    )
    copy_link.click(None, inputs=inputs, outputs=link, js=link_js(LEADING, tab=RACE_TAB), api_visibility="private")
    copy_link.click(lambda: gr.update(visible=True), outputs=link, queue=False, api_visibility="private")
    stop.click(None, cancels=[ran, *(event for _, _, event in wired)], api_visibility="private").then(
        stopped_summary, inputs=summary, outputs=summary, queue=False, api_visibility="private"
    )
    return prompt, lanes


def unbuilt(server: Server, pair: Pair) -> dict[str, str]:
    """By kind, the sentence of each of the target's own pairs whose drafter the startup checks could not build for it
    (on a Space, a head trained on other weights); a pair left out for another reason (not loaded at startup on
    ZeroGPU) leaves its kind to race, since the lanes use the target alone."""
    return {
        other.drafter: server.left_out[other.key].sentence
        for other in PAIRS
        if other.target == pair.target and other.key in server.left_out
        if server.left_out[other.key].why == DRAFTER_MISMATCH
    }


def offered_lanes(server: Server, pair: Pair) -> list[str]:
    """The drafter lanes the pair's target races here: lane_choices, less the kinds `unbuilt` names."""
    return [name for name in lane_choices(pair)[1:] if name not in unbuilt(server, pair)]


def check_offered(server: Server, pair: Pair, lanes: list[str]) -> list[str]:
    """`lanes`, or a ValueError in the startup checks' sentence for a lane's kind that cannot be built here."""
    for name in lanes[1:]:
        if name in (refused := unbuilt(server, pair)):
            raise ValueError(f"The lane '{name}' cannot race here: {refused[name]}")
    return lanes


def lanes_for_pair(server: Server, pair_key: str, chosen: list[str] | None) -> dict:
    """The lanes a pair's target races here, the chosen ones it can still race kept; a custom pair's are checked when
    it runs."""
    if pair_key == CUSTOM:
        return gr.skip()
    choices = offered_lanes(server, find_pair(pair_key))
    return gr.update(choices=choices, value=[name for name in chosen or [] if name in choices])


def race_seconds(*values: object, **_: object) -> int:
    """What a race's ZeroGPU call asks for: every lane's tokens as if each decoded alone (the lanes share passes, so
    this covers the wider passes), or the least when the values do not parse, since the call refuses them."""
    named, _ = read_values([*LEADING, *names()], values)
    try:
        request = parse_request(named.pop("prompt"), named)
        lanes = check_lanes(named.pop("lanes"), request.pair)
    except (ValueError, TypeError, AttributeError):
        return MIN_SECONDS
    return run_seconds(request.speculative.max_new_tokens, len(lanes))


def race_steps(server: Server, *values: object, run_id: str) -> Iterator[tuple]:
    """`prompt` decoded at once by the target alone and by each of `lanes` (drafter kinds, or "draft" for the pair's
    draft model; a list or comma-separated), as rows of one batch under one seed; the other parameters as for
    /generate (`compare` is ignored). Returns one result per lane and whether their texts agree."""
    named, progress = read_values([*LEADING, *names()], values)
    with stop_signal(run_id) as stop:
        try:
            prompt, chosen = named.pop("prompt"), named.pop("lanes")
            request = parse_request(prompt, named)
            if not isinstance(chosen, str | list | tuple):
                raise ValueError("The lanes must be a list of names or one comma-separated text.")
            lanes = check_offered(server, request.pair, check_lanes(chosen, request.pair))  # before any model loads
            call = run_seconds(request.speculative.max_new_tokens, len(lanes))  # as race_seconds asked
            run = server.prepare([prompt], named | {"compare": False}, progress, stop, call)
        except ValueError as error:
            raise user_error(str(error)) from error
        try:
            yield from stream_race(run, lanes)
        except Exception as error:  # the shared target pass failed (out of memory, say): a lane's own is its sentence
            raise user_error(failure_sentence(error, "The race"), log=True) from error


@contextmanager
def round_held(lock: DeviceLock) -> Iterator[None]:
    """One round of the race as the schedulers take theirs: under the models' lock, the OpenMP workers released
    after, so other users' runs go on between two passes."""
    with lock, openmp_workers_released():
        yield


def stream_race(run: Run, lanes: list[str]) -> Iterator[tuple]:
    """Yield (lanes' view, summary, finish chart, results) as the race goes, at most every CHART_INTERVAL_SECONDS;
    the last update has one result per lane."""
    request, held = run.request, partial(round_held, run.schedulers.models_lock)
    with held():
        costs = race_costs(run.target, run.prompts[0], request.speculative, request.sampling)
    options = {name: drafter_options(name, request.values) for name in lanes if name in DRAFTER_KINDS}
    history: dict[str, list[LaneFigures]] = {name: [] for name in lanes}
    runs = [LaneRun(name) for name in lanes]
    figures = [lane.figures(costs) for lane in runs]
    yield race_view(run, runs, figures), in_progress("", "Racing"), gr.skip(), gr.skip()
    started = shown = time.monotonic()
    out_of_time = False
    stream = race(run.target, run.draft, lanes, run.prompts[0], request.sampling, request.speculative, options, held)
    with closing(stream):
        for runs in stream:
            figures = [lane.figures(costs) for lane in runs]  # once a round: the chart's points and the lanes' view
            for lane in figures:
                if not history[lane.name] or history[lane.name][-1].passes != lane.passes:
                    history[lane.name].append(lane)
            if run.stop.is_set():
                return
            if out_of_time := time.monotonic() > run.deadline:
                break
            if time.monotonic() - shown >= CHART_INTERVAL_SECONDS:
                shown = time.monotonic()
                note = f"Racing: {max(len(lane.rounds) for lane in runs)} target passes so far"
                yield race_view(run, runs, figures), in_progress("", note), race_figure(history), gr.skip()
    agreed = agreement(figures, request.sampling.is_greedy or request.sampling.is_coupled)
    summary = race_summary(figures, agreed, time.monotonic() - started)
    if out_of_time:
        summary = f"**Stopped after {run.budget_seconds:g} s, the time budget of one run.**\n\n{summary}"
    yield race_view(run, runs, figures), summary, race_figure(history), race_results(run, figures, agreed)


def race_view(run: Run, runs: Sequence[LaneRun], figures: Sequence[LaneFigures]) -> str:
    rounds, done = [lane.rounds for lane in runs], [lane.done for lane in runs]
    return race_html(figures, rounds, done, decode_fn(run.target), run.request.speculative.max_new_tokens)


def race_summary(figures: Sequence[LaneFigures], agreed: str, wall_seconds: float) -> str:
    """A line per lane (tokens, target passes, tokens per pass, estimated seconds alone, speedup against the target
    lane, drafting seconds, and the sentence that stopped a failed lane), whether the texts agree, and how the time is
    estimated."""
    target = next(lane for lane in figures if lane.name == TARGET_LANE)
    failed = any(lane.error for lane in figures)  # a column for the sentences that stopped lanes, when one did
    lines = [
        "| lane | tokens | target passes | tokens/pass | est. s alone | speedup | drafting s |"
        + (" stopped by |" * failed),
        "|---|---|---|---|---|---|---|" + ("---|" * failed),
    ]
    for lane in figures:
        faster = speedup(lane, target)
        lines.append(
            f"| {lane.name} | {len(lane.token_ids)} | {lane.passes} | {lane.tokens_per_pass:.2f} | "
            f"{lane.estimated_seconds:.2f} | {'—' if faster is None else f'{faster:.2f}×'} | "
            f"{lane.drafting_seconds:.3f} |" + (f" {(lane.error or '').replace('|', '/')} |" * failed)
        )
    return "\n".join([*lines, "", f"**{agreed}**", "", ESTIMATE_NOTE.format(wall=wall_seconds)])


def race_results(run: Run, figures: Sequence[LaneFigures], agreed: str) -> dict:
    """/race's result: each lane's tokens, text and figures, and the sentence on whether the texts agree."""
    target = next(lane for lane in figures if lane.name == TARGET_LANE)
    decode = partial(run.target.tokenizer.decode, skip_special_tokens=True)
    return {"lanes": [lane_record(lane, target, decode(lane.token_ids)) for lane in figures], "agreement": agreed}
