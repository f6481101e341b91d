"""The fixed-shape engine's memory, accounted and survivable: what a group holds on the device, idle groups held to
IDLE_BYTES, a load and a run that run out of memory, and a model whose RoPE reads back to the host kept off graphs."""

# R = PASS_ROWS chain rows of a group, V = vocab_size

from __future__ import annotations

import gc

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.core.chain_round import packed_columns
from specdemo.core.stats import emitted_ids
from specdemo.drafters.base import Drafter, NoDrafter
from specdemo.engine.decoding import BatchDecoder, OutOfDeviceMemory
from specdemo.models import graphs, passes, pools
from specdemo.models.fixed_pass import INPUT_COLUMNS, PASS_COLUMNS, PassRunner
from specdemo.models.graphs import Program
from specdemo.models.pools import PASS_ROWS, Group, ModelPools, pools_for
from tests.helpers import TINY_VOCAB, StandIn, tiny_drafter, tiny_model

EOS: frozenset[int] = frozenset()
PROMPT = [0, 5, 9, 5, 9, 12, 7, 5, 9]
GREEDY = SamplingConfig()
PENALISED = SamplingConfig(temperature=0.8, repetition_penalty=1.2, seed=7)


@pytest.fixture
def fixed_shape(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Fixed-shape passes on the CPU, programs eager (graphs off) unless a test asks for them."""
    monkeypatch.setenv(passes.PASS_SHAPE_VARIABLE, "fixed")
    monkeypatch.setenv(graphs.GRAPHS_VARIABLE, "0")
    StandIn.captures = 0
    return monkeypatch


def text(
    target: torch.nn.Module,
    sampling: SamplingConfig = GREEDY,
    prompt: list[int] = PROMPT,
    drafter: Drafter | None = None,
) -> list:
    """One row's outcomes, decoded by the target alone (or with `drafter`): its emitted ids, or its error."""
    decoder = BatchDecoder(target, drafter or NoDrafter(), EOS)
    decoder.add(0, prompt, sampling, SpeculativeConfig(max_new_tokens=6))
    rounds = []
    while decoder.rows:
        rounds += [outcome for _, outcome in decoder.step()]
    errors = [outcome for outcome in rounds if isinstance(outcome, Exception)]
    return errors or emitted_ids(rounds)


def sized(table_bytes: int) -> Group:
    """A 256-slot group whose keys hold `table_bytes` bytes."""
    return Group(256, keys=[torch.zeros(table_bytes, dtype=torch.uint8)])


def test_a_groups_bytes_count_its_seen_rows_and_its_programs_inputs_and_outputs(fixed_shape) -> None:
    """After a round with a repetition penalty, a group holds its keys and values, a [R, V] bool seen row, and its
    round program's [R, INPUT_COLUMNS] float64 input and [R, P] float64 packed output. Planted: keys and values only."""
    target = tiny_model(1)
    text(target, PENALISED)
    [group] = pools_for(target).idle
    program_bytes = PASS_ROWS * (INPUT_COLUMNS + packed_columns(PASS_COLUMNS)) * 8
    assert group.seen is not None and len(group.programs) == 1
    assert group.buffer_bytes == PASS_ROWS * TINY_VOCAB + program_bytes
    assert group.nbytes == group.table_bytes + group.buffer_bytes > group.table_bytes > 0


def test_the_pools_budget_counts_each_groups_buffers_beside_its_keys_and_values() -> None:
    """Two 256-slot groups at 10 bytes a slot, the first holding a program of 1,000 bytes: within 6,120 bytes, and
    refused as out of memory within 6,119. Planted: the budget counts keys and values only."""
    for budget, fits in ((2 * 256 * 10 + 1000, True), (2 * 256 * 10 + 999, False)):
        pool = ModelPools(torch.device("cpu"))
        pool.limit(budget=budget, slot_bytes=10)
        first = pool.lease(256)
        first.programs["mode"] = Program(lambda x: (x,), [torch.zeros(1000, dtype=torch.uint8)])
        if fits:
            assert pool.lease(256).slots == 256
        else:
            with pytest.raises(torch.OutOfMemoryError, match=r"A group of 256 slots would take the pools past"):
                pool.lease(256)


def test_idle_groups_together_stay_within_idle_bytes_and_a_larger_group_is_not_kept(monkeypatch) -> None:
    """IDLE_BYTES of 1,000: idle groups of 400 bytes keep the newest two; one of 1,200 bytes is not kept and leaves
    the others be, its memory no longer counted. Planted: the rule that kept one idle group whatever its size."""
    monkeypatch.setattr(pools, "IDLE_BYTES", 1000)
    pool = ModelPools(torch.device("cpu"))
    small = [pool.lease(256) for _ in range(3)]
    for group in small:
        group.keys = [torch.zeros(400, dtype=torch.uint8)]
        pool.give_back(group)
    assert pool.idle == small[1:]
    large = pool.lease(512)
    large.keys = [torch.zeros(1200, dtype=torch.uint8)]
    pool.give_back(large)
    assert pool.idle == small[1:] and large not in pool.groups
    assert sum(group.nbytes for group in pool.idle) <= 1000


class OutOfMemoryAtReplay(StandIn):
    """A capture whose first run runs out of device memory."""

    def replay(self) -> tuple[torch.Tensor, ...]:
        raise torch.OutOfMemoryError("CUDA out of memory (planted at the load's round)")


def test_a_load_that_runs_out_of_memory_capturing_lets_its_groups_go_and_captures_at_first_use(fixed_shape) -> None:
    """capture_at_load out of device memory: one line saying the rounds are captured at their first use, nothing the
    load made kept, and the model decodes its text, capturing then. Planted: no catch (the load fails)."""
    fixed_shape.setenv(graphs.GRAPHS_VARIABLE, "1")
    target = tiny_model(1)
    with graphs.standing_in(OutOfMemoryAtReplay):
        line = passes.capture_at_load(target)
    assert line == (
        "The GPU ran out of memory capturing rounds as CUDA graphs at load: each is captured at its first use."
    )
    gc.collect()
    assert not pools_for(target).idle and not list(pools_for(target).groups)
    with graphs.standing_in(StandIn):
        captured = text(target)
    assert StandIn.captures == 2  # the failed load's capture, then the run's
    fixed_shape.setenv(graphs.GRAPHS_VARIABLE, "0")
    assert captured == text(tiny_model(1)) and len(captured) == 6


def out_of_memory_beside_idle_groups(monkeypatch: pytest.MonkeyPatch, target: torch.nn.Module) -> list[int]:
    """A stand-in allocator: a pass of `target` runs out of memory while any of its groups is idle (returns the count
    of passes refused)."""
    refused, forward = [], PassRunner.forward

    def allocating(runner: PassRunner, model, group, *inputs):
        if model is target and pools_for(target).idle:
            refused.append(group.slots)
            raise torch.OutOfMemoryError("CUDA out of memory (planted: idle groups fill the device)")
        return forward(runner, model, group, *inputs)

    monkeypatch.setattr(PassRunner, "forward", allocating)
    return refused


def test_a_one_row_run_that_runs_out_of_memory_beside_idle_groups_lets_them_go_and_finishes(fixed_shape) -> None:
    """A first run leaves a 256-slot group idle; a second row, of a 512-slot bucket, runs out of memory reading its
    prompt while that group is idle, and finishes with the text it decodes alone, the idle group let go for its
    round taken again. Planted: no retry (the row leaves with the sentence)."""
    target, reference = tiny_model(1), tiny_model(1)
    long_prompt = [0, *range(2, 31)] * 9  # 262 tokens: a 512-slot bucket
    expected = text(reference, prompt=long_prompt)
    assert len(text(target)) == 6 and len(pools_for(target).idle) == 1
    refused = out_of_memory_beside_idle_groups(fixed_shape, target)
    assert text(target, prompt=long_prompt) == expected and len(expected) == 6
    assert refused == [512] and [group.slots for group in pools_for(target).idle] == [512]


def test_a_sampled_row_retried_after_running_out_of_memory_draws_what_it_draws_alone(fixed_shape) -> None:
    """A row whose draft model samples its drafts from the row's generator runs out of memory after drafting; its
    retried round draws again from where the round began, so its text is the text it decodes alone. Planted: the
    generators not put back (the retry drafts from later draws)."""
    target, reference, draft = tiny_model(1), tiny_model(1), tiny_model(2)
    long_prompt = [0, *range(2, 31)] * 9  # 262 tokens: a 512-slot bucket, a group of its own
    expected = text(reference, PENALISED, long_prompt, tiny_drafter("model", draft, None))
    assert len(text(target)) == 6 and len(pools_for(target).idle) == 1
    refused = out_of_memory_beside_idle_groups(fixed_shape, target)
    assert text(target, PENALISED, long_prompt, tiny_drafter("model", draft, None)) == expected
    assert refused == [512]


def test_a_one_row_run_out_of_memory_again_after_the_retry_leaves_with_the_sentence(fixed_shape) -> None:
    """A pass that always runs out of memory: the row takes its round once more, then leaves with the sentence."""
    target, calls = tiny_model(1), []

    def refusing(*args, **kwargs):
        calls.append(1)
        raise torch.OutOfMemoryError("CUDA out of memory (planted)")

    fixed_shape.setattr(PassRunner, "forward", refusing)
    [error] = text(target)
    assert isinstance(error, OutOfDeviceMemory) and len(calls) == 2


def dynamic_rope_model() -> LlamaForCausalLM:
    """tiny_model(1)'s shape, with dynamic NTK RoPE scaling."""
    config = LlamaConfig(**{**tiny_model(1).config.to_dict(), "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    torch.manual_seed(1)
    return LlamaForCausalLM(config).to(torch.float64).eval()


DYNAMIC_LINE = (
    "The model scales RoPE dynamically (rope_type 'dynamic'), which reads values back from the GPU inside its pass: "
    "rounds run eagerly, without CUDA graphs."
)


def test_a_model_with_dynamic_rope_is_marked_eager_at_load_and_decodes_its_eager_text(fixed_shape) -> None:
    """Graphs asked for, a stand-in capture: the load's line says why rounds run eagerly, and neither the load nor a
    run tries a capture; the run's text is the text with graphs off. Planted: no RoPE check (the load captures)."""
    fixed_shape.setenv(graphs.GRAPHS_VARIABLE, "1")
    target = dynamic_rope_model()
    assert passes.host_read_rope_type(target.config) == "dynamic"
    with graphs.standing_in(StandIn):
        assert passes.capture_at_load(target) == DYNAMIC_LINE
        decoded = text(target)
    assert StandIn.captures == 0
    fixed_shape.setenv(graphs.GRAPHS_VARIABLE, "0")
    assert decoded == text(dynamic_rope_model()) and len(decoded) == 6


def test_under_strict_graphs_dynamic_rope_fails_its_capture_check_and_the_load_names_why(fixed_shape) -> None:
    """SPECDEMO_CUDA_GRAPHS=strict on the CPU (CheckedProgram): a dynamic-RoPE model's round does read back to the
    host inside its pass (transformers compares its positions' maximum with the cached length), so its capture
    fails; at load the model is refused with the reason before any capture, not run eagerly."""
    fixed_shape.setenv(graphs.GRAPHS_VARIABLE, "strict")
    with pytest.raises(graphs.CaptureFailed, match=r"__bool__\(\) reads a value back to the host"):
        text(dynamic_rope_model())
    with pytest.raises(graphs.CaptureFailed, match=r"the model scales RoPE dynamically \(rope_type 'dynamic'\)"):
        passes.capture_at_load(dynamic_rope_model())
