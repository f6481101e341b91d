"""On a GPU (`make test-gpu`): bfloat16 loading, greedy parity up to near-ties, the sampler with CUDA generators,
the app's streaming and a throughput table. SPECDEMO_GPU_TEST_DEVICE=cpu runs the whole file on the CPU, a dry run."""

# B = batch, K = num_draft_tokens, V = vocab_size, N = rows in the statistical test

from __future__ import annotations

import copy
import json
import os
import platform
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from specdemo.audit import chi_square_pvalue, tv_distance
from specdemo.bench.prompts import PROMPTS
from specdemo.bench.single import run_bench
from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.core.stats import emitted_ids, run_stats
from specdemo.core.verify import rejection_sample
from specdemo.drafters import ModelDrafter, NgramDrafter
from specdemo.engine.decoding import autoregressive_generate, speculative_generate
from specdemo.models.loading import OFFLINE_DEFAULT, LoadedModel, chat_prompt_ids, load_model, resolve_dtype
from tests.app_helpers import SPELLING, launched_app
from tests.helpers import TINY_VOCAB, hf_greedy, tiny_model

DEVICE_VARIABLE = "SPECDEMO_GPU_TEST_DEVICE"
DEVICE = torch.device(os.environ.get(DEVICE_VARIABLE) or "cuda")
DTYPE = resolve_dtype(
    "auto", DEVICE
)  # what load_model gives: bfloat16 on CUDA (Ampere or newer), often float32 on a CPU
ON_CUDA = DEVICE.type == "cuda"
NEAR_TIE = 0.05  # a top-2 logit gap (float32 forward) this small may flip between a K+1 pass and one-token steps
MAX_NEW_TOKENS = 48 if ON_CUDA else 16  # the CPU dry run only checks the code paths
TINY_PROMPT = [0, 10, 19, 5, 21, 5, 13, 13, 21]  # repeats, so prompt lookup proposes; float64 greedy reaches EOS
TINY_EOS = frozenset([1])  # tiny_model's eos_token_id
ARTIFACT = Path(__file__).resolve().parent.parent / "test-artifacts" / "gpu.json"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        ON_CUDA and not torch.cuda.is_available(), reason=f"no CUDA device (dry run on the CPU: {DEVICE_VARIABLE}=cpu)"
    ),
]


@pytest.fixture(autouse=True)
def only_when_selected(request):
    """GPU work runs under `make test-gpu` only, never as part of `make test` on a machine that has a GPU."""
    if request.config.getoption("markexpr") != "gpu":
        pytest.skip("GPU tests run only when selected: make test-gpu (pytest -m gpu)")


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(OFFLINE_DEFAULT, device=DEVICE)


def tiny_on_device(seed: int, num_layers: int = 2) -> PreTrainedModel:
    return tiny_model(seed, num_layers=num_layers).to(DEVICE, DTYPE)


def test_offline_default_and_tiny_models_load_on_the_device(loaded):
    assert loaded.device == DEVICE and loaded.model.dtype == DTYPE
    assert {parameter.device.type for parameter in loaded.model.parameters()} == {DEVICE.type}
    tiny = tiny_on_device(1)
    assert tiny.device.type == DEVICE.type and tiny.dtype == DTYPE


# --- greedy parity up to near-ties -------------------------------------------------------------------------------


def assert_same_up_to_a_near_tie(model: PreTrainedModel, prompt_ids: torch.Tensor, expected: list, actual: list):
    """Identical, or the first difference sits where the target's top two tokens are within NEAR_TIE in a float32
    forward (both chosen tokens that close to the maximum), as reduced precision can flip an argmax there."""
    first = next((i for i, (a, b) in enumerate(zip(expected, actual, strict=False)) if a != b), None)
    if first is None:
        assert len(expected) == len(actual), f"same tokens, but {len(expected)} against {len(actual)}"
        return
    prefix = torch.cat([prompt_ids, torch.tensor([expected[:first]], device=prompt_ids.device)], dim=1)
    with torch.inference_mode():
        logits = copy.deepcopy(model).float()(input_ids=prefix).logits[0, -1]  # [V] float32
    gap = float(logits.max() - logits[[expected[first], actual[first]]].min())
    assert gap < NEAR_TIE, f"token {first}: {expected[first]} against {actual[first]}, top-2 logit gap {gap:.4f}"


