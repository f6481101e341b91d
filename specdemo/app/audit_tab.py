"""The Audit tab and /audit: "is it lossless?", checked live on toy distributions and on the real model, beside a
planted bug that must fail the same check."""

from __future__ import annotations

import json
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from functools import partial

import gradio as gr
import torch

from specdemo.app.messages import user_error
from specdemo.app.plots import model_audit_figure, toy_audit_figure, toy_tv_figure
from specdemo.audit import BUGS, TOY_PRESETS, model_audit, parse_weights, toy_audit
from specdemo.config import MAX_NUM_CANDIDATES, SamplingConfig, SpeculativeConfig, check_prompt, whole_number
from specdemo.engine.resources import openmp_workers_released
from specdemo.models.loading import chat_prompt_ids
from specdemo.models.shared import ModelCache
from specdemo.pairs import DEFAULT_PAIR, PAIRS, Pair, find_pair, load_pair, make_drafter

MODES = ("toy", "model")
TOY_SAMPLES = (1_000, 1_000_000)  # N, the range offered
MODEL_SAMPLES = (100, 5_000)  # M per side
DEFAULT_SAMPLES = {"toy": 200_000, "model": 1_000}
MAX_TOY_DRAFT_TOKENS = 8
MAX_AUDIT_TOKENS = 3
SEQUENCES_SHOWN = 15  # the most frequent first-token sequences in the model-mode chart
PROGRESS_INTERVAL_SECONDS = 0.5
DEFAULT_PROMPT = "Write one sentence about the sea."
INTRO = (
    "Speculative decoding claims its output follows exactly the target's distribution. Check it: **toy** mode runs "
    "the project's own sampler on distributions you choose and tests the tokens it emits against p; **model** mode "
    "draws a prompt's first tokens many times with speculative decoding and with the target alone, and compares "
    "them. A **planted bug** runs the same audit with a broken sampler, which should fail. The hot self-draft pair "
    "(SmolLM2 drafting for itself at temperature 1.5) makes the bugs visible in model mode; prompt lookup drafts "
    "one-hot, so a wrong q changes nothing there."
)


def _weights_text(weights: list[float]) -> str:
    return ", ".join(f"{w:g}" for w in weights)


def preset_weights(name: str) -> tuple[str, str]:
    target, draft = TOY_PRESETS[name]
    return _weights_text(target), _weights_text(draft)


def _samples(mode: str, value: float) -> int:
    low, high = TOY_SAMPLES if mode == "toy" else MODEL_SAMPLES
    count = whole_number("the number of samples", value)
    if not low <= count <= high:
        raise ValueError(f"The number of samples must be between {low:,} and {high:,} in {mode} mode, got {count:,}.")
    return count


def _in_range(name: str, value: float, low: int, high: int) -> int:
    count = whole_number(name, value)
    if not low <= count <= high:
        raise ValueError(f"{name} must be between {low} and {high}, got {count}.")
    return count


def _audit_file(record: dict) -> str:
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="specdemo-audit-", delete=False) as handle:
        json.dump(record, handle, indent=1)
    return handle.name


@dataclass(frozen=True)
class AuditRequest:
    """An audit's settings, checked."""

    mode: str
    bug: str
    num_samples: int
    seed: int
    num_draft_tokens: int  # K
    num_candidates: int  # W
    target: torch.Tensor | None = None  # toy: p and q, normalised
    draft: torch.Tensor | None = None
    sampling: SamplingConfig | None = None  # model mode
    num_tokens: int = 0
    prompt: str = ""
    pair: Pair | None = None


