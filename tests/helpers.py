"""Helpers several test files use: tiny random Llama models (milliseconds per step), the peer's greedy decoding,
near-tie checks, seeded runs, hand-made rounds, drafters of every kind for tiny models, and the engine's round
counters. Nothing here imports the app, so tests/test_gpu.py runs where Gradio is not installed (tests/app_helpers.py
has the app's helpers)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from torch.overrides import TorchFunctionMode
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.core.planning import PassCosts
from specdemo.core.rounds import Round
from specdemo.drafters import Drafter, HybridDrafter, ModelDrafter, NgramDrafter, NoDrafter, SuffixDrafter
from specdemo.drafters.head import RecurrentHead
from specdemo.drafters.head_file import load_head
from specdemo.drafters.recurrent import RecurrentDrafter
from specdemo.engine.costs import _RandomDrafter
from specdemo.engine.decoding import BatchDecoder, batch_generate
from specdemo.engine.scheduler import RowStream, Scheduler
from specdemo.models import graphs
from specdemo.models.graphs import Program
from specdemo.models.loading import LoadedModel
from specdemo.training.data import DataSettings
from specdemo.training.fit import FitSettings
from specdemo.training.run import train_drafter

FREE = PassCosts.from_seconds({1: 1.0, 2: 1.01, 129: 1.1})  # passes nearly free: cost-aware drafters draft it all
SMOLLM2_CPU = PassCosts.from_seconds({1: 1.0, 2: 1.6, 4: 1.6, 8: 1.7, 16: 1.9, 32: 2.6})  # like SmolLM2 on an idle CPU
TINY_VOCAB = 32  # small, so sampled-distribution tests have statistical power with a few thousand runs


def tiny_model(seed: int, vocab_size: int = TINY_VOCAB, num_layers: int = 2) -> LlamaForCausalLM:
    """A random Llama in float64: batched K+1 verification and one-token steps then agree to ~1e-15."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float64)
    with torch.no_grad():  # sharper than the default init, so greedy outputs vary and sampling has structure
        model.lm_head.weight.mul_(8.0)
    return model.eval()


NEAR_TIE = 1e-3  # top-2 logit gap under which float32 reordering may flip a greedy argmax


def assert_equal_or_near_tie(model, prompt: list[int], got: list[int], alone: list[int], label: str = "") -> bool:
    """Greedy tokens equal those decoded alone, or their first difference sits at a near-tie of the target's logits
    (checked with a fresh, uncached forward). Returns whether they were equal."""
    if got == alone:
        return True
    first = next((i for i, (a, b) in enumerate(zip(got, alone, strict=False)) if a != b), min(len(got), len(alone)))
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + alone[:first]], device=model.device)).logits[0, -1].float()
    top2 = logits.topk(2).values
    assert float(top2[0] - top2[1]) < NEAR_TIE, f"{label} differs at {first} where the top-2 gap is not a near-tie"
    return False


def seeded_runs(
    target: PreTrainedModel,
    drafter: Drafter,
    prompt_ids: torch.Tensor,  # [1, T]
    sampling: SamplingConfig,
    speculative: SpeculativeConfig,
    num_runs: int,
    rows: int = 150,
) -> list[list[Round]]:
    """The rounds of runs with seeds 0 .. num_runs - 1 and no EOS, decoded `rows` at a time as rows of one batch:
    eight times faster on tiny models than one at a time, and each row's tokens are those it gets alone
    (tests/test_batch.py)."""
    runs: list[list[Round]] = [[] for _ in range(num_runs)]
    prompts = [prompt_ids[0].tolist()] * num_runs
    samplings = [replace(sampling, seed=seed) for seed in range(num_runs)]
    for index, round_ in batch_generate(target, drafter, prompts, samplings, speculative, frozenset(), rows):
        runs[index].append(round_)
    return runs


