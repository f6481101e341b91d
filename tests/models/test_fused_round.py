"""Fused rounds (models/fusion.py) on the CPU with the GPU's path forced: fixed-shape passes, graphs asked for, and
each capture a stand-in that runs its program three times first, as CUDA's do. Fused programs against unfused ones on
one tiny model, whose pass and rules each compile once for the module (inductor, g++ on this CPU)."""

# R = chain rows, n = columns of a pass, K = num_draft_tokens

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.core.chain_round import ENTRIES, HEAD_COLUMNS, VIEW_COLUMNS, Layout, chain_verdict, packed_columns
from specdemo.core.rules import STANDARD
from specdemo.core.stats import emitted_ids
from specdemo.core.verdicts import Overflowed, RoundAsk, RowVerdict
from specdemo.drafters.base import Drafter, NoDrafter
from specdemo.drafters.suffix import SuffixDrafter
from specdemo.engine.decoding import BatchDecoder
from specdemo.models import fixed_shape, fusion, graphs, passes, platform
from specdemo.models.fixed_pass import INPUT_COLUMNS, PASS_COLUMNS, staging_for, write_row
from specdemo.models.fixed_shape import FixedShapeModel
from specdemo.models.graphs import CaptureFailed
from specdemo.models.pools import pools_for
from tests.engine.test_batch import PROMPTS
from tests.helpers import FREE, WarmingStandIn, tiny_model

EOS: frozenset[int] = frozenset()
SAMPLED = [  # one group, one mode: sampled with a penalty
    SamplingConfig(temperature=0.8, top_p=0.9, repetition_penalty=1.2, seed=7),
    SamplingConfig(temperature=1.0, top_k=5, seed=8),
    SamplingConfig(temperature=0.7, top_k=8, top_p=0.8, repetition_penalty=1.3, seed=9),
]


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return tiny_model(1, num_layers=1)


@pytest.fixture
def gpu_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """The GPU's path on the CPU: fixed-shape passes, graphs asked for, captures that warm up as CUDA's do."""
    monkeypatch.setenv(passes.PASS_SHAPE_VARIABLE, "fixed")
    monkeypatch.setenv(graphs.GRAPHS_VARIABLE, "1")
    with graphs.standing_in(WarmingStandIn):
        yield monkeypatch


def decode(
    monkeypatch: pytest.MonkeyPatch,
    target: torch.nn.Module,
    fused: bool,
    settings: list[SamplingConfig],
    prompts: list[list[int]] | None = None,
    drafter: Drafter | None = None,
    spec: SpeculativeConfig | None = None,
) -> tuple[dict[int, list[int]], list[np.ndarray]]:
    """Each row's text, fused or not, and every packed row the rounds read back, in order."""
    monkeypatch.setenv(fusion.FUSED_VARIABLE, "1" if fused else "0")
    packed: list[np.ndarray] = []

    def read(row: np.ndarray, ask: RoundAsk, width: int) -> RowVerdict | Overflowed:
        packed.append(row.copy())
        return chain_verdict(row, ask, width)

    decoder = BatchDecoder(target, drafter or NoDrafter(), EOS)
    for row, sampling in enumerate(settings):
        decoder.add(row, (prompts or PROMPTS)[row], sampling, spec or SpeculativeConfig(max_new_tokens=10))
    rounds: dict[int, list] = {row: [] for row in range(len(settings))}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fixed_shape, "chain_verdict", read)
        while decoder.rows:
            for row, round_ in decoder.step():
                rounds[row].append(round_)
    return {row: emitted_ids(found) for row, found in rounds.items()}, packed


def token_columns(packed: np.ndarray) -> np.ndarray:  # [P] float64 -> the tokens and counts a packed row holds
    """Accepted count, next token, non-finite columns, and the ids of every position's inspector entries."""
    views = HEAD_COLUMNS + 4 * (PASS_COLUMNS - 1)
    ids = [views + j * VIEW_COLUMNS + np.arange(ENTRIES) for j in range(PASS_COLUMNS)]
    return packed[np.concatenate([[0, 1, 3, 4], *ids])]


