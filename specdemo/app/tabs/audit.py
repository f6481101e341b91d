"""The Audit tab and /audit: "is it lossless?", checked live on toy distributions and on the real model, beside a
planted bug that must fail the same check; under the coupled rule, also "is each seed's text the target alone's?".
Its settings are a table too, sharing the run table's sampling rows."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from functools import partial

import gradio as gr
import torch

from specdemo.app.form import RUN_FIELDS, Field, by_name, signature, whole
from specdemo.app.panels.lessons import LessonRow
from specdemo.app.serving.handlers import stop_signal, stoppable, wait_until
from specdemo.app.serving.messages import failure_sentence, user_error
from specdemo.app.serving.runs import Server, check_values, decode_fn, read_values
from specdemo.app.serving.zerogpu import (
    MIN_SECONDS,
    ON_ZEROGPU,
    budget_seconds,
    decoding_seconds,
    gpu_function,
    ready_pair,
)
from specdemo.app.views.plots import model_audit_figure, toy_audit_figure, toy_tv_figure
from specdemo.audit import MODEL_BATCH_ROWS, RULE_BUGS, TOY_PRESETS, model_audit, parse_weights, toy_audit
from specdemo.config import (
    MAX_NUM_CANDIDATES,
    RULE_LABELS,
    SamplingConfig,
    SpeculativeConfig,
    check_prompt,
    run_settings,
)
from specdemo.engine.resources import openmp_workers_released
from specdemo.models.loading import LoadedModel, prompt_token_ids
from specdemo.pairs import DEFAULT_PAIR, PAIRS, Pair, find_pair, make_drafter

MODES = ("toy", "model")
TOY_SAMPLES = (1_000, 1_000_000)  # N, the range offered
MODEL_SAMPLES = (100, 5_000)  # M per side
DEFAULT_SAMPLES = {"toy": 200_000, "model": 1_000}
MAX_TOY_DRAFT_TOKENS = 8
MAX_AUDIT_TOKENS = 3
SEQUENCES_SHOWN = 15  # the most frequent first-token sequences in the model-mode chart
PROGRESS_INTERVAL_SECONDS = 0.5
LOWER_AUDIT = "lower the samples or the first tokens per sample"  # what a model audit can ask for less of
DEFAULT_PROMPT = "Write one sentence about the sea."
INTRO = (
    "Speculative decoding claims its output follows exactly the target's distribution. Check it: **toy** mode runs "
    "the project's own sampler on distributions you choose and tests the tokens it emits against p; **model** mode "
    "draws a prompt's first tokens many times with speculative decoding and with the target alone, and compares "
    "them. A **planted bug** runs the same audit with a broken sampler, which should fail. The hot self-draft pair "
    "(SmolLM2 drafting for itself at temperature 1.5) makes the bugs visible in model mode; prompt lookup drafts "
    "one-hot, so a wrong q changes nothing there. Under the rule **same text for any drafter**, the audit also checks "
    "that each seed's speculative text is the target alone's text for that seed, and its planted bugs misuse the "
    "noise: some break the distribution, some only the sameness of the text."
)


def preset_weights(name: str) -> tuple[str, str]:
    target, draft = TOY_PRESETS[name]
    return ", ".join(f"{w:g}" for w in target), ", ".join(f"{w:g}" for w in draft)


def in_range(name: str, low: int, high: int):
    def read(value: object) -> int:
        count = whole(name)(value)
        if not low <= count <= high:
            raise ValueError(f"{name} must be between {low} and {high}, got {count}.")
        return count

    return read


def _mode(value: object) -> str:
    if value not in MODES:
        raise ValueError(f"Unknown audit mode {value!r}: pick 'toy' or 'model'.")
    return str(value)


def _bug(value: object) -> str:
    if not any(value in bugs for bugs in RULE_BUGS.values()):
        named = ", ".join(f"{rule} rule: {', '.join(bugs)}" for rule, bugs in RULE_BUGS.items())
        raise ValueError(f"Unknown bug {value!r}: pick one of those planted in its rule ({named}).")
    return str(value)


def _rule(value: object) -> str:
    rule = str(value)
    run_settings(SamplingConfig)["rule"][1].check(rule)  # the config's sentence, as the run's form gives it
    return rule


def bug_choices(rule: str) -> list[tuple[str, str]]:
    """The planted-bug dropdown's (label, name) choices for `rule`."""
    return [
        (f"{name}: {what}" if name != "none" else f"none (the project's {rule} rule)", name)
        for name, what in RULE_BUGS[rule].items()
    ]


