"""Memory planned, not hoped: the shapes the plans use, the plans against what the passes allocate on the meta device
with each model's real shape, every listed pair on four simulated devices, the pools held to a plan, and the number
format auto picks for a family that overflows in float16."""

# R = PASS_ROWS chain rows of a group, K = num_draft_tokens, W = candidates per row

from __future__ import annotations

import functools
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from benchmarks.memory import DEVICES, device_dtype, plans, table
from specdemo.config import MAX_NUM_DRAFT_TOKENS
from specdemo.engine.costs import MEASURED_GROUPS, MEASURED_SLOTS, SHARED_CONTEXT_TOKENS
from specdemo.engine.scheduler import MAX_BATCH_ROWS
from specdemo.engine.setup import RUN_SETTINGS, plan_pair
from specdemo.models.fitting import MODEL_SHAPES, PARAMETER_COUNTS
from specdemo.models.fixed_shape import FixedShapeModel
from specdemo.models.layout import RowRequest
from specdemo.models.memory import Device, MemoryPlan, RunLimits
from specdemo.models.pools import PASS_ROWS, ModelPools, limit_pools, pools_for
from specdemo.pairs import PAIRS, find_pair

FAMILIES = {  # model -> (model_type, tied embedding), as each config.json says
    "HuggingFaceTB/SmolLM2-135M-Instruct": ("llama", True),
    "HuggingFaceTB/SmolLM2-360M-Instruct": ("llama", True),
    "HuggingFaceTB/SmolLM2-1.7B-Instruct": ("llama", True),
    "Qwen/Qwen2.5-0.5B-Instruct": ("qwen2", True),
    "Qwen/Qwen2.5-1.5B-Instruct": ("qwen2", True),
    "Qwen/Qwen2.5-7B-Instruct": ("qwen2", False),
    "meta-llama/Llama-3.2-1B-Instruct": ("llama", True),
    "meta-llama/Llama-3.1-8B-Instruct": ("llama", False),
    "google/gemma-3-270m-it": ("gemma3_text", True),
    "google/gemma-3-1b-it": ("gemma3_text", True),
}
FAMILIES |= {"smollm2-135m-instruct": FAMILIES["HuggingFaceTB/SmolLM2-135M-Instruct"], "gemma-3-270m": FAMILIES[
    "google/gemma-3-270m-it"]}  # fmt: skip


@functools.cache
def meta_model(name: str, dtype: torch.dtype, layers: int | None = None) -> PreTrainedModel:
    """The model built from MODEL_SHAPES on the meta device: its real shapes, no memory; `layers` of them (None:
    all)."""
    shape, (model_type, tied) = MODEL_SHAPES[name], FAMILIES[name]
    config = AutoConfig.for_model(
        model_type,
        num_hidden_layers=layers or shape.layers,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_attention_heads=shape.attention_heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        vocab_size=shape.vocab_size,
        max_position_embeddings=shape.context,
        tie_word_embeddings=tied,
    )
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config).to(dtype).eval()


class LiveBytes(TorchDispatchMode):
    """A stand-in allocator: the bytes of every storage an op makes, alive until the storage dies, and their peak.
    Storages that existed before (the weights) are not counted, nor views and in-place results of them."""

    def __init__(self, known: list[torch.Tensor]) -> None:
        super().__init__()
        self.seen = {id(tensor.untyped_storage()) for tensor in known}
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and id(storage := tensor.untyped_storage()) not in self.seen:
                self.seen.add(id(storage))
                self.live += storage.nbytes()
                weakref.finalize(storage, self._died, id(storage), storage.nbytes())
        self.peak = max(self.peak, self.live)
        return out

    def _died(self, key: int, size: int) -> None:
        self.seen.discard(key)
        self.live -= size


