"""float16, the number format of GPUs without native bfloat16 (a T4, compute 7.5), dry-run on the CPU: auto picks it
under a simulated pre-Ampere GPU, greedy speculative text is target-only text for every drafter kind (tree passes,
and the GPU's fixed-shape passes), and sampled two-token sequences follow the target-only distribution."""

# V = vocab_size

from __future__ import annotations

import copy

import pytest
import torch

from specdemo.audit import chi_square_pvalue, tv_distance
from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.core.sampling import build_warpers, logits_to_probs
from specdemo.core.stats import emitted_ids
from specdemo.drafters import ModelDrafter
from specdemo.engine.decoding import speculative_generate
from specdemo.models import passes
from specdemo.models.loading import dtype_reason, pick_device, resolve_dtype
from tests.helpers import TINY_VOCAB, seeded_runs, tiny_drafter, tiny_model

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
EOS = frozenset([1])  # the tiny models' eos_token_id
PROMPTS = {  # one repeats (prompt lookup finds n-grams), one reaches EOS
    "repeats": [0, 5, 9, 5, 9, 12, 7, 5, 9],
    "eos": [0, 10, 19, 5, 21, 5, 13, 13, 21, 4, 4, 7, 4, 4],
}
KINDS = ("ngram", "suffix", "model", "recurrent", "hybrid")


def simulate_gpu(monkeypatch, major: int, minor: int) -> None:
    """A CUDA GPU of compute capability major.minor as torch reports it; bfloat16 only emulated before 8.0."""
    monkeypatch.delenv("SPECDEMO_DEVICE", raising=False)
    monkeypatch.delenv("SPACES_ZERO_GPU", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, minor))
    monkeypatch.setattr(
        torch.cuda, "is_bf16_supported", lambda including_emulation=True: major >= 8 or including_emulation
    )


def test_auto_picks_float16_on_a_gpu_without_native_bfloat16_and_refuses_bfloat16_there(monkeypatch):
    simulate_gpu(monkeypatch, 7, 5)  # a T4
    device = pick_device()
    assert device == CUDA
    assert resolve_dtype("auto", device) == torch.float16
    assert dtype_reason("auto", device) == "float16 (auto: this GPU (compute 7.5) has no native bfloat16)"
    assert resolve_dtype("float16", device) == torch.float16 and dtype_reason("float16", device) == "float16 (chosen)"
    assert resolve_dtype("float32", device) == torch.float32
    with pytest.raises(
        ValueError,
        match=r"^This GPU \(compute 7\.5\) has no native bfloat16 \(it needs compute 8\.0 or newer\), so bfloat16 "
        r"would run in software and be slow: use float16, or auto, which picks float16 on this GPU\.$",
    ):
        resolve_dtype("bfloat16", device)
    simulate_gpu(monkeypatch, 8, 0)  # an A100: bfloat16 in hardware
    assert resolve_dtype("auto", device) == torch.bfloat16 and dtype_reason("auto", device) == "bfloat16 (auto: CUDA)"
    assert resolve_dtype("bfloat16", device) == torch.bfloat16


def test_float16_is_offered_on_the_cpu_but_never_picked_there():
    """The CPU has float16 matrix products, so a GPU's float16 run can be dry-run here; auto keeps float32 or
    bfloat16."""
    assert resolve_dtype("float16", CPU) == torch.float16
    assert resolve_dtype("auto", CPU) in {torch.float32, torch.bfloat16}


@pytest.fixture(scope="module")
def float16_models(tiny_trained_head):
    """tiny_target, tiny_draft and the head trained on tiny_target, in float16."""
    target = tiny_model(1).half()  # tiny_target's weights, rounded
    draft = tiny_model(2, num_layers=1).half()
    head = copy.deepcopy(tiny_trained_head).to(torch.float16)  # as load_head puts it in the target's format
    return target, draft, head