def tiny_drafter(
    kind: str, draft: PreTrainedModel | None, head: RecurrentHead | None, vocab_size: int = TINY_VOCAB
) -> Drafter:
    """A fresh drafter of `kind` for a tiny target: a model-free kind (free passes for the cost-aware ones, and no
    memory of earlier outputs, so that a row's drafts are its own), the draft model `draft`, or "none"."""
    if kind == "suffix":
        return SuffixDrafter(lambda n: FREE, cache_tokens=0)
    if kind in ("recurrent", "hybrid"):
        assert head is not None, f"the {kind} drafter needs a head"
        recurrent = RecurrentDrafter(head, vocab_size)
        if kind == "recurrent":
            return recurrent
        return HybridDrafter(SuffixDrafter(lambda n: FREE, cache_tokens=0), recurrent, lambda n: FREE, vocab_size)
    if kind == "model":
        assert draft is not None, "the model drafter needs a draft model"
        return ModelDrafter(draft, None, vocab_size)
    return NgramDrafter(3, 1) if kind == "ngram" else NoDrafter()


def make_round(index: int, drafts: list[int], num_accepted: int, next_kind: str | None, seconds: float) -> Round:
    k = len(drafts)
    return Round(
        index=index,
        draft_token_ids=drafts,
        target_probs=[0.5] * k,
        draft_probs=[1.0] * k,
        acceptance_probs=[0.5] * k,
        uniforms=[0.1] * k,
        num_accepted=num_accepted,
        next_token_id=None if next_kind is None else 99,
        next_kind=next_kind,
        next_token_prob=None if next_kind is None else 0.9,
        num_input_tokens=k + 1,
        draft_seconds=seconds / 4,
        verify_seconds=seconds / 2,
        other_seconds=seconds / 4,
        forward_seconds=seconds / 2,
    )


GREEDY_PROMPTS = (  # eight requests a class might send at once
    "Correct the spelling: The quartely planing meeting is moved to Thursday at noon in room 4.",
    "Write a haiku about autumn rain.",
    "Turn into a Markdown table: name,age / Ann,31 / Bo,27 / Cy,45",
    "Explain why the sky is blue to a ten-year-old.",
    "List three uses for baking soda.",
    "Write a limerick about a cat who learned to code.",
    "Rewrite in the passive voice: The committee approved the budget on Monday.",
    "Summarise in one sentence: The train leaves at 9:40 from platform 3 and arrives in Lyon at 13:05.",
)
STORY = "Write a long story about a lighthouse keeper who finds a message in a bottle."


# How long a test waits for a state (rounds arrived, a run left the engine, a job queued, a page updated) before it
# fails: a guard against a hung engine or app, never a speed bound. A test's slowest wait with both cores of a 2-core
# machine busy is a few minutes (a lesson's run in the browser), far below it.
HANG_GUARD_SECONDS = 600


def wait_until(done: Callable[[], bool], what: str, seconds: float = HANG_GUARD_SECONDS) -> None:
    """Wait until `done()`; fail only when `what` has not happened within the hang guard."""
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, f"hang guard, not a speed bound: {what} did not happen in {seconds:.0f} s"
        time.sleep(0.01)


class WatchedRun:
    """One run in the engine, as a RoundCounter sees it: a scheduler's RowStream (a run's rows, or one side of a model
    audit's), stopped by its stop event or by closing its rounds: Stop, a closed tab, a dropped client, the deadline.
    `told_to_stop` is set just after the signal, so a step counted in `steps_after_stop` began after the engine could
    have seen it."""

    def __init__(self, decoder: BatchDecoder, stream: RowStream) -> None:
        self.decoder, self.stream = decoder, stream
        self.told_to_stop = False
        self.told_while_decoding = False  # the signal came before the run's rows had left the engine
        self.steps_after_stop = 0  # steps begun with the run's rows in the batch after it was told to stop

    def rows(self) -> set:
        return set(self.stream.keys) & set(self.decoder.rows)

    def left(self) -> bool:
        """None of the run's rows is decoding or waiting for a place."""
        return not any(key in self.stream.scheduler.streams for key in self.stream.keys)

    def tell_to_stop(self) -> None:
        if not self.told_to_stop:
            self.told_while_decoding = not self.left()
            self.told_to_stop = True