def rows_of(count: int, capacity: int, candidates: int, long_first: bool) -> dict[int, RowRequest]:
    """`count` rows of `capacity` tokens, each with `candidates` drafts of K tokens; the first reads a prompt that
    fills its row (the largest read pass) where asked, the others none (a one-token sequence)."""
    draft = [[1] * MAX_NUM_DRAFT_TOKENS] * candidates
    trunk = capacity - MAX_NUM_DRAFT_TOKENS if long_first else 1
    return {row: RowRequest([0] * (trunk if row == 0 else 1), draft, "all", capacity) for row in range(count)}


@functools.cache
def counted_bytes(target_name: str, dtype: torch.dtype, limits: RunLimits, pool_bytes: int | None) -> int:
    """What the target's passes allocate with its real shape, counted on the meta device and held to `pool_bytes` as
    a loaded pair is (None: no limit): the load-time measurement (a decoder of one row and one of a full batch, rows
    of MEASURED_SLOTS - 1 tokens), its groups then idle, then MAX_BATCH_ROWS runs at the largest settings the limits
    allow, the first reading a prompt that fills its row. One layer runs (meta kernels are slow Python); every
    layer's keys and values are the same shape, so the other layers' are added for every group alive at the end, as
    if at the peak (which can only count more)."""
    shape = MODEL_SHAPES[target_name]
    model = meta_model(target_name, dtype, layers=1)
    limit_pools(model, 2**62 if pool_bytes is None else pool_bytes, shape.group_bytes(1, dtype))
    counter = LiveBytes([*model.parameters(), *model.buffers()])
    with counter:
        for count in (1, MAX_BATCH_ROWS):
            measuring = FixedShapeModel(model)
            measuring.logits(rows_of(count, MEASURED_SLOTS - 1, 1, long_first=False))
            assert {g.slots for g in measuring.leased} == {MEASURED_SLOTS}, count
            for row in range(count):
                measuring.drop(row)
        runs = FixedShapeModel(model)
        runs.logits(rows_of(MAX_BATCH_ROWS, limits.tokens, limits.chains // MAX_BATCH_ROWS, long_first=True))
        assert len(runs.leased) == limits.groups and {g.slots for g in runs.leased} == {limits.slots}
        other_layers = (shape.layers - 1) * sum(group.table_bytes for group in pools_for(model).groups)
    for row in range(MAX_BATCH_ROWS):
        runs.drop(row)
    pools_for(model).forget_idle()
    return counter.peak + other_layers


def weights_bytes(plan_names: list[str], dtype: torch.dtype) -> int:
    return sum(PARAMETER_COUNTS[name] for name in plan_names) * dtype.itemsize


@pytest.mark.parametrize("name", sorted(MODEL_SHAPES))
def test_each_shape_builds_a_model_of_its_listed_parameters(name):
    """MODEL_SHAPES against PARAMETER_COUNTS: built on the meta device, each model has its listed parameters (the
    model cards' counts, rounded: within 1%); SmolLM2-135M's exactly (counted on its config)."""
    built = meta_model(name, torch.bfloat16).num_parameters()
    assert built == pytest.approx(PARAMETER_COUNTS[name], rel=0.01), (name, built)
    if "135M" in name or name == "smollm2-135m-instruct":
        assert built == PARAMETER_COUNTS[name]


def test_a_groups_bytes_are_what_its_pass_allocates():
    """The largest term, exactly: the groups a pass over eight rows of three candidates leases on the meta device
    with SmolLM2-1.7B's shape hold ModelShape.group_bytes each."""
    name, dtype = "HuggingFaceTB/SmolLM2-1.7B-Instruct", torch.float16
    passes = FixedShapeModel(meta_model(name, dtype))
    passes.logits(rows_of(MAX_BATCH_ROWS, 2047, 3, long_first=False))
    assert len(passes.leased) == 3 and {g.slots for g in passes.leased} == {2048}
    assert (
        [g.table_bytes for g in passes.leased]
        == [MODEL_SHAPES[name].group_bytes(2048, dtype)] * 3
        == [3_221_225_472] * 3
    )
    for row in range(MAX_BATCH_ROWS):
        passes.drop(row)
    pools_for(passes.model).forget_idle()


def fitting_pairs_exceeding(plan_for) -> list[str]:
    """Per simulated device, the pairs `plan_for` marks as fitting whose measurement and eight runs at the largest
    settings it allows take more than the device's bytes (weights + what the target's passes allocate, counted on
    meta), or more than the plan's terms for them (all but the draft model's keys and values)."""
    failures = []
    for device in DEVICES:
        for pair in PAIRS:
            dtype = device_dtype(pair, device)
            plan = plan_for(pair, device, dtype)
            if not plan.fits:
                continue
            pool_bytes = plan.pool_bytes or None
            used = weights_bytes(pair.model_names, dtype) + counted_bytes(pair.target, dtype, plan.limits, pool_bytes)
            if used > device.total_bytes:
                failures.append(f"{device.name}: {pair.key} takes {used:,} bytes of {device.total_bytes:,}")
            elif used > plan.needed - plan.terms.get("draft keys and values", 0):
                failures.append(f"{device.name}: {pair.key} takes {used:,} bytes, more than its plan's terms")
    return failures


def test_every_pair_offered_on_a_simulated_device_runs_its_measurement_and_eight_runs_within_its_bytes():
    """A T4, an A10G, ZeroGPU's half Blackwell and an H200 slice: each pair the plan offers runs its load-time
    measurement and eight runs at the largest settings its limits allow within the device's bytes, counted with a
    stand-in allocator on the meta device with the models' real shapes."""
    assert fitting_pairs_exceeding(plan_pair) == []
    offered = {(device.name, pair.key) for device, pair, _, plan in plans() if plan.fits}
    assert ("T4", "smollm2-135m-1.7b") in offered and ("T4", "llama-3.2-1b-3.1-8b") not in offered


def weights_only(pair, device: Device, dtype: torch.dtype) -> MemoryPlan:
    """The check before plans: weights against the usable share, runs at the settings' own limits."""
    plan = plan_pair(pair, device, dtype)
    full = RunLimits(8192, RUN_SETTINGS.rows * RUN_SETTINGS.candidates // PASS_ROWS)
    weights = {"weights": plan.terms["weights"]}  # pool_bytes 0: no pools budget, as before plans
    return MemoryPlan(weights, plan.usable, full, True)


def test_counting_weights_only_offers_the_t4_pairs_it_cannot_hold():
    """The test above can fail: with the weights-only check, the T4 offers SmolLM2-1.7B at the settings' own limits,
    and eight runs of 8,191 tokens with eight candidates each take eight 12.9 GB groups."""
    failures = fitting_pairs_exceeding(weights_only)
    t4 = [failure for failure in failures if failure.startswith("T4: smollm2-135m-1.7b takes ")]
    assert t4 and int(t4[0].split()[3].replace(",", "")) > 8 * 12.9e9, failures


def test_the_memory_table_names_each_device_and_pair():
    """python -m benchmarks.memory: every simulated device and pair, its figures and whether it is offered."""
    lines = table().splitlines()
    assert len(lines) == 1 + len(DEVICES) * len(PAIRS)
    t4 = next(line for line in lines if line.startswith("T4 ") and " smollm2-135m-1.7b " in line)
    assert t4.split()[2:] == ["float16", "10.6", "GB", "12.9", "GB", "weights", "3.7", "GB", "2,047", "8", "yes,",
                              "limited"]  # fmt: skip


def test_the_pools_hold_their_groups_to_the_plan_idle_ones_going_first():
    """A budget of 1,536 slots: the oldest idle group goes to make room for a larger one; past the budget a group is
    refused as the device would refuse it; a group no one holds any more is not counted."""
    pools = ModelPools(torch.device("cpu"))
    pools.limit(budget=3 * 512 * 10, slot_bytes=10)
    first, second = pools.lease(512), pools.lease(512)
    pools.give_back(first)
    pools.give_back(second)
    assert pools.idle == [first, second]
    del first
    wide = pools.lease(1024)  # 512 + 512 idle + 1024 > 1536: the oldest idle goes
    assert pools.idle == [second] and wide.slots == 1024
    assert pools.lease(512) is second and pools.idle == []  # an idle group of the slots asked is reused
    with pytest.raises(torch.OutOfMemoryError, match=r"A group of 512 slots would take the pools past the 15,360"):
        pools.lease(512)
    del second
    assert pools.lease(512).slots == 512


def test_auto_picks_float32_for_qwen_on_a_pre_ampere_gpu_and_refuses_it_where_float32_does_not_fit(monkeypatch):
    """A simulated compute-7.5 GPU of a T4's bytes: Qwen2.5 and Gemma 3 run in float32 (float16 overflows there),
    SmolLM2 and Llama in float16; the format line says why; Qwen2.5-7B in float32 does not fit: marked with a
    sentence naming the format. On an Ampere GPU auto is bfloat16 for all."""
    from specdemo.engine.setup import pair_marks
    from specdemo.models.loading import dtype_reason, model_dtype_reason, resolve_dtype
    from specdemo.pairs import pair_dtype
    from tests.models.test_float16 import simulate_gpu

    simulate_gpu(monkeypatch, 7, 5)
    monkeypatch.setenv("HF_TOKEN", "hf_a_token")
    monkeypatch.setattr("specdemo.models.fitting.device_memory", lambda device: (DEVICES[0].total_bytes,) * 2)
    cuda = torch.device("cuda")
    assert resolve_dtype("auto", cuda) == torch.float16  # existing callers: unchanged
    qwen = find_pair("qwen2.5-0.5b-1.5b")
    assert pair_dtype(qwen, "auto", cuda) == torch.float32 == pair_dtype(find_pair("gemma-3-270m-1b"), "auto", cuda)
    assert pair_dtype(find_pair("smollm2-135m-1.7b"), "auto", cuda) == torch.float16
    assert pair_dtype(qwen, "float16", cuda) == torch.float16  # a format named is the user's
    assert model_dtype_reason("auto", cuda, qwen.model_names) == (
        "float32 (auto: this GPU (compute 7.5) has no native bfloat16, and Qwen2 and Qwen2.5 overflow in float16)"
    )
    assert model_dtype_reason("auto", cuda, ["HuggingFaceTB/SmolLM2-1.7B-Instruct"]) == dtype_reason("auto", cuda)
    marks = pair_marks(cuda)
    assert marks["qwen2.5-0.5b-1.5b"] == ""
    assert marks["qwen2.5-0.5b-7b"] == (
        " — too big for this GPU in float32, which Qwen2 and Qwen2.5 need here (float16 overflows): needs 36.3 GB, "
        "12.9 GB usable (the most for weights: 32.5 GB)"
    )
    simulate_gpu(monkeypatch, 8, 6)
    assert {pair_dtype(pair, "auto", cuda) for pair in PAIRS} == {torch.bfloat16}


def test_the_measurement_at_load_holds_groups_of_its_own_slots_only(monkeypatch):
    """engine/costs.py on fixed-shape passes (forced on the CPU, a tiny model): its rows stay in MEASURED_SLOTS
    buckets, MEASURED_GROUPS groups at once, and give them back to the pools when done."""
    from specdemo.engine.costs import measure_round_seconds
    from specdemo.models import passes
    from tests.helpers import tiny_model

    monkeypatch.setenv(passes.PASS_SHAPE_VARIABLE, "fixed")
    model = tiny_model(0).float()
    leased = []
    lease = ModelPools.lease
    monkeypatch.setattr(ModelPools, "lease", lambda self, slots: leased.append(slots) or lease(self, slots))
    measure_round_seconds(model, (1, 17), SHARED_CONTEXT_TOKENS, 1, rows=(1, MAX_BATCH_ROWS))
    assert leased == [MEASURED_SLOTS] * MEASURED_GROUPS
    assert [group.slots for group in pools_for(model).idle] == [MEASURED_SLOTS] * MEASURED_GROUPS
