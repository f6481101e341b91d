"""What the tabs share on the server: the loaded models, the schedulers that let runs share passes, the downloads
folder and the measured sweep; and turning a form's values into a ready run (checked settings, models, prompts)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import gradio as gr
import torch

from specdemo.app.form import LeftOut, RunRequest, leave_out, names, parse_request
from specdemo.app.serving.handlers import Downloads
from specdemo.app.serving.messages import user_error
from specdemo.app.serving.startup import held_pairs_left_out, not_loaded, startup_left_out
from specdemo.app.serving.zerogpu import (
    MIN_SECONDS,
    ON_ZEROGPU,
    budget_seconds,
    ready_pair,
    run_seconds,
    startup_pairs,
)
from specdemo.app.views.replay import replay_record
from specdemo.config import check_prompt_fits
from specdemo.core.rounds import Round
from specdemo.core.stats import round_record, run_stats
from specdemo.drafters.registry import NGRAM
from specdemo.engine.decoding import BatchDecoder
from specdemo.engine.drafting import build_drafter
from specdemo.engine.resources import openmp_workers_released
from specdemo.engine.scheduler import MAX_BATCH_ROWS, DecodeRequest, RowStream, Schedulers, measure_for_sharing
from specdemo.engine.setup import check_run_limits, load_pair
from specdemo.models.graphs import DeviceLock
from specdemo.models.loading import (
    OFFLINE_DEFAULT,
    LoadedModel,
    dtype_reason,
    pick_device,
    prompt_token_ids,
)
from specdemo.models.platform import announce
from specdemo.models.shared import ModelCache
from specdemo.pairs import DEFAULT_PAIR, Pair

RUN_TIME_BUDGET_SECONDS = 120.0  # one run, comparison included; then it stops and says so (on ZeroGPU: its call's)
RUN_CONCURRENCY = MAX_BATCH_ROWS  # runs decoding at once, as rows of one batch per model (one per call on ZeroGPU)
QUEUE_SIZE = 16  # waiting runs beyond this are told the queue is full
CHART_INTERVAL_SECONDS = 0.5  # charts are re-sent whole (~3 ms to build four): at most 2 updates a second, shared
# by the rows of a batch (each of 8 rows' pages gets one every 4 s), as are the tokens' updates. The target alone
# redraws the two charts it changes twice as often, so both timed runs load a browser on the server's cores alike
# (`make demo` on a laptop): plotly is most of the page's script time.
IN_PROGRESS_END = "…*"  # how every streamed summary but the last ends
SWEEP_FILE = Path(__file__).with_name("batch_sweep.json")  # bench --batch-sizes, measured, drawn on the Batch tab
SWEEP_LESSONS = {  # what each of the sweep's charts teaches, after the sentence that says how it was measured
    "batch": "Where the speculative line falls under target-only, drafting costs more than it wins at that batch size. "
    "Batches here cut their drafts for shared passes, as the sweep's line of that name did.",
    "candidates": "More candidates per round win more tokens per target pass, and every one of them widens the pass: "
    "the batch chart on the Batch tab shows what that costs in tokens/s.",
}


@dataclass
class Server:
    """The server's shared state, made once by build_demo."""

    cache: ModelCache  # loaded models, shared across runs and users
    schedulers: Schedulers  # runs of the same models share their passes (on ZeroGPU, a worker's runs)
    downloads: Downloads  # trace and audit files, a bounded folder
    sweep: dict | None  # the measured batch sweep, or None
    run_concurrency: int = RUN_CONCURRENCY  # runs decoding at once
    budget_seconds: float = RUN_TIME_BUDGET_SECONDS  # one run's time, comparisons included (not on ZeroGPU)
    device_line: str = ""  # where runs decode, for the page: device, number format, torch and its CUDA
    startup_pairs: tuple[str, ...] | None = None  # on ZeroGPU, the pairs loaded at startup, the only ones that run
    left_out: dict[str, LeftOut] = field(default_factory=dict)  # pairs the startup checks found cannot run, by key

    @classmethod
    def start(cls, cache: ModelCache | None = None, **limits: float) -> Server:
        """Load the default pair before the first visitor and measure what shared batches cut their drafts by; on
        ZeroGPU, load every startup pair's models instead (a call's worker sees the models loaded before it forked,
        and the main process has no GPU to measure on). Then check the pairs it can (serving/startup.py): one that
        cannot run is left out, with its sentence in the log and its reason in the pair list. Says where runs decode,
        in the log and on the page."""
        device = pick_device()
        line = announce(device, dtype_reason("auto", device))
        if ON_ZEROGPU:
            pairs = startup_pairs()
            cache = cache or ModelCache(pinned=OFFLINE_DEFAULT, capacity=2 * len(pairs))  # none evicted
            left_out = startup_left_out(pairs, cache, device)
            leave_out(left_out)
            offered = tuple(pair.key for pair in pairs if pair.key not in left_out)
            return cls(
                cache,
                Schedulers(),
                Downloads(),
                None,
                device_line=line,
                startup_pairs=offered,
                left_out=left_out,
                **limits,
            )
        cache = cache or ModelCache(pinned=OFFLINE_DEFAULT)
        with openmp_workers_released():  # this thread then waits for the server; the runs' threads decode
            target, _ = load_pair(DEFAULT_PAIR, cache, progress=print)
            measure_for_sharing(target, print)
            left_out = held_pairs_left_out(cache, target.device)
        leave_out(left_out)
        sweep = json.loads(SWEEP_FILE.read_text()) if SWEEP_FILE.is_file() else None
        return cls(cache, Schedulers(), Downloads(), sweep, device_line=line, left_out=left_out, **limits)

    @property
    def models_lock(self) -> DeviceLock:
        return self.schedulers.models_lock

    def check_runnable(self, pair: Pair, dtype: torch.dtype | None = None) -> None:
        """Refuse a pair the startup checks left out, with their sentence; on ZeroGPU, also a pair not loaded at
        startup, or another number format than it was loaded in: loading inside a call would spend the visitor's GPU
        time and be lost with the call's worker."""
        if pair.key in self.left_out:
            raise ValueError(self.left_out[pair.key].sentence)
        if self.startup_pairs is None:
            return
        if pair.key not in self.startup_pairs:
            raise ValueError(not_loaded(pair.key, self.startup_pairs))
        if not self.cache.holds(pair.target, dtype=dtype):
            raise ValueError(
                "This ZeroGPU Space holds its models in the number format auto picks, loaded at startup, not in "
                f"{str(dtype).removeprefix('torch.')}: set the number format to auto."
            )

    def prepare(
        self,
        prompts: list[str],
        values: dict,
        progress: gr.Progress,
        stop: threading.Event,
        call: int | None = None,  # the seconds the run's ZeroGPU call asked for; None: call_seconds of its request
    ) -> Run:
        """The checked request, its models and encoded prompts; a ValueError names the problem. The run's budget
        starts once they are ready: loading, the pass costs measured, and a ZeroGPU worker's first use of the models
        are outside it (on ZeroGPU, inside the seconds the call asked for)."""
        started = time.monotonic()
        request = parse_request(prompts[0], values)
        self.check_runnable(request.pair, request.dtype)
        report: Callable[[str], None] = lambda message: progress(0.0, desc=message)  # noqa: E731
        with openmp_workers_released():  # a Gradio worker thread: it lives on, idle
            target, draft = ready_pair(
                request.pair, self.cache, report, allow_local=request.allow_local, dtype=request.dtype
            )  # the comparisons run on these same models, so in the same format
            if not ON_ZEROGPU:  # a ZeroGPU call decodes one request: nothing to share a batch with
                measure_for_sharing(target, report)
        encoded = []
        for number, text in enumerate(prompts, start=1):
            prompt_ids = prompt_token_ids(target, text, chat=request.chat)  # on the host: no device work
            try:
                check_prompt_fits(len(prompt_ids), request.speculative.max_new_tokens, target.context_length)
                tokens = len(prompt_ids) + request.speculative.max_new_tokens
                candidates = len(prompts) * request.speculative.num_candidates
                check_run_limits(request.pair, target.device, target.model.dtype, tokens, candidates, "this run")
            except ValueError as error:
                raise ValueError(f"Prompt {number}: {error}" if len(prompts) > 1 else str(error)) from None
            encoded.append(prompt_ids)
        ready = time.monotonic()
        asked = call_seconds(request) if call is None else call
        budget = budget_seconds(asked, ready - started) if ON_ZEROGPU else self.budget_seconds
        return Run(request, target, draft, encoded, self.schedulers, ready + budget, stop, budget)