class RoundCounter:
    """The rows' rounds that the decoders `which` picks produce (BatchDecoder.step wrapped), and every run started
    while counting, with the engine steps begun after it was told to stop. Never the pass-cost measurement's steps:
    when the cost watch asks for one, the next run's preparation takes it (engine/costs.py), and its steps are not a
    run's rounds."""

    def __init__(self, which: Callable[[BatchDecoder], bool]) -> None:
        self.which = which
        self.rounds = 0
        self.runs: list[WatchedRun] = []
        self.lock = threading.Lock()

    def watched(self) -> list[WatchedRun]:
        with self.lock:
            return [run for run in self.runs if self.which(run.decoder)]

    def all_left(self) -> bool:
        """Some run is watched, and none of the watched runs' rows is in the engine any more."""
        watched = self.watched()
        return bool(watched) and all(run.left() for run in watched)

    def add(self, run: WatchedRun, stop: threading.Event) -> None:
        """Watch `run`, told to stop just after `stop` is set."""
        with self.lock:
            self.runs.append(run)
        original = stop.set

        def set_and_mark() -> None:
            original()
            run.tell_to_stop()

        stop.set = set_and_mark  # type: ignore[method-assign]


def count_rounds(monkeypatch, which: Callable[[BatchDecoder], bool] = lambda decoder: True) -> RoundCounter:
    """A RoundCounter of the decoders `which` picks, from now on."""
    counter = RoundCounter(which)
    step, init, cancel = BatchDecoder.step, RowStream.__init__, Scheduler.cancel

    def counting_step(decoder):
        if isinstance(decoder.drafter, _RandomDrafter):
            return step(decoder)
        with counter.lock:
            runs = [run for run in counter.runs if run.decoder is decoder]
        before = {id(run): run.rows() for run in runs}
        for run in runs:
            if run.told_to_stop and before[id(run)]:
                run.steps_after_stop += 1
        outcomes = step(decoder)
        if which(decoder):
            counter.rounds += len(outcomes)
        return outcomes

    def watching_init(stream, scheduler, keys, deadline, stop=None):
        init(stream, scheduler, keys, deadline, stop)
        counter.add(WatchedRun(scheduler.decoder, stream), stream.stop)

    def cancelling(scheduler, key):
        cancel(scheduler, key)  # closing a stream's rounds (Stop, the deadline) cancels its rows
        with counter.lock:
            runs = [run for run in counter.runs if run.stream.scheduler is scheduler]
        for run in runs:  # told once no row of its stream is left uncancelled (the audit cancels rows it has drawn)
            keys = run.stream.keys
            if key in keys and not any(k in scheduler.streams and k not in scheduler.cancelled for k in keys):
                run.tell_to_stop()

    monkeypatch.setattr(BatchDecoder, "step", counting_step)
    monkeypatch.setattr(RowStream, "__init__", watching_init)
    monkeypatch.setattr(Scheduler, "cancel", cancelling)
    return counter


def wait_for_rounds(counter: RoundCounter, at_least: int) -> None:
    wait_until(lambda: counter.rounds >= at_least, f"{at_least} rounds of the watched decoders")