def test_fused_greedy_rounds_read_back_the_unfused_tokens(gpu_path: pytest.MonkeyPatch, target) -> None:
    """Target-only and the suffix drafter at K = 16, greedy: the fused rounds' packed rows hold the unfused ones'
    tokens, every float bit for bit (greedy p is one-hot), and the text is the same. Planted: the fused pass writing
    its keys and values into copies of the tables."""
    text = PROMPTS[0] + PROMPTS[0]
    for drafter, spec in ((None, None), (SuffixDrafter(lambda n: FREE, cache_tokens=0), SpeculativeConfig(16, 24))):
        runs = [decode(gpu_path, target, fused, [SamplingConfig()], [text], drafter, spec) for fused in (False, True)]
        (eager_text, eager_packed), (fused_text, fused_packed) = runs
        assert fused_text == eager_text
        assert len(fused_packed) == len(eager_packed)
        for eager, fused in zip(eager_packed, fused_packed, strict=True):
            assert np.array_equal(token_columns(fused), token_columns(eager))
            assert np.array_equal(fused, eager)
    assert {("pass", (), 256), ("rule", (), False, False, False, True, False, 1)} <= {
        mode for mode, _ in fusion.compiles(target)
    }


def test_fused_sampled_rounds_give_each_seed_its_unfused_text(gpu_path: pytest.MonkeyPatch, target) -> None:
    """Rows with temperature, top-p, top-k and repetition penalties in one group: the same text for each seed fused
    and unfused, the same tokens in every packed row, and p and q within float32 rounding. Planted: the fused rule not
    given the seen rows."""
    (eager_text, eager_packed), (fused_text, fused_packed) = (
        decode(gpu_path, target, fused, SAMPLED) for fused in (False, True)
    )
    assert fused_text == eager_text
    for eager, fused in zip(eager_packed, fused_packed, strict=True):
        assert np.array_equal(token_columns(fused), token_columns(eager))
        np.testing.assert_allclose(fused, eager, rtol=1e-5, atol=1e-6)


def test_fused_coupled_rounds_give_each_seed_its_unfused_text(gpu_path: pytest.MonkeyPatch, target) -> None:
    """Coupled rows (the noise's integer hash, the Gumbel-max choice and the choices' entries compiled) beside a
    standard one in one group, with the suffix drafter at K = 16: the same text for each seed fused and unfused, the
    same tokens in every packed row, and the floats within float32 rounding. Planted: the fused rule compiled for the
    standard rule alone (round_rule given coupled=False)."""
    settings = [replace(sampling, rule="coupled") for sampling in SAMPLED[:2]] + [SAMPLED[2]]
    prompts = [PROMPTS[0] + PROMPTS[0], PROMPTS[1] + PROMPTS[1], PROMPTS[0]]
    drafter, spec = SuffixDrafter(lambda n: FREE, cache_tokens=0), SpeculativeConfig(16, 12)
    (eager_text, eager_packed), (fused_text, fused_packed) = (
        decode(gpu_path, target, fused, settings, prompts, drafter, spec) for fused in (False, True)
    )
    assert fused_text == eager_text
    for eager, fused in zip(eager_packed, fused_packed, strict=True):
        assert np.array_equal(token_columns(fused), token_columns(eager))
        np.testing.assert_allclose(fused, eager, rtol=1e-5, atol=1e-6)