def parse_audit(
    mode: str,
    bug: str,
    num_samples: float,
    seed: float,
    target_weights: str,
    draft_weights: str,
    num_draft_tokens: float,
    num_candidates: float,
    prompt: str,
    pair: str,
    temperature: float,
    top_k: float,
    top_p: float,
    repetition_penalty: float,
    num_tokens: float,
) -> AuditRequest:
    """The form's values as a checked request; a ValueError names the first bad one."""
    if mode not in MODES:
        raise ValueError(f"Unknown audit mode {mode!r}: pick 'toy' or 'model'.")
    if bug not in BUGS:
        raise ValueError(f"Unknown bug {bug!r}: pick one of {', '.join(BUGS)}.")
    common = (mode, bug, _samples(mode, num_samples), whole_number("seed", seed))
    common += (_in_range("draft tokens per round (K)", num_draft_tokens, 1, MAX_TOY_DRAFT_TOKENS),)
    common += (_in_range("candidates per round (W)", num_candidates, 1, MAX_NUM_CANDIDATES),)
    if mode == "toy":
        target, draft = parse_weights(target_weights, "target p"), parse_weights(draft_weights, "draft q")
        if len(target) != len(draft):
            raise ValueError(
                f"The target p has {len(target)} weights and the draft q {len(draft)}: give both one weight per token."
            )
        return AuditRequest(*common, target=target, draft=draft)
    if not temperature or float(temperature) <= 0:
        raise ValueError(
            "Model mode samples, and temperature 0 is greedy decoding, which has nothing to sample: pick a "
            "temperature such as 1.0."
        )
    sampling = SamplingConfig(
        temperature=temperature,
        top_k=whole_number("top-k", top_k),
        top_p=top_p,
        repetition_penalty=repetition_penalty,
        seed=common[3],
    )
    tokens = _in_range("tokens per sample", num_tokens, 1, MAX_AUDIT_TOKENS)
    check_prompt(prompt)
    return AuditRequest(*common, sampling=sampling, num_tokens=tokens, prompt=prompt, pair=find_pair(pair))


def check_audit(*values: object) -> None:
    """The form's values, checked before anything runs: a refusal is a message, the last audit's charts stay."""
    try:
        parse_audit(*values[:4], *values[5:])  # type: ignore[arg-type]  (the preset only fills the weights)
    except ValueError as error:
        raise user_error(str(error)) from error


def run_toy(request: AuditRequest) -> tuple:
    assert request.target is not None and request.draft is not None
    k, w = request.num_draft_tokens, request.num_candidates
    started = time.perf_counter()
    result = toy_audit(request.target, request.draft, k, request.num_samples, w, request.bug, request.seed)
    seconds = time.perf_counter() - started
    settings = {"mode": "toy", "bug": request.bug, "num_samples": request.num_samples, "seed": request.seed}
    settings |= {"num_draft_tokens": k, "num_candidates": w}
    record = {"settings": settings, **asdict(result), "seconds": seconds}
    verdict = f"**{result.verdict}**\n\n{_describe(request.bug, request.seed)} N = {request.num_samples:,}, K = {k}, "
    verdict += f"W = {w}; {seconds:.1f} s."
    return (
        verdict,
        toy_audit_figure(result.counts, result.target, result.passes),
        toy_tv_figure(result.tv_curve),
        gr.update(value=_audit_file(record), visible=True),
    )


def _describe(bug: str, seed: int) -> str:
    sampler = "The project's sampler." if bug == "none" else f"Planted bug, {bug}: {BUGS[bug]}."
    return f"{sampler} Seed {seed}."