AUDIT_FIELDS: list[Field] = [  # the /audit API's order
    Field("mode", "radio", "toy", "Audit", choices=list(MODES), elem_id="audit-mode", read=_mode),
    Field(
        "bug",
        "dropdown",
        "none",
        "Planted bug",
        choices=bug_choices("standard"),
        elem_id="audit-bug",
        read=_bug,
    ),
    Field(
        "num_samples",
        "number",
        DEFAULT_SAMPLES["toy"],
        "Samples: N, or M a side in model mode",
        elem_id="audit-samples",
    ),
    replace(by_name(RUN_FIELDS, "seed"), elem_id="audit-seed", section="audit"),
    Field(
        "preset", "dropdown", "overlapping", "Preset", choices=list(TOY_PRESETS), elem_id="audit-preset", section="toy"
    ),
    Field(
        "target_weights",
        "textbox",
        preset_weights("overlapping")[0],
        "Target p: a weight per token",
        elem_id="audit-target",
        section="toy",
    ),
    Field(
        "draft_weights",
        "textbox",
        preset_weights("overlapping")[1],
        "Draft q: a weight per token",
        elem_id="audit-draft",
        section="toy",
    ),
    replace(
        by_name(RUN_FIELDS, "num_draft_tokens"),
        default=4,
        high=MAX_TOY_DRAFT_TOKENS,
        label="Draft tokens per round (K)",
        elem_id=None,
        read=in_range("draft tokens per round (K)", 1, MAX_TOY_DRAFT_TOKENS),
    ),
    replace(
        by_name(RUN_FIELDS, "num_candidates"),
        label="Candidates per round (W)",
        elem_id=None,
        read=in_range("candidates per round (W)", 1, MAX_NUM_CANDIDATES),
    ),
    Field("prompt", "textbox", DEFAULT_PROMPT, "Prompt", elem_id="audit-prompt", section="model"),
    Field(
        "pair",
        "dropdown",
        DEFAULT_PAIR.key,
        "Pair",
        choices=[(p.label, p.key) for p in PAIRS],
        elem_id="audit-pair",
        section="model",
    ),
    replace(
        by_name(RUN_FIELDS, "temperature"),
        default=1.0,
        label="Temperature",
        elem_id="audit-temperature",
        section="model",
    ),
    replace(by_name(RUN_FIELDS, "top_k"), section="model"),
    replace(by_name(RUN_FIELDS, "top_p"), section="model"),
    replace(by_name(RUN_FIELDS, "repetition_penalty"), section="model"),
    Field(
        "num_tokens",
        "slider",
        2,
        "First tokens per sample",
        1,
        MAX_AUDIT_TOKENS,
        1,
        section="model",
        read=in_range("tokens per sample", 1, MAX_AUDIT_TOKENS),
    ),
    replace(by_name(RUN_FIELDS, "rule"), elem_id="audit-rule", section="audit", read=_rule),
]
NAMES = [spec.name for spec in AUDIT_FIELDS]


@dataclass(frozen=True)
class AuditRequest:
    """An audit's settings, checked."""

    mode: str
    bug: str
    num_samples: int
    seed: int
    num_draft_tokens: int  # K
    num_candidates: int  # W
    rule: str = "standard"  # SamplingConfig.rule: the rule audited, and whose bugs `bug` names
    target: torch.Tensor | None = None  # toy: p and q, normalised
    draft: torch.Tensor | None = None
    sampling: SamplingConfig | None = None  # model mode
    num_tokens: int = 0
    prompt: str = ""
    pair: Pair | None = None