def test_the_round_program_runs_the_pass_programs_pass(gpu_path: pytest.MonkeyPatch, target) -> None:
    """The pass a round program runs (on the round's input buffer) is the pass program's compiled graph, and gives its
    logits bit for bit: the engine's identity (a token's logits the same in a pass of W candidates and in a round)
    holds fused. Planted: the pass program left unfused."""
    gpu_path.setenv(fusion.FUSED_VARIABLE, "1")
    verifier = FixedShapeModel(target)
    with torch.inference_mode():
        verifier.decide({"row": RoundAsk(PROMPTS[0], [[5, 9]], 32, SamplingConfig(), STANDARD, 0, 0, 0)})
        group = verifier.rows["row"].chains[0].group
        inputs = torch.zeros(8, INPUT_COLUMNS, dtype=torch.float64)
        inputs[0, :3] = torch.tensor([9.0, 5, 9])
        inputs[0, PASS_COLUMNS : PASS_COLUMNS + 3] = inputs[0, 2 * PASS_COLUMNS : 2 * PASS_COLUMNS + 3] = (
            torch.arange(3.0) + len(PROMPTS[0]) - 1
        )
        inputs[0, 3 * PASS_COLUMNS : 3 * PASS_COLUMNS + 3] = 1
        inputs[1:, 2 * PASS_COLUMNS : 3 * PASS_COLUMNS] = group.slots - 1
        (from_pass,) = verifier.runner.group_pass(group, inputs[:, : 4 * PASS_COLUMNS].clone())
        compiled = counters["stats"]["unique_graphs"]
        from_round, _ = verifier.runner.chain_pass(group, inputs)
        assert counters["stats"]["unique_graphs"] == compiled  # the same graph, not one compiled for the round
        gpu_path.setenv(fusion.FUSED_VARIABLE, "0")
        (unfused,) = verifier.runner.group_pass(group, inputs[:, : 4 * PASS_COLUMNS].clone())
    assert torch.equal(from_round, from_pass)
    torch.testing.assert_close(from_pass, unfused, rtol=1e-5, atol=1e-6)  # the model's norms run in float32
    verifier.drop("row")


def test_a_new_decoder_or_group_compiles_nothing(gpu_path: pytest.MonkeyPatch, target) -> None:
    """A second decoder (its row in the kept group), then new groups of the same slots: one whose first pass is fused
    (a one-token prompt reads nothing, so a pass that writes the scratch slot makes its tables), one whose prompt is
    read first. No graph is compiled again, and each new group's text is the unfused text. Planted: the compiled pass
    closing over the first group's tables."""
    first, _ = decode(gpu_path, target, True, [SamplingConfig()])
    graphs_before, compiles_before = counters["stats"]["unique_graphs"], fusion.compiles(target)
    again, _ = decode(gpu_path, target, True, [SamplingConfig()])
    assert again == first
    for prompt in ([7], [11, 7, 3]):
        pools_for(target).forget_idle()
        new_group, _ = decode(gpu_path, target, True, [SamplingConfig()], [prompt])
        assert new_group == decode(gpu_path, target, False, [SamplingConfig()], [prompt])[0], prompt
    assert counters["stats"]["unique_graphs"] == graphs_before
    assert fusion.compiles(target) == compiles_before


def failing_compile(function: object, **options: object) -> object:
    def compiled(*args: object) -> object:
        raise RuntimeError("planted: inductor could not compile")

    return compiled


def test_a_compile_that_fails_leaves_the_rounds_unfused(gpu_path: pytest.MonkeyPatch, caplog) -> None:
    """A compile that fails: one line in the log, the model's rounds unfused from then on, the unfused text; under
    strict graphs, CaptureFailed. Planted: the model not marked unfused (a line per mode and round); strict graphs
    not raising."""
    target = tiny_model(1, num_layers=1)
    unfused, _ = decode(gpu_path, target, False, [SamplingConfig()])
    gpu_path.setattr(torch, "compile", failing_compile)
    with caplog.at_level(logging.WARNING, logger=fusion.__name__):
        fused, _ = decode(gpu_path, target, True, [SamplingConfig()])
    assert fused == unfused
    assert [record.getMessage() for record in caplog.records if record.name == fusion.__name__] == [
        "specdemo: rounds run unfused: compiling ('pass', (), 256) failed (planted: inductor could not compile)"
    ]
    assert fusion.compile_seconds(target) == 0.0

    strict = tiny_model(1, num_layers=1)
    gpu_path.setattr(torch, "compile", failing_compile)
    gpu_path.setenv(graphs.GRAPHS_VARIABLE, "strict")
    gpu_path.setenv(fusion.FUSED_VARIABLE, "1")
    decoder = BatchDecoder(strict, NoDrafter(), EOS)
    decoder.add(0, PROMPTS[0], SamplingConfig(), SpeculativeConfig(max_new_tokens=4))
    with pytest.raises(CaptureFailed, match="fuse"):
        decoder.step()


