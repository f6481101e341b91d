"""Serving the Audit tab: its settings table and their parsing into a checked request, the toy audit, and the model
audit's models, budget and worker, whose rounds take turns with the runs' schedulers under the models' lock and end at
the run's stop signal; every update is a tuple for the tab's outputs (verdict, chart, TV chart, download)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Generator, Iterator
from contextlib import closing
from dataclasses import asdict, dataclass, replace

import gradio as gr
import torch

from specdemo.app.form import RUN_FIELDS, Field, by_name, whole
from specdemo.app.serving.handlers import stop_signal
from specdemo.app.serving.messages import failure_sentence, user_error
from specdemo.app.serving.runs import Server, decode_fn, read_values
from specdemo.app.serving.zerogpu import MIN_SECONDS, ON_ZEROGPU, budget_seconds, decoding_seconds, ready_pair
from specdemo.app.views.audit import model_record, model_verdict, sequence_labels, toy_record, toy_verdict
from specdemo.app.views.plots import model_audit_figure, toy_audit_figure, toy_tv_figure
from specdemo.audit import (
    MODEL_BATCH_ROWS,
    RULE_BUGS,
    TOY_PRESETS,
    ModelAudit,
    audit_draws,
    parse_weights,
    toy_audit,
)
from specdemo.config import (
    MAX_NUM_CANDIDATES,
    RULE_LABELS,
    SamplingConfig,
    SpeculativeConfig,
    check_prompt,
    run_settings,
)
from specdemo.engine.resources import openmp_workers_released
from specdemo.engine.setup import make_drafter
from specdemo.models.loading import LoadedModel, prompt_token_ids
from specdemo.pairs import DEFAULT_PAIR, PAIRS, Pair, find_pair

MODES = ("toy", "model")
TOY_SAMPLES = (1_000, 1_000_000)  # N, the range offered
MODEL_SAMPLES = (100, 5_000)  # M per side
DEFAULT_SAMPLES = {"toy": 200_000, "model": 1_000}
MAX_TOY_DRAFT_TOKENS = 8
MAX_AUDIT_TOKENS = 3
SEQUENCES_SHOWN = 15  # the most frequent first-token sequences in the model-mode chart
LOWER_AUDIT = "lower the samples or the first tokens per sample"  # what a model audit can ask for less of
DEFAULT_PROMPT = "Write one sentence about the sea."


def preset_weights(name: str) -> tuple[str, str]:
    target, draft = TOY_PRESETS[name]
    return ", ".join(f"{w:g}" for w in target), ", ".join(f"{w:g}" for w in draft)


def in_range(name: str, low: int, high: int) -> Callable[[object], int]:
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
    Field("bug", "dropdown", "none", "Planted bug", choices=bug_choices("standard"), elem_id="audit-bug", read=_bug),
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

    @property
    def planted(self) -> str:
        """What the planted bug does ("" for none)."""
        return RULE_BUGS[self.rule][self.bug] if self.bug != "none" else ""


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
    common = AuditRequest(
        mode=mode,
        bug=bug,
        num_samples=samples,
        seed=read["seed"],
        num_draft_tokens=read["num_draft_tokens"],
        num_candidates=read["num_candidates"],
        rule=rule,
    )
    if mode == "toy":
        target = parse_weights(values.get("target_weights", preset_weights("overlapping")[0]), "target p")
        draft = parse_weights(values.get("draft_weights", preset_weights("overlapping")[1]), "draft q")
        if len(target) != len(draft):
            raise ValueError(
                f"The target p has {len(target)} weights and the draft q {len(draft)}: give both one weight per token."
            )
        return replace(common, target=target, draft=draft)
    return replace(common, **_model_settings(read, rule))


def _model_settings(read: dict, rule: str) -> dict:
    """Model mode's own settings, checked: the sampling, the first tokens drawn, the prompt and the pair."""
    if not read["temperature"] or float(read["temperature"]) <= 0:
        raise ValueError(
            "Model mode samples, and temperature 0 is greedy decoding, which has nothing to sample: pick a "
            "temperature such as 1.0."
        )
    sampling = SamplingConfig(
        temperature=read["temperature"],
        top_k=read["top_k"],
        top_p=read["top_p"],
        repetition_penalty=read["repetition_penalty"],
        seed=read["seed"],
        rule=rule,
    )
    check_prompt(read["prompt"])
    pair = find_pair(read["pair"])
    return {"sampling": sampling, "num_tokens": read["num_tokens"], "prompt": read["prompt"], "pair": pair}


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
    """The model audit of the checked `values` (a ZeroGPU call on ZeroGPU), stopped by the run's stop signal."""
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
    """The toy audit, run here (arithmetic, no model): its verdict, its two charts and its file."""
    assert request.target is not None and request.draft is not None
    k, w = request.num_draft_tokens, request.num_candidates
    started = time.perf_counter()
    result = toy_audit(
        request.target, request.draft, k, request.num_samples, w, request.bug, request.seed, request.rule
    )
    seconds, record = time.perf_counter() - started, asdict(result)
    settings = {"mode": "toy", "rule": request.rule, "bug": request.bug, "num_samples": request.num_samples}
    settings |= {"seed": request.seed, "num_draft_tokens": k, "num_candidates": w}
    file = server.downloads.write_json("specdemo-audit", toy_record(record, settings, seconds))
    return (
        toy_verdict(record, settings, request.planted, seconds),
        toy_audit_figure(result.counts, result.target, result.passes),
        toy_tv_figure(result.tv_curve),
        gr.update(value=file, visible=True),
    )


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
    """The model audit, its rows decoded by schedulers as runs' rows are (each round holding the models' lock, so runs
    go on between them), its progress shown as rounds arrive. `stop` ends it at its next round, and so does the end of
    its budget (on ZeroGPU), with a sentence; a failure is one sentence, for this user only."""
    assert request.pair is not None and request.sampling is not None
    target, draft, budget = audit_models(server, request, progress)
    deadline = time.monotonic() + budget
    speculative = SpeculativeConfig(
        num_draft_tokens=request.num_draft_tokens,
        num_candidates=request.num_candidates,
        draft_temperature=request.pair.draft_temperature,
    )
    prompt_ids = prompt_token_ids(target, request.prompt)
    steps = audit_draws(
        target=target.model,
        drafter=make_drafter(request.pair, target, draft),
        eos_token_ids=target.eos_token_ids,
        prompt_ids=prompt_ids,
        sampling=request.sampling,
        speculative=speculative,
        num_tokens=request.num_tokens,
        num_samples=request.num_samples,
        bug=request.bug,
        lock=server.models_lock,
        stop=stop,
        deadline=deadline,
    )
    started = time.perf_counter()
    try:
        result = yield from drawing(steps, progress)
    except Exception as error:
        if not stop.is_set():  # stopped: the page keeps what it shows
            yield from failed(error, isinstance(error, InterruptedError) and time.monotonic() >= deadline, budget)
        return
    settings = {"mode": "model", "bug": request.bug, "num_samples": request.num_samples, "pair": request.pair.key}
    settings |= {"prompt": request.prompt, "prompt_token_ids": prompt_ids, "num_tokens": request.num_tokens}
    settings |= {"sampling": asdict(request.sampling), "speculative": asdict(speculative), "device": target.description}
    yield model_update(server, request, result, settings, decode_fn(target), time.perf_counter() - started)