def parse_audit(values: dict) -> AuditRequest:
    """The form's values (by name; missing ones at their defaults) as a checked request; a ValueError names the
    first bad one."""
    read = {spec.name: spec.read(values.get(spec.name, spec.default)) for spec in AUDIT_FIELDS if spec.section != "toy"}
    mode = read["mode"]
    low, high = TOY_SAMPLES if mode == "toy" else MODEL_SAMPLES
    samples = whole("the number of samples")(read["num_samples"])
    if not low <= samples <= high:
        raise ValueError(f"The number of samples must be between {low:,} and {high:,} in {mode} mode, got {samples:,}.")
    rule, bug = read["rule"], read["bug"]
    if bug not in RULE_BUGS[rule]:
        raise ValueError(
            f"The {RULE_LABELS[rule]} rule has no planted bug {bug!r}: pick one of {', '.join(RULE_BUGS[rule])}, or "
            "the rule it is planted in."
        )
    common = (mode, bug, samples, read["seed"], read["num_draft_tokens"], read["num_candidates"], rule)
    if mode == "toy":
        target = parse_weights(values.get("target_weights", preset_weights("overlapping")[0]), "target p")
        draft = parse_weights(values.get("draft_weights", preset_weights("overlapping")[1]), "draft q")
        if len(target) != len(draft):
            raise ValueError(
                f"The target p has {len(target)} weights and the draft q {len(draft)}: give both one weight per token."
            )
        return AuditRequest(*common, target=target, draft=draft)
    if not read["temperature"] or float(read["temperature"]) <= 0:
        raise ValueError(
            "Model mode samples, and temperature 0 is greedy decoding, which has nothing to sample: pick a "
            "temperature such as 1.0."
        )
    sampling = SamplingConfig(
        read["temperature"], read["top_k"], read["top_p"], read["repetition_penalty"], read["seed"], rule=rule
    )
    check_prompt(read["prompt"])
    pair = find_pair(read["pair"])
    return AuditRequest(*common, sampling=sampling, num_tokens=read["num_tokens"], prompt=read["prompt"], pair=pair)


def build_tab(server: Server, lessons: LessonRow) -> None:
    """The Audit tab, inside the page's tabs, with the lessons that audit; its passes take turns with the runs'
    passes."""
    gr.Markdown(INTRO)
    controls = {}
    with gr.Row():
        for name in ("mode", "rule", "bug"):
            controls[name] = by_name(AUDIT_FIELDS, name).component()
    with gr.Row():
        for name in ("num_samples", "seed", "num_draft_tokens", "num_candidates"):
            controls[name] = by_name(AUDIT_FIELDS, name).component()
    with gr.Group(visible=True) as toy_box:
        controls |= {spec.name: spec.component() for spec in AUDIT_FIELDS if spec.section == "toy"}
    with gr.Group(visible=False) as model_box:
        controls |= {spec.name: spec.component() for spec in AUDIT_FIELDS if spec.name in ("prompt", "pair")}
        with gr.Row():
            sampling = ("temperature", "top_k", "top_p", "repetition_penalty", "num_tokens")
            controls |= {name: by_name(AUDIT_FIELDS, name).component() for name in sampling}
    with gr.Row():
        run = gr.Button("Run the audit", variant="primary", elem_id="audit-run")
        stop = gr.Button("Stop", variant="stop", elem_id="audit-stop")
    verdict = gr.Markdown(elem_id="audit-verdict")
    with gr.Row():
        chart = gr.Plot(elem_id="audit-chart", show_label=False)
        tv_chart = gr.Plot(elem_id="audit-tv-chart", show_label=False)
    download = gr.DownloadButton("Download the audit (JSON)", visible=False, elem_id="audit-download")
    wire(server, controls, toy_box, model_box, [verdict, chart, tv_chart, download], run, stop, lessons)


def wire(
    server: Server,
    controls: dict,
    toy_box,
    model_box,
    outputs: list,
    run: gr.Button,
    stop: gr.Button,
    lessons: LessonRow,
) -> None:
    """The tab's events: mode, rule and preset changes, the checked audit (/audit), the lessons' audits and Stop."""
    wire_choices(controls, toy_box, model_box)
    inputs = [controls[name] for name in NAMES]
    checked = run.click(
        check_values(NAMES, parse_audit), inputs=inputs, outputs=None, preprocess=False, api_visibility="private"
    )
    model_steps = gpu_function(
        partial(model_audit_steps, server), audit_seconds, "The model audit", LOWER_AUDIT
    )  # a ZeroGPU call each
    steps = partial(audit_steps, server, model_steps)
    handler = stoppable(steps, signature([], AUDIT_FIELDS), "audit", audit_steps.__doc__)
    event = checked.success(  # /audit checks again, for API clients
        handler,
        inputs=inputs,
        outputs=outputs,
        concurrency_limit=1,
        concurrency_id="audit",
        preprocess=False,
        api_name="audit",
    )
    audits = lessons.wire(
        "audit",
        inputs,
        lambda lesson: lesson.values(AUDIT_FIELDS),
        steps,
        outputs,
        concurrency_limit=1,
        concurrency_id="audit",
    )
    events = [event, *(ran for _, _, ran in audits)]
    stop.click(None, cancels=events, api_visibility="private")