def call_seconds(request: RunRequest) -> int:
    """What a run's ZeroGPU call asks for: the speculative decoding and each comparison it will run."""
    pair = request.pair
    draft_alone = pair.uses_draft_model and pair.drafter != pair.target
    return run_seconds(request.speculative.max_new_tokens, 1 + (1 + draft_alone if request.compare else 0))


def requested_seconds(leading: str, *values: object, **_: object) -> int:
    """What a call with the form's `values` after `leading` (prompt or prompts) asks ZeroGPU for; the least when they
    do not parse, since the call then refuses them in a sentence."""
    named, _ = read_values([leading, *names()], values)
    prompt = named.pop(leading)
    try:
        first = prompt if leading == "prompt" else (prompt.splitlines() if isinstance(prompt, str) else prompt)[0]
        request = parse_request(first, named)
    except (ValueError, IndexError, TypeError, AttributeError):
        return MIN_SECONDS
    return call_seconds(request) if leading == "prompt" else run_seconds(request.speculative.max_new_tokens, 2)


@dataclass(frozen=True)
class Run:
    """One run: its checked request, models and prompts, what it shares with other runs, and when it must end."""

    request: RunRequest
    target: LoadedModel
    draft: LoadedModel | None
    prompts: list[list[int]]  # token ids, chat template applied
    schedulers: Schedulers  # where its rows join other runs' batches
    deadline: float  # time.monotonic() at which the run's time budget ends, comparisons included
    stop: threading.Event  # set when the page cancels the run (Stop, a closed tab)
    budget_seconds: float = RUN_TIME_BUDGET_SECONDS  # what the deadline allowed, for the page to say

    def submit(self, model: LoadedModel, rows: list[DecodeRequest]) -> RowStream:
        """Rows decoded by `model`, beside other runs' rows: the target with this run's drafter (its rows may draft
        nothing, to compare), or the draft model alone."""
        if model is self.target:
            scheduler = self.schedulers.get(model, self.draft, self.request.pair.drafter, self.request.drafter_options)
        else:  # the draft model alone: its rows draft nothing, so any model-free kind's scheduler serves
            scheduler = self.schedulers.get(model, None, NGRAM)
        return scheduler.submit(rows, self.deadline, self.stop)