def build_audit_tab(cache: ModelCache, models_lock: threading.Lock) -> None:
    """The Audit tab, inside the page's tabs; `models_lock` keeps its passes apart from the runs' passes."""

    def audit(
        mode: str = "toy",
        bug: str = "none",
        num_samples: float = DEFAULT_SAMPLES["toy"],
        seed: float = 0,
        preset: str = "overlapping",
        target_weights: str = preset_weights("overlapping")[0],
        draft_weights: str = preset_weights("overlapping")[1],
        num_draft_tokens: float = 4,
        num_candidates: float = 1,
        prompt: str = DEFAULT_PROMPT,
        pair: str = DEFAULT_PAIR.key,
        temperature: float = 1.0,
        top_k: float = 0,
        top_p: float = 1.0,
        repetition_penalty: float = 1.0,
        num_tokens: float = 2,
        progress: gr.Progress = gr.Progress(),
    ) -> Iterator[tuple]:
        """The lossless audit. mode "toy": N = `num_samples` rounds of the sampler on the target p and draft q
        given as weights (`preset` names the defaults); mode "model": M = `num_samples` (100 to 5,000: pass it)
        samples of the first `num_tokens` tokens of `prompt`, speculative against the target alone. `bug` plants
        one of the broken samplers. Returns the verdict sentence, two charts and the audit as JSON."""
        try:
            request = parse_audit(
                mode,
                bug,
                num_samples,
                seed,
                target_weights,
                draft_weights,
                num_draft_tokens,
                num_candidates,
                prompt,
                pair,
                temperature,
                top_k,
                top_p,
                repetition_penalty,
                num_tokens,
            )
        except ValueError as error:
            raise user_error(str(error)) from error
        if request.mode == "toy":
            with openmp_workers_released():  # a Gradio worker thread: it lives on, idle
                result = run_toy(request)
            yield result
            return
        assert request.pair is not None and request.sampling is not None
        chosen, sampling, tokens, count = request.pair, request.sampling, request.num_tokens, request.num_samples
        try:
            with openmp_workers_released():
                target, draft = load_pair(chosen, cache, lambda message: progress(0.0, desc=message))
        except ValueError as error:  # no network for a Hub pair, not enough memory: the sentence says which
            raise user_error(str(error)) from error
        speculative = SpeculativeConfig(
            num_draft_tokens=request.num_draft_tokens,
            num_candidates=request.num_candidates,
            draft_temperature=chosen.draft_temperature,
        )
        prompt_ids = chat_prompt_ids(target, request.prompt)[0].tolist()
        yield from _stream_model_audit(
            partial(
                model_audit,
                target.model,
                make_drafter(chosen, target, draft),
                target.eos_token_ids,
                prompt_ids,
                sampling,
                speculative,
                tokens,
                count,
                request.bug,
                lock=models_lock,
            ),
            partial(target.tokenizer.decode, skip_special_tokens=False),
            {"mode": "model", "bug": request.bug, "num_samples": count, "pair": chosen.key, "prompt": request.prompt}
            | {"prompt_token_ids": prompt_ids, "num_tokens": tokens, "sampling": asdict(sampling)}
            | {"speculative": asdict(speculative), "device": target.description},
            progress,
        )

    gr.Markdown(INTRO)
    with gr.Row():
        mode = gr.Radio(list(MODES), value="toy", label="Audit", elem_id="audit-mode")
        bug = gr.Dropdown(
            [
                (f"{name}: {what}" if name != "none" else "none (the project's sampler)", name)
                for name, what in BUGS.items()
            ],
            value="none",
            label="Planted bug",
            elem_id="audit-bug",
        )
        num_samples = gr.Number(
            DEFAULT_SAMPLES["toy"], label="Samples: N, or M a side in model mode", elem_id="audit-samples"
        )
        seed = gr.Number(0, label="Seed", elem_id="audit-seed")
    with gr.Row():
        num_draft_tokens = gr.Slider(1, MAX_TOY_DRAFT_TOKENS, value=4, step=1, label="Draft tokens per round (K)")
        num_candidates = gr.Slider(1, MAX_NUM_CANDIDATES, value=1, step=1, label="Candidates per round (W)")
    with gr.Group(visible=True) as toy_box:
        preset = gr.Dropdown(list(TOY_PRESETS), value="overlapping", label="Preset", elem_id="audit-preset")
        target_weights = gr.Textbox(
            preset_weights("overlapping")[0], label="Target p: a weight per token", elem_id="audit-target"
        )
        draft_weights = gr.Textbox(
            preset_weights("overlapping")[1], label="Draft q: a weight per token", elem_id="audit-draft"
        )
    with gr.Group(visible=False) as model_box:
        prompt = gr.Textbox(DEFAULT_PROMPT, label="Prompt", elem_id="audit-prompt")
        pair = gr.Dropdown(
            [(p.label, p.key) for p in PAIRS], value=DEFAULT_PAIR.key, label="Pair", elem_id="audit-pair"
        )
        with gr.Row():
            temperature = gr.Slider(0, 2, value=1.0, step=0.05, label="Temperature", elem_id="audit-temperature")
            top_k = gr.Number(0, minimum=0, step=1, label="Top-k (0 = off)")
            top_p = gr.Slider(0.05, 1, value=1, step=0.01, label="Top-p (1 = off)")
            repetition_penalty = gr.Slider(1, 2, value=1, step=0.05, label="Repetition penalty (1 = off)")
            num_tokens = gr.Slider(1, MAX_AUDIT_TOKENS, value=2, step=1, label="First tokens per sample")
    with gr.Row():
        run = gr.Button("Run the audit", variant="primary", elem_id="audit-run")
        stop = gr.Button("Stop", variant="stop", elem_id="audit-stop")
    verdict = gr.Markdown(elem_id="audit-verdict")
    with gr.Row():
        chart = gr.Plot(elem_id="audit-chart", show_label=False)
        tv_chart = gr.Plot(elem_id="audit-tv-chart", show_label=False)
    download = gr.DownloadButton("Download the audit (JSON)", visible=False, elem_id="audit-download")

    mode.change(
        lambda chosen: (
            gr.update(visible=chosen == "toy"),
            gr.update(visible=chosen == "model"),
            DEFAULT_SAMPLES[chosen],  # a toy N is out of range in model mode
        ),
        inputs=mode,
        outputs=[toy_box, model_box, num_samples],
        queue=False,
        api_visibility="private",
    )
    preset.change(
        preset_weights, inputs=preset, outputs=[target_weights, draft_weights], queue=False, api_visibility="private"
    )
    inputs = [mode, bug, num_samples, seed, preset, target_weights, draft_weights, num_draft_tokens, num_candidates]
    inputs += [prompt, pair, temperature, top_k, top_p, repetition_penalty, num_tokens]
    checked = run.click(check_audit, inputs=inputs, outputs=None, preprocess=False, api_visibility="private")
    event = checked.success(  # /audit checks again, for API clients
        audit,
        inputs=inputs,
        outputs=[verdict, chart, tv_chart, download],
        concurrency_limit=1,
        concurrency_id="audit",
        preprocess=False,
        api_name="audit",
    )
    stop.click(None, cancels=[event], api_visibility="private")