def test_the_near_tie_check_refuses_a_real_difference():
    model, prompt_ids = tiny_on_device(1), torch.tensor([TINY_PROMPT], device=DEVICE)
    baseline = emitted_ids(list(autoregressive_generate(model, prompt_ids, SamplingConfig(), 8, TINY_EOS)))
    prefix = torch.cat([prompt_ids, torch.tensor([baseline[:3]], device=DEVICE)], dim=1)
    with torch.inference_mode():
        least_likely = int(model(input_ids=prefix).logits[0, -1].argmin())
    with pytest.raises(AssertionError, match="top-2 logit gap"):
        assert_same_up_to_a_near_tie(model, prompt_ids, baseline, [*baseline[:3], least_likely, *baseline[4:]])


PARITY_CASES = ["offline+ngram", "offline+self", "tiny+tiny-draft", "tiny+ngram"]


@pytest.mark.parametrize("case", PARITY_CASES)
def test_greedy_parity_speculative_target_only_and_generate(loaded, case):
    greedy = SamplingConfig()
    speculative = SpeculativeConfig(num_draft_tokens=5, max_new_tokens=MAX_NEW_TOKENS)
    if case.startswith("offline"):
        model, eos, vocab_size = loaded.model, loaded.eos_token_ids, loaded.vocab_size
        prompt_ids = chat_prompt_ids(loaded, SPELLING)  # [1, T]
    else:
        model, eos, vocab_size = tiny_on_device(1), TINY_EOS, TINY_VOCAB
        prompt_ids = torch.tensor([TINY_PROMPT], device=DEVICE)
    drafter = {
        "ngram": lambda: NgramDrafter(),
        "self": lambda: ModelDrafter(model, greedy, vocab_size),
        "tiny-draft": lambda: ModelDrafter(tiny_on_device(2, num_layers=1), greedy, vocab_size),
    }[case.split("+")[1]]()
    rounds = list(speculative_generate(model, drafter, prompt_ids, greedy, speculative, eos))
    baseline = emitted_ids(list(autoregressive_generate(model, prompt_ids, greedy, MAX_NEW_TOKENS, eos)))
    assert run_stats(rounds).num_drafted > 0, "nothing was drafted: verification was not exercised"
    assert_same_up_to_a_near_tie(model, prompt_ids, baseline, emitted_ids(rounds))
    assert_same_up_to_a_near_tie(model, prompt_ids, baseline, hf_greedy(model, prompt_ids, MAX_NEW_TOKENS, eos))


# --- the rejection sampler with device generators -------------------------------------------------------------------