def read_values(names: list[str], values: tuple) -> tuple[dict, gr.Progress]:
    """A handler's positional values (the prompt first, then the settings, then Gradio's progress) by name."""
    named = dict(zip(names, values[: len(names)], strict=True))
    return named, values[len(names)] if len(values) > len(names) else gr.Progress()  # type: ignore[return-value]


def check_values(names: list[str], parse: Callable[[dict], object]) -> Callable[..., None]:
    """An event that checks the form's values before anything runs: a refusal is one sentence and the last run's
    output stays on the page."""

    def check(*values: object) -> None:
        try:
            parse(dict(zip(names, values, strict=True)))
        except ValueError as error:
            raise user_error(str(error)) from error

    return check


def trace_record(
    request: RunRequest, target: LoadedModel, prompt_ids: list[int], rounds: list[Round], baseline
) -> dict:
    """The run as the downloaded JSON: settings, tokens, every round and the figures; the seed reproduces it."""
    generated = [token for round_ in rounds for token in round_.emitted_token_ids]
    return {
        "pair": asdict(request.pair),
        "sampling": asdict(request.sampling),
        "speculative": asdict(request.speculative),
        "drafter_options": None if request.drafter_options is None else asdict(request.drafter_options),
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
        "replay": replay_record(rounds, decode_fn(target), prompt_ids, request.sampling.is_greedy),
    }


class Stepper:
    """A run decoded one round per call, for the step view's Next round: a one-row BatchDecoder of its own (the
    engine, rule and seed a run alone gets), each round taken under the models' lock as the schedulers take theirs, so
    other users' runs go on between two presses."""

    def __init__(self, run: Run) -> None:
        request = run.request
        drafter = build_drafter(request.pair.drafter, run.target, run.draft, request.drafter_options)
        self.decoder = BatchDecoder(run.target.model, drafter, run.target.eos_token_ids)
        self.decoder.add(0, run.prompts[0], request.sampling, request.speculative)
        self.run = run
        self.decoded: list[Round] = []
        self.lock = threading.Lock()  # one round at a time, however fast the presses

    @property
    def done(self) -> bool:
        return not self.decoder.rows

    def step(self) -> None:
        """Decode the next round (nothing once the run has ended); a failure of the row is raised."""
        with self.lock:
            if self.done:
                return
            with self.run.schedulers.models_lock, openmp_workers_released():
                [(_, outcome)] = self.decoder.step()
            if isinstance(outcome, Exception):
                raise outcome
            self.decoded.append(outcome)

    def record(self) -> dict:
        """The replay record of the rounds so far, `live` while more can come."""
        request = self.run.request
        decode = decode_fn(self.run.target)
        record = replay_record(self.decoded, decode, self.run.prompts[0], request.sampling.is_greedy)
        return record | {"live": not self.done}


def decode_fn(loaded: LoadedModel) -> Callable[[list[int]], str]:
    return lambda ids: loaded.tokenizer.decode(ids, skip_special_tokens=False)


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


def sweep_caption(sweep: dict | None, chart: str = "batch") -> str:
    if sweep is None:
        return "No measured sweep here: run `python -m specdemo bench --batch-sizes 1,2,4,8 --num-candidates 1,2,4`."
    return (
        f"Measured{' on ' + sweep['date'] if 'date' in sweep else ''} with `bench --batch-sizes` on "
        f"{sweep.get('model', 'this machine')}: {sweep['pair']}, greedy, "
        f"{sweep['max_new_tokens']} new tokens, the same {sweep['rows'][0]['num_prompts']} prompts at every B. "
        + SWEEP_LESSONS[chart]
    )