def wire_choices(controls: dict, toy_box, model_box) -> None:
    """The choices that change others: the mode shows its settings, the rule offers its bugs, a preset fills p and q."""
    controls["mode"].change(
        lambda chosen: (
            gr.update(visible=chosen == "toy"),
            gr.update(visible=chosen == "model"),
            DEFAULT_SAMPLES[chosen],
        ),
        inputs=controls["mode"],
        outputs=[toy_box, model_box, controls["num_samples"]],  # a toy N is out of range in model mode
        queue=False,
        api_visibility="private",
    )
    controls["preset"].change(
        preset_weights,
        inputs=controls["preset"],
        outputs=[controls["target_weights"], controls["draft_weights"]],
        queue=False,
        api_visibility="private",
    )
    controls["rule"].change(
        lambda rule: gr.update(choices=bug_choices(rule), value="none"),
        inputs=controls["rule"],
        outputs=controls["bug"],
        queue=False,
        api_visibility="private",
    )


def audit_steps(
    server: Server, model_steps: Callable[..., Iterator[tuple]], *values: object, run_id: str
) -> Iterator[tuple]:
    """The lossless audit. mode "toy": N = `num_samples` rounds of the sampler on the target p and draft q given as
    weights (`preset` names the defaults); mode "model": M = `num_samples` (100 to 5,000: pass it) samples of the
    first `num_tokens` tokens of `prompt`, speculative against the target alone. `rule` "coupled" (same text for any
    drafter) audits that rule, and each seed's text against the target alone's for that seed too. `bug` plants one of
    the rule's broken samplers. Returns the verdict sentence, two charts and the audit as JSON."""
    named, _ = read_values(NAMES, values)
    try:
        request = parse_audit(named)
    except ValueError as error:
        raise user_error(str(error)) from error
    if request.mode == "toy":  # arithmetic on the server's CPU, no model: never a GPU call
        with openmp_workers_released():  # a Gradio worker thread: it lives on, idle
            yield run_toy(server, request)
        return
    yield from model_steps(*values, run_id=run_id)


def model_audit_steps(server: Server, *values: object, run_id: str) -> Iterator[tuple]:
    """The model audit of the checked `values` (a ZeroGPU call on ZeroGPU)."""
    named, progress = read_values(NAMES, values)
    with stop_signal(run_id) as stop:
        yield from run_model_audit(server, parse_audit(named), progress, stop)


def audit_seconds(*values: object, **_: object) -> int:
    """What a model audit with the form's `values` asks ZeroGPU for; the least when they do not parse, since the call
    then refuses them in a sentence."""
    try:
        return model_audit_seconds(parse_audit(read_values(NAMES, values)[0]))
    except ValueError:
        return MIN_SECONDS