def test_fusion_is_on_where_rounds_are_captured_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset: fused where CUDA graphs capture rounds on CUDA, but not on ZeroGPU; "1" and "0" force it either way."""
    monkeypatch.delenv(fusion.FUSED_VARIABLE, raising=False)
    monkeypatch.delenv(graphs.GRAPHS_VARIABLE, raising=False)
    monkeypatch.delenv(platform.ZERO_GPU_VARIABLE, raising=False)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert fusion.uses_fusion(cuda) and not fusion.uses_fusion(cpu)
    monkeypatch.setenv(platform.ZERO_GPU_VARIABLE, "true")
    assert not fusion.uses_fusion(cuda)
    monkeypatch.delenv(platform.ZERO_GPU_VARIABLE)
    monkeypatch.setenv(graphs.GRAPHS_VARIABLE, "0")
    assert not fusion.uses_fusion(cuda)
    monkeypatch.setenv(fusion.FUSED_VARIABLE, "1")
    assert fusion.uses_fusion(cpu)
    monkeypatch.setenv(fusion.FUSED_VARIABLE, "0")
    monkeypatch.setenv(graphs.GRAPHS_VARIABLE, "1")
    assert not fusion.uses_fusion(cuda)


def test_a_round_without_the_inspectors_entries_decides_the_same(gpu_path: pytest.MonkeyPatch) -> None:
    """A round program that leaves the inspector's entries out (no row shows them) packs the same decisions, sampled
    with a penalty and a drafted token, and zeros where the entries would be."""
    gpu_path.setenv(fusion.FUSED_VARIABLE, "0")
    verifier = FixedShapeModel(tiny_model(1, num_layers=1))
    sampling = SAMPLED[0]
    request = RoundAsk(PROMPTS[0], [[5, 9]], 32, sampling, STANDARD, 3, 0, 0)
    with torch.inference_mode():
        verifier.decide({"row": request})
        chain = verifier.rows["row"].chains[0]
        staging = staging_for(chain.group, packed_columns(PASS_COLUMNS), verifier.device)
        staging.write[:] = staging.blank
        write_row(staging.write[chain.local], request)
        seen = chain.group.seen.clone()
        packed = {}
        for views in (True, False):
            chain.group.seen.copy_(seen)
            (packed[views],) = verifier.runner.group_round(chain.group, True, True, staging.inputs, views=views)
    rule, ids = HEAD_COLUMNS + 4 * (PASS_COLUMNS - 1), Layout(PASS_COLUMNS - 1, 1).ids
    for part in (slice(0, rule), slice(ids, None)):  # the rule's columns and the drafted ids
        assert torch.equal(packed[False][:, part], packed[True][:, part])
    assert not packed[False][:, rule:ids].any() and packed[True][:, rule:ids].any()


def test_the_loads_progress_line_counts_the_compiles_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    """capture_at_load's line says how much of its time went to compiling fused kernels (models/fusion.py's record),
    and says nothing of compiling where nothing compiled."""
    monkeypatch.setenv(passes.PASS_SHAPE_VARIABLE, "fixed")
    monkeypatch.setenv(graphs.GRAPHS_VARIABLE, "1")
    monkeypatch.setenv(fusion.FUSED_VARIABLE, "0")
    seconds = iter([3.0, 15.5])  # compiled before the load, then after it
    monkeypatch.setattr(fusion, "compile_seconds", lambda model: next(seconds))
    with graphs.standing_in(WarmingStandIn):
        line = passes.capture_at_load(tiny_model(1))
        assert line.endswith(", 12.5 s of it compiling fused kernels."), line
        monkeypatch.setattr(fusion, "compile_seconds", lambda model: 0.0)
        assert "compiling" not in passes.capture_at_load(tiny_model(2))