def greedy_texts(target, drafter_for, spec: SpeculativeConfig) -> tuple[dict[str, list[int]], int]:
    """Each prompt's greedy tokens with a fresh drafter from `drafter_for()`, and the drafts accepted in all."""
    texts, accepted = {}, 0
    for name, prompt in PROMPTS.items():
        rounds = list(speculative_generate(target, drafter_for(), torch.tensor([prompt]), SamplingConfig(), spec, EOS))
        texts[name] = emitted_ids(rounds)
        accepted += sum(round_.num_accepted for round_ in rounds)
    return texts, accepted


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_speculative_text_is_target_only_text_in_float16(float16_models, kind):
    """On the CPU's tree passes: every drafter kind's greedy text equals the target alone's, bit for bit."""
    target, draft, head = float16_models
    assert target.dtype == torch.float16
    spec = SpeculativeConfig(num_draft_tokens=4, max_new_tokens=40)
    alone, _ = greedy_texts(target, lambda: tiny_drafter("none", None, None), spec)
    assert alone["eos"][-1] in EOS and len(alone["repeats"]) == 40  # EOS handling is compared too
    texts, accepted = greedy_texts(target, lambda: tiny_drafter(kind, draft, head), spec)
    assert texts == alone, kind
    assert accepted > 0, f"{kind}: nothing was accepted, so verification was not exercised"


@pytest.mark.parametrize("kind", ["model", "hybrid"])
def test_greedy_speculative_text_is_target_only_text_in_float16_with_the_gpus_fixed_shapes(
    float16_models, kind, monkeypatch
):
    """The GPU's path dry-run: fixed-shape passes, three candidates a round, float16; a draft model, and the hybrid
    (suffix copy and the recurrent head, which reads the target's float16 hidden states)."""
    monkeypatch.setenv(passes.PASS_SHAPE_VARIABLE, "fixed")
    target, draft, head = float16_models
    spec = SpeculativeConfig(num_draft_tokens=4, max_new_tokens=24, num_candidates=3)
    alone, _ = greedy_texts(target, lambda: tiny_drafter("none", None, None), spec)
    texts, accepted = greedy_texts(target, lambda: tiny_drafter(kind, draft, head), spec)
    assert texts == alone, kind
    assert accepted > 0, f"{kind}: nothing was accepted"


def exact_two_token_probs(model, prompt: list[int], sampling: SamplingConfig) -> torch.Tensor:  # [V*V] float64
    """The target-only probability of every two-token continuation (first * V + second), from float32 probabilities of
    the float16 model's logits, with uncached passes."""
    warpers = build_warpers(sampling)
    with torch.inference_mode():
        context = torch.tensor([prompt])  # [1, T]
        first = logits_to_probs(model(context).logits[:, -1:], context, sampling, warpers)[0, 0].double()  # [V]
        contexts = torch.cat([context.repeat(TINY_VOCAB, 1), torch.arange(TINY_VOCAB)[:, None]], dim=1)  # [V, T+1]
        second = logits_to_probs(model(contexts).logits[:, -1:], contexts, sampling, warpers)[:, 0].double()  # [V, V]
    return (first[:, None] * second).flatten()


def test_sampled_two_token_sequences_follow_the_target_only_distribution_in_float16(float16_models):
    """Many seeds: the first two tokens of speculative decoding in float16 (one drafted token, from a draft model
    sampling at its own temperature, then the bonus or the resampled token) are distributed as target-only
    decoding's two tokens, over all 8 x 8 sequences top-k leaves."""
    target, draft, _ = float16_models
    num_runs = 3000
    sampling = SamplingConfig(temperature=1.0, top_k=8)
    exact = exact_two_token_probs(target, PROMPTS["repeats"], sampling)  # [V*V]
    assert int((exact > 0).sum()) == 64
    spec = SpeculativeConfig(num_draft_tokens=1, max_new_tokens=2)
    drafter = ModelDrafter(draft, SamplingConfig(temperature=0.7), TINY_VOCAB)
    counts = torch.zeros(TINY_VOCAB * TINY_VOCAB, dtype=torch.float64)
    outcomes = {"bonus": 0, "resampled": 0}
    for rounds in seeded_runs(target, drafter, torch.tensor([PROMPTS["repeats"]]), sampling, spec, num_runs):
        first, second = emitted_ids(rounds)
        counts[first * TINY_VOCAB + second] += 1
        outcomes[rounds[0].next_kind] += 1
    # guards: the drafted token was accepted (then the bonus) and rejected (then a resample) often enough to matter
    assert min(outcomes.values()) > num_runs // 10, outcomes
    assert counts[exact == 0].sum() == 0, "a sequence the target gives p = 0 was emitted"
    assert chi_square_pvalue(counts, exact) > 1e-4
    assert tv_distance(counts, exact) < 0.08