def model_audit_seconds(request: AuditRequest) -> int:
    """What a model audit's ZeroGPU call asks for: its samples' tokens, both sides, MODEL_BATCH_ROWS at a time."""
    sides = 3 if request.rule == "coupled" else 2  # the coupled rule's audit also decodes the target alone's texts
    return decoding_seconds(sides * request.num_samples * request.num_tokens // MODEL_BATCH_ROWS)


def run_toy(server: Server, request: AuditRequest) -> tuple:
    assert request.target is not None and request.draft is not None
    k, w = request.num_draft_tokens, request.num_candidates
    started = time.perf_counter()
    result = toy_audit(
        request.target, request.draft, k, request.num_samples, w, request.bug, request.seed, request.rule
    )
    seconds = time.perf_counter() - started
    settings = {"mode": "toy", "rule": request.rule, "bug": request.bug, "num_samples": request.num_samples}
    settings |= {"seed": request.seed, "num_draft_tokens": k, "num_candidates": w}
    record = {"settings": settings, **asdict(result), "seconds": seconds}
    verdict = f"**{result.verdict}**\n\n{_describe(request.rule, request.bug, request.seed)} "
    verdict += f"N = {request.num_samples:,}, K = {k}, W = {w}; {seconds:.1f} s."
    return (
        verdict,
        toy_audit_figure(result.counts, result.target, result.passes),
        toy_tv_figure(result.tv_curve),
        gr.update(value=server.downloads.write_json("specdemo-audit", record), visible=True),
    )


def _describe(rule: str, bug: str, seed: int) -> str:
    sampler = "The project's sampler." if bug == "none" else f"Planted bug, {bug}: {RULE_BUGS[rule][bug]}."
    return f"{sampler} Rule: {RULE_LABELS[rule]}. Seed {seed}."


def audit_models(
    server: Server, request: AuditRequest, progress: gr.Progress
) -> tuple[LoadedModel, LoadedModel | None, float]:
    """The audit's target and draft model, ready, and its budget: on ZeroGPU its call's time less the models' set-up
    (a fresh worker's first use), so that it stops before the GPU is taken back; elsewhere none."""
    assert request.pair is not None
    called = time.monotonic()
    try:
        server.check_runnable(request.pair)
        with openmp_workers_released():
            target, draft = ready_pair(request.pair, server.cache, lambda message: progress(0.0, desc=message))
    except ValueError as error:  # no network for a Hub pair, not enough memory: the sentence says which
        raise user_error(str(error)) from error
    set_up = time.monotonic() - called
    return target, draft, budget_seconds(model_audit_seconds(request), set_up) if ON_ZEROGPU else math.inf


def run_model_audit(
    server: Server, request: AuditRequest, progress: gr.Progress, stop: threading.Event
) -> Iterator[tuple]:
    """The model audit in a thread of its own, its progress shown; `stop` ends it at its next round, and so does the
    end of its budget (on ZeroGPU), with a sentence."""
    assert request.pair is not None and request.sampling is not None
    pair, count = request.pair, request.num_samples
    target, draft, budget = audit_models(server, request, progress)
    deadline = time.monotonic() + budget
    speculative = SpeculativeConfig(
        num_draft_tokens=request.num_draft_tokens,
        num_candidates=request.num_candidates,
        draft_temperature=pair.draft_temperature,
    )
    prompt_ids = prompt_token_ids(target, request.prompt)
    state: dict = {"done": 0.0}
    audit = partial(
        model_audit,
        target.model,
        make_drafter(pair, target, draft),
        target.eos_token_ids,
        prompt_ids,
        request.sampling,
        speculative,
        request.num_tokens,
        count,
        request.bug,
        on_progress=lambda done: state.update(done=done),
        should_stop=lambda: stop.is_set() or time.monotonic() >= deadline,
        lock=server.models_lock,
    )

    def work() -> None:
        try:
            state["result"] = audit()
        except Exception as error:  # reported below, in this user's page only
            state["error"] = error

    started = time.perf_counter()
    worker = threading.Thread(target=work, name="specdemo-audit", daemon=True)
    worker.start()
    while wait_until(stop, lambda: not worker.is_alive(), PROGRESS_INTERVAL_SECONDS) and worker.is_alive():
        progress(state["done"], desc="Drawing samples")
        yield f"Drawing samples: {state['done']:.0%}", gr.skip(), gr.skip(), gr.skip()
    if stop.is_set():
        return
    if "error" in state:
        error = state["error"]
        ran_out = isinstance(error, InterruptedError) and time.monotonic() >= deadline
        sentence = (
            f"The model audit stopped after {budget:.0f} s, its time on the GPU: {LOWER_AUDIT}, and run it again."
            if ran_out
            else failure_sentence(error, "The model audit")
        )
        yield sentence, gr.skip(), gr.skip(), gr.skip()
        raise user_error(sentence, log=not ran_out and not isinstance(error, ValueError)) from error
    settings = {"mode": "model", "bug": request.bug, "num_samples": count, "pair": pair.key, "prompt": request.prompt}
    settings |= {"prompt_token_ids": prompt_ids, "num_tokens": request.num_tokens, "sampling": asdict(request.sampling)}
    settings |= {"speculative": asdict(speculative), "device": target.description}
    yield model_verdict(server, state["result"], settings, decode_fn(target), time.perf_counter() - started)


def model_verdict(server: Server, result, settings: dict, decode, seconds: float) -> tuple:
    shown = result.sequences[:SEQUENCES_SHOWN]
    labels = [" · ".join(repr(decode([token]))[1:-1] for token in sequence) for sequence in shown]
    record = {"settings": settings, **asdict(result), "texts": [decode(list(s)) for s in result.sequences]}
    record["seconds"] = seconds
    count = sum(result.speculative)
    sampling = settings["sampling"]
    verdict = f"**{result.verdict}**\n\n{_describe(sampling['rule'], settings['bug'], sampling['seed'])} "
    verdict += f"Pair {settings['pair']}, {count:,} samples a side, {len(result.sequences):,} distinct sequences; "
    verdict += f"{seconds:.1f} s."
    return (
        verdict,
        model_audit_figure(labels, result.speculative[:SEQUENCES_SHOWN], result.target_only[:SEQUENCES_SHOWN]),
        None,
        gr.update(value=server.downloads.write_json("specdemo-audit", record), visible=True),
    )