def _stream_model_audit(run, decode, settings: dict, progress: gr.Progress) -> Iterator[tuple]:
    """Run the model audit in a thread; show its progress; Stop (closing this generator) ends it at the next round."""
    state: dict = {"done": 0.0}
    stop = threading.Event()

    def work() -> None:
        try:
            state["result"] = run(on_progress=lambda done: state.update(done=done), should_stop=stop.is_set)
        except Exception as error:  # reported below, in this user's page only
            state["error"] = error

    started = time.perf_counter()
    worker = threading.Thread(target=work, name="specdemo-audit", daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(PROGRESS_INTERVAL_SECONDS)
            progress(state["done"], desc="Drawing samples")
            yield f"Drawing samples: {state['done']:.0%}", gr.skip(), gr.skip(), gr.skip()
    finally:
        stop.set()
    if "error" in state:
        error = state["error"]
        raise user_error(f"The audit failed ({error.__class__.__name__}: {str(error)[:200]}).", log=True) from error
    result, seconds = state["result"], time.perf_counter() - started
    shown = result.sequences[:SEQUENCES_SHOWN]
    labels = [" · ".join(repr(decode([token]))[1:-1] for token in sequence) for sequence in shown]
    record = {"settings": settings, **asdict(result), "texts": [decode(list(s)) for s in result.sequences]}
    record["seconds"] = seconds
    count = sum(result.speculative)
    verdict = f"**{result.verdict}**\n\n{_describe(settings['bug'], settings['sampling']['seed'])} "
    verdict += f"Pair {settings['pair']}, {count:,} samples a side, {len(result.sequences):,} distinct sequences; "
    verdict += f"{seconds:.1f} s."
    yield (
        verdict,
        model_audit_figure(labels, result.speculative[:SEQUENCES_SHOWN], result.target_only[:SEQUENCES_SHOWN]),
        None,
        gr.update(value=_audit_file(record), visible=True),
    )