def drawing(steps: Generator[float, None, ModelAudit], progress: gr.Progress) -> Generator[tuple, None, ModelAudit]:
    """The audit's steps, its rounds run by its schedulers' threads, the share of samples drawn sent to the page as
    they arrive (a ZeroGPU worker can close a call's steps only when they yield); returns the audit, or raises what
    its steps raised (InterruptedError when stopped). Closing this closes the steps: the audit's rows leave at their
    next round."""
    with closing(steps):
        while True:
            try:
                share = next(steps)
            except StopIteration as done:
                return done.value
            progress(share, desc="Drawing samples")
            yield f"Drawing samples: {share:.0%}", gr.skip(), gr.skip(), gr.skip()


def failed(error: Exception, ran_out: bool, budget: float) -> Iterator[tuple]:
    """A model audit's failure as one sentence, shown as its verdict, then raised for this user's page: the end of its
    budget (`ran_out`) says what to lower; any other failure, messages.failure_sentence's."""
    sentence = (
        f"The model audit stopped after {budget:.0f} s, its time on the GPU: {LOWER_AUDIT}, and run it again."
        if ran_out
        else failure_sentence(error, "The model audit")
    )
    yield sentence, gr.skip(), gr.skip(), gr.skip()
    raise user_error(sentence, log=not ran_out and not isinstance(error, ValueError)) from error


def model_update(
    server: Server, request: AuditRequest, result: ModelAudit, settings: dict, decode: Callable, seconds: float
) -> tuple:
    """The model audit's verdict, its chart of the most frequent sequences and its file."""
    record = asdict(result)
    shown = result.sequences[:SEQUENCES_SHOWN]
    chart = model_audit_figure(
        sequence_labels(shown, decode), result.speculative[:SEQUENCES_SHOWN], result.target_only[:SEQUENCES_SHOWN]
    )
    file = server.downloads.write_json("specdemo-audit", model_record(record, settings, decode, seconds))
    return model_verdict(record, settings, request.planted, seconds), chart, None, gr.update(value=file, visible=True)