def assert_stopped_runs_leave_at_the_next_round(counter: RoundCounter) -> None:
    """Once the watched runs have left the engine: some run was told to stop while its rows were in it, and every
    such run's rows took part in at most one step begun after the signal (the engine looks for it between steps: the
    step that began as it came may have missed it), so they left without decoding on to their end. A run that
    ignores the signal fails as soon as a second step begins with its rows."""

    def stopped_runs() -> list[WatchedRun]:
        return [run for run in counter.watched() if run.told_while_decoding]

    def settled() -> bool:
        return counter.all_left() or any(run.steps_after_stop > 1 for run in stopped_runs())

    wait_until(settled, "the watched runs leaving the engine")
    assert stopped_runs(), "no run was told to stop while it decoded: it finished first, or the app never stopped it"
    for run in stopped_runs():
        assert run.steps_after_stop <= 1, (
            f"{run.steps_after_stop} engine steps began with the stopped run's rows after it was told to stop: it "
            "should leave at the next round boundary"
        )


def trace_of(final) -> dict:
    with open(final[6]["value"]) as handle:
        return json.load(handle)


def save_tiny_model(directory: Path, tokenizer, seed: int) -> Path:
    """A tiny random Llama saved like a Hub repository, with `tokenizer`."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def word_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.WordLevel({word: index for index, word in enumerate(words)}, unk_token=words[0]))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=words[0], eos_token=words[1])


def tiny_recurrent_head(
    target: PreTrainedModel, seed: int, vocabulary_size: int | None = None, layers: tuple[int, ...] = (-1,)
) -> RecurrentHead:
    """A random RecurrentHead on `target` over its first `vocabulary_size` ids (all by default), reading `layers`,
    sharp enough that its drafts differ and are sometimes accepted."""
    vocab_size = target.get_output_embeddings().weight.shape[0]
    torch.manual_seed(seed)
    head = RecurrentHead(target, torch.arange(vocabulary_size or vocab_size), layers=layers).float()
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.mul_(4.0)
    return head.eval()


def train_tiny_head(
    target: PreTrainedModel,
    directory: Path,
    vocabulary_size: int = 24,
    output: Path | None = None,
    device: torch.device | None = None,  # where the target is: the CPU by default
) -> tuple[RecurrentHead, dict]:
    """A head trained for a few seconds on the greedy texts of a tiny target (train_drafter end to end), written to
    `output` (default: directory / "head.pt")."""
    output = output or directory / "head.pt"
    words = ["<unk>", "</s>", *(f"w{i}" for i in range(target.config.vocab_size - 2))]
    loaded = LoadedModel("tiny", target, word_tokenizer(words), device or torch.device("cpu"))
    data = DataSettings(num_texts=32, max_new_tokens=48, batch_size=8, temperature=0.0)
    settings = FitSettings(steps=400, batch_size=64, depth=3, vocabulary_size=vocabulary_size, held_out_texts=8)
    summary = train_drafter(loaded, data, settings, directory / "cache", output, None, print)
    return load_head(target, output), summary


HOST_WAITS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy"}


class HostWaits(TorchFunctionMode):
    """Counts the torch calls in its block that make the host wait for the device on a GPU (a value read back, or an
    output whose shape depends on values: nonzero, reading or writing through a mask), by name; a CUDA graph can
    capture none."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        masked = name in ("__getitem__", "__setitem__") and any(
            isinstance(index, torch.Tensor) and index.dtype == torch.bool
            for index in (args[1] if isinstance(args[1], tuple) else (args[1],))
        )
        if name in HOST_WAITS or masked:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


class StandIn(Program):
    """A captured program as the host sees it: one launch. It runs eagerly, and what it runs is not counted."""

    replaying = False
    captures = 0

    def __init__(self, run, inputs, memory) -> None:
        super().__init__(run, inputs)
        StandIn.captures += 1

    def replay(self) -> tuple[torch.Tensor, ...]:
        StandIn.replaying = True
        try:
            return super().replay()
        finally:
            StandIn.replaying = False


class WarmingStandIn(StandIn):
    """A capture as CUDA makes it: the program runs WARMUP_RUNS times on the inputs it is made with before it is
    recorded; each replay then runs it once."""

    def __init__(self, run, inputs, memory) -> None:
        super().__init__(run, inputs, memory)
        for _ in range(graphs.WARMUP_RUNS):
            Program.replay(self)