def device_setting(num_draft_tokens: int, vocab_size: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """target_probs [K+1, V] and draft_probs [K, V] on DEVICE, differing per position, with p = 0 < q and
    q = 0 < p tokens."""
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    target_logits = 1.5 * torch.randn(num_draft_tokens + 1, vocab_size, generator=generator, device=DEVICE)
    noise = 0.5 * torch.randn(num_draft_tokens, vocab_size, generator=generator, device=DEVICE)
    target_probs = target_logits.softmax(dim=-1)  # [K+1, V]
    draft_probs = (target_logits[:num_draft_tokens] + noise).softmax(dim=-1)  # [K, V]
    least_likely = target_probs[:num_draft_tokens].argsort(dim=-1)  # [K, V]
    positions = torch.arange(num_draft_tokens, device=DEVICE)
    target_probs[positions, least_likely[:, 0]] = 0.0  # p = 0 < q
    draft_probs[positions, least_likely[:, 1]] = 0.0  # q = 0 < p
    return target_probs / target_probs.sum(-1, keepdim=True), draft_probs / draft_probs.sum(-1, keepdim=True)


def test_rejection_sample_with_device_generators_follows_the_target():
    num_draft_tokens, num_rows = 3, 100_000
    target_probs, draft_probs = device_setting(num_draft_tokens)
    vocab_size = target_probs.shape[-1]
    generator = torch.Generator(device=DEVICE).manual_seed(1)
    draft_token_ids = torch.multinomial(draft_probs, num_rows, replacement=True, generator=generator).T  # [N, K]
    result = rejection_sample(
        draft_token_ids,
        draft_probs.expand(num_rows, -1, -1),
        target_probs.expand(num_rows, -1, -1),
        generator=generator,
    )
    assert result.uniforms.device.type == DEVICE.type and result.uniforms.dtype == torch.float64
    assert set(result.num_accepted.tolist()) == set(range(num_draft_tokens + 1))
    for position in range(num_draft_tokens + 1):
        emitted = result.token_ids[result.num_accepted >= position, position]  # accepted there, or the last token
        counts = torch.bincount(emitted, minlength=vocab_size).cpu()  # [V]
        probs = target_probs[position].cpu()
        assert int(counts[probs == 0].sum()) == 0, f"position {position}: emitted a token with p = 0"
        assert tv_distance(counts, probs) < 0.01, f"position {position}"
        assert chi_square_pvalue(counts, probs) > 1e-4, f"position {position}"


def test_rejection_sample_with_one_device_generator_per_row_equals_each_row_alone():
    target_probs, draft_probs = device_setting(num_draft_tokens=4)
    batch_size = 6
    draft_token_ids = torch.multinomial(
        draft_probs, batch_size, replacement=True, generator=torch.Generator(device=DEVICE).manual_seed(2)
    ).T  # [B, K]

    def run(rows: slice) -> torch.Tensor:  # [rows, K+1]
        generators = [torch.Generator(device=DEVICE).manual_seed(100 + row) for row in range(batch_size)[rows]]
        ids = draft_token_ids[rows]
        expanded = (draft_probs.expand(ids.shape[0], -1, -1), target_probs.expand(ids.shape[0], -1, -1))
        return rejection_sample(ids, *expanded, generator=generators).token_ids

    batched = run(slice(None))
    for row in range(batch_size):
        assert torch.equal(batched[row : row + 1], run(slice(row, row + 1))), row


# --- the app, streaming from the device -------------------------------------------------------------------------


def test_app_streams_a_run_from_the_device(loaded):
    from gradio_client import Client

    with launched_app(loaded) as (url, _):
        updates = list(Client(url, verbose=False).submit(prompt=SPELLING, max_new_tokens=24, api_name="/generate"))
    with_tokens = [update for update in updates if "tok-" in update[0]]
    assert len(with_tokens) >= 2, f"{len(updates)} updates, {len(with_tokens)} with tokens: nothing streamed"
    with open(updates[-1][6]["value"]) as handle:  # the last update carries the trace: the run completed
        trace = json.load(handle)
    assert trace["stats"]["num_generated"] > 0
    assert f"on {DEVICE.type}" in trace["device"]


# --- throughput -------------------------------------------------------------------------------------------------


def test_throughput_table(loaded, capsys):
    """Target-only against speculative (prompt lookup), with HF generate and HF prompt lookup as the peers:
    greedy, interleaved repeats, medians; printed and written to test-artifacts/gpu.json."""
    prompts = PROMPTS if ON_CUDA else PROMPTS[:1]
    speculative = SpeculativeConfig(max_new_tokens=128 if ON_CUDA else 12)
    with capsys.disabled():
        results = run_bench(loaded, None, speculative, repeats=5 if ON_CUDA else 2, prompts=prompts, log=print)
    results["device_name"] = torch.cuda.get_device_name(DEVICE) if ON_CUDA else platform.processor() or "cpu"
    ARTIFACT.parent.mkdir(exist_ok=True)
    ARTIFACT.write_text(json.dumps(results, indent=1))
    assert len(results["rows"]) == len(prompts) and results["date"]
    for row in results["rows"]:
        assert row["new_tokens"] > 0 and min(row["tokens_per_second"].values()) > 0, row["prompt"]
