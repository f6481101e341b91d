"""The pair registry, loading pairs through the cache, and refusing pairs that cannot work."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from specdemo.cli.main import main
from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.drafters.registry import DRAFTER_KINDS, NGRAM
from specdemo.engine.decoding import speculative_generate
from specdemo.engine.setup import fitting_pairs, load_pair, make_drafter, pair_marks
from specdemo.models.fitting import MODEL_SHAPES, PARAMETER_COUNTS
from specdemo.models.loading import (
    MEMORY_HEADROOM,
    OFFLINE_DEFAULT,
    LoadedModel,
    chat_prompt_ids,
    check_model_name,
    gated_on_hub,
    load_config,
    load_model,
    weight_bytes,
)
from specdemo.models.offline import OFFLINE_MODELS, package_dir
from specdemo.models.shared import ModelCache
from specdemo.pairs import DEFAULT_PAIR, PAIRS, PAIRS_BY_KEY, custom_pair, find_pair
from tests.helpers import save_tiny_model, tiny_model, word_tokenizer
from tests.models.test_float16 import simulate_gpu

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
T4_MEMORY = 15_828_320_256  # what torch.cuda.mem_get_info reports as a T4's total


def test_registry_is_well_formed():
    assert len({pair.key for pair in PAIRS}) == len(PAIRS)
    assert not DEFAULT_PAIR.needs_hub and DEFAULT_PAIR.drafter == NGRAM
    for pair in PAIRS:
        assert pair.label and pair.note.endswith((".", ")")), pair.key
        assert pair.suggested_hardware in {"cpu", "gpu"}
        for name in (pair.target, pair.drafter):
            if name not in DRAFTER_KINDS:
                check_model_name(name, allow_local=False)  # every name is valid where the app takes it
        offline = pair.target in OFFLINE_MODELS and pair.drafter in {*OFFLINE_MODELS, *DRAFTER_KINDS}
        assert pair.needs_hub == (not offline), pair.key
        assert None not in pair.parameter_counts.values(), f"{pair.key}: add its models to PARAMETER_COUNTS"
        assert all(name in MODEL_SHAPES for name in pair.model_names), f"{pair.key}: add its models to MODEL_SHAPES"
        assert pair.gated == any(gated_on_hub(name) for name in pair.model_names), pair.key
    assert {pair.key for pair in PAIRS if not pair.needs_hub} >= {
        "smollm2-135m-ngram",
        "smollm2-135m-suffix",
        "smollm2-135m-self",
    }


OFFLINE_PAIRS = [pair for pair in PAIRS if not pair.needs_hub]


@pytest.mark.parametrize("pair", OFFLINE_PAIRS, ids=lambda pair: pair.key)
def test_every_offline_pair_loads_and_runs_a_round(pair, offline_model):
    if package_dir(OFFLINE_MODELS[pair.target]) is None:
        pytest.skip(f"{pair.target}: optional package not installed ({OFFLINE_MODELS[pair.target].install})")
    cache = ModelCache(pinned=offline_model.name)
    cache.put(offline_model)  # the session's already-loaded default
    target, draft = load_pair(pair, cache, device=torch.device("cpu"))
    spec = SpeculativeConfig(num_draft_tokens=3, max_new_tokens=4, draft_temperature=pair.draft_temperature)
    drafter = make_drafter(pair, target, draft)
    prompt_ids = chat_prompt_ids(target, "Repeat after me: one two three, one two three.")
    first = next(speculative_generate(target.model, drafter, prompt_ids, SamplingConfig(), spec, target.eos_token_ids))
    assert 1 <= len(first.emitted_token_ids) <= 4
    if pair.uses_draft_model:
        assert len(first.draft_token_ids) == 3 and draft is target  # one copy of the model serves both roles


def test_unknown_pair_names_the_choices():
    with pytest.raises(ValueError, match=r"Unknown pair 'fastest'.*smollm2-135m-ngram"):
        find_pair("fastest")


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("", "The model name is empty"),
        ("gpt2", "is not a valid model id"),
        ("owner/name/extra", "looks like a file path"),
        ("../etc/passwd", "looks like a file path"),
        ("/home/user/model", "looks like a file path"),
        ("~/models/x", "looks like a file path"),
        ("owner/na me", "is not a valid model id"),
        ("owner/<script>", "is not a valid model id"),
        ("-owner/name", "is not a valid model id"),
    ],
)
def test_malformed_and_path_like_ids_are_refused(name, message):
    with pytest.raises(ValueError, match=message):
        custom_pair(name, NGRAM)


def test_local_directories_only_when_allowed(tmp_path):
    with pytest.raises(ValueError, match="looks like a file path"):
        check_model_name(str(tmp_path), allow_local=False)
    check_model_name(str(tmp_path), allow_local=True)


def test_tokenizer_check_accepts_a_shared_vocabulary_and_refuses_another(tmp_path):
    words = ["<unk>", "</s>", "the", "cat", "sat", "on", "a", "mat"]
    same = word_tokenizer(words)
    shuffled = word_tokenizer([words[0], words[1], *reversed(words[2:])])
    target_dir = save_tiny_model(tmp_path / "target", same, seed=0)
    draft_dir = save_tiny_model(tmp_path / "draft", same, seed=1)
    other_dir = save_tiny_model(tmp_path / "other", shuffled, seed=2)
    cache = ModelCache()
    target, draft = load_pair(custom_pair(str(target_dir), str(draft_dir), allow_local=True), cache, allow_local=True)
    assert draft is not None and draft.model is not target.model
    with pytest.raises(ValueError, match=r"cannot draft for .*tokenizers differ .*n-gram drafter"):
        load_pair(custom_pair(str(target_dir), str(other_dir), allow_local=True), cache, allow_local=True)
    assert str(target_dir) in cache.models  # the refusal leaves the loaded models in place


def test_remote_code_models_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "my-custom-arch",
                "architectures": ["XModel"],
                "auto_map": {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XModel"},
            }
        )
    )
    with pytest.raises(ValueError, match=r"needs custom code from its repository .*never runs"):
        load_model(str(tmp_path))


def test_a_model_too_large_for_free_memory_is_refused_before_loading(tmp_path, monkeypatch):
    directory = save_tiny_model(tmp_path / "model", word_tokenizer(["<unk>", "</s>", "a"]), seed=0)
    monkeypatch.setattr("specdemo.models.loading.free_memory_bytes", lambda device: 1000)
    with pytest.raises(ValueError, match=r"needs about 0\.0 GB for its weights but only 0\.0 GB is free on cpu"):
        load_model(str(directory))


def test_hub_loading_works_from_a_snapshot_with_hf_hub_offline(tmp_path):
    """The Hub code path, without a network: a cache laid out as huggingface_hub writes it."""
    snapshot = tmp_path / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / "0123abcd"
    save_tiny_model(snapshot, word_tokenizer(["<unk>", "</s>", "hello", "world"]), seed=0)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0123abcd")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    script = (  # one process (an import of specdemo each costs seconds): the snapshot loads, then a missing model
        "from specdemo.models.loading import load_model; m = load_model('tiny-org/tiny-llama', allow_local=False); "
        "print(m.vocab_size, m.tokenizer.decode([2, 3]), flush=True); "
        "load_model('tiny-org/no-such-model', allow_local=False)"
    )
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert completed.stdout.split() == ["4", "hello", "world"], completed.stderr[-2000:]
    assert completed.returncode != 0
    assert "Could not load 'tiny-org/no-such-model'" in completed.stderr and "offline, use" in completed.stderr


def test_cli_lists_the_pairs(capsys):
    assert main(["pairs"]) == 0
    listing = capsys.readouterr().out
    for pair in PAIRS:
        assert pair.key in listing


def test_a_pair_too_large_together_is_refused_before_either_loads(tmp_path, monkeypatch):
    """Each model would fit alone, the two together not: one sentence naming what they need and what is free, and
    nothing loaded."""
    words = word_tokenizer(["<unk>", "</s>", "a", "b"])
    target, draft = save_tiny_model(tmp_path / "target", words, seed=0), save_tiny_model(tmp_path / "draft", words, 1)
    size = weight_bytes(load_config(str(target), str(target)), torch.float32)
    monkeypatch.setattr("specdemo.models.shared.free_memory_bytes", lambda device: int(1.5 * size / MEMORY_HEADROOM))
    cache = ModelCache()
    pair = custom_pair(str(target), str(draft), allow_local=True)
    with pytest.raises(
        ValueError,
        match=r"needs about .* kB in float32 for its weights \(.* and .*\), more than the .* kB usable of the .* kB "
        r"free on this CPU once idle models are unloaded: pick a pair that fits \(smollm2-135m-ngram, .*\)",
    ):
        load_pair(pair, cache, device=torch.device("cpu"), allow_local=True, dtype=torch.float32)
    assert not cache.models
    monkeypatch.setattr("specdemo.models.shared.free_memory_bytes", lambda device: int(2.5 * size / MEMORY_HEADROOM))
    _, loaded_draft = load_pair(pair, cache, device=torch.device("cpu"), allow_local=True)
    assert loaded_draft is not None and set(cache.models) == {str(target), str(draft)}


def test_the_offline_models_parameter_counts_are_those_loaded(offline_model):
    """PARAMETER_COUNTS against what loads here: SmolLM2-135M (a tied embedding, counted once) and, when its package
    is installed, Gemma 3 270M, counted on its config."""
    count = PARAMETER_COUNTS[OFFLINE_DEFAULT]
    assert offline_model.model.num_parameters() == count == PARAMETER_COUNTS["HuggingFaceTB/SmolLM2-135M-Instruct"]
    assert weight_bytes(offline_model.model.config, torch.bfloat16) == 2 * count
    gemma = OFFLINE_MODELS["gemma-3-270m"]
    if package_dir(gemma) is not None:
        from specdemo.models.loading import resolve_source

        config = load_config(gemma.name, resolve_source(gemma.name, print))
        assert weight_bytes(config, torch.float32) == 4 * PARAMETER_COUNTS[gemma.name]


class TinyLoader:
    """Stands in for load_model: the tiny float32 model named, on the CPU, counting loads."""

    def __init__(self, names: list[str]) -> None:
        self.tokenizer = word_tokenizer(["<unk>", "</s>", "a", "b"])
        self.models = {name: tiny_model(seed, num_layers=1).float() for seed, name in enumerate(names)}
        self.loads: list[str] = []

    def __call__(self, name: str, progress, device=None, allow_local=False, dtype=None) -> LoadedModel:
        self.loads.append(name)
        return LoadedModel(name, self.models[name], self.tokenizer, CPU)


def simulate_memory(monkeypatch, cache: ModelCache, total: int) -> None:
    """A device of `total` bytes whose free memory is what the models the cache holds leave."""
    free = lambda device: total - sum(loaded.weights_bytes for loaded in cache.models.values())  # noqa: E731
    monkeypatch.setattr("specdemo.models.shared.free_memory_bytes", free)
    monkeypatch.setattr("specdemo.models.fitting.device_memory", lambda device: (free(device), total))


def test_a_pair_that_fits_only_without_the_last_one_evicts_it_and_loads(monkeypatch):
    """Load pair A, then pair B, which fits only once A is gone: A's idle models are evicted before the check, not
    after a load that never comes, and B loads. The cache's capacity alone would keep all four."""
    names = ["org/a-target", "org/a-draft", "org/b-target", "org/b-draft"]
    loader = TinyLoader(names)
    for name, model in loader.models.items():
        monkeypatch.setitem(PARAMETER_COUNTS, name, model.num_parameters())
    size = max(model.get_memory_footprint() for model in loader.models.values())
    cache = ModelCache(loader, capacity=10)
    simulate_memory(monkeypatch, cache, int(3.2 * size))  # a pair takes 2 sizes of the 2.56 usable; two pairs: no
    pair_a, pair_b = custom_pair(names[0], names[1]), custom_pair(names[2], names[3])
    load_pair(pair_a, cache, device=CPU, dtype=torch.float32)
    assert list(cache.models) == names[:2]
    target, draft = load_pair(pair_b, cache, device=CPU, dtype=torch.float32)
    assert (target.name, draft.name) == (names[2], names[3]) and list(cache.models) == names[2:]
    assert loader.loads == names
    monkeypatch.setitem(PARAMETER_COUNTS, "org/huge", 3 * PARAMETER_COUNTS[names[0]])  # never fits: evicts nothing
    with pytest.raises(
        ValueError, match=r"of this CPU's .* kB: run it on a machine with a larger GPU \(no listed pair"
    ):
        load_pair(custom_pair("org/huge", NGRAM), cache, device=CPU, dtype=torch.float32)
    assert list(cache.models) == names[2:]


def test_a_pair_too_big_for_the_device_is_refused_naming_the_memory_and_the_pairs_that_fit(monkeypatch):
    """Llama 3.1 8B with its 1B draft on a T4 in float16: 22.5 GB even at its smallest limits, 18.5 GB of it weights,
    more than the 12.7 GB its plan may take of the 15.8 GB; refused before anything loads, in one sentence naming the
    biggest term and the pairs that do fit."""
    simulate_gpu(monkeypatch, 7, 5)
    monkeypatch.setenv("HF_TOKEN", "hf_a_token_of_an_account_that_accepted_the_licence")
    cache = ModelCache(lambda *args, **options: pytest.fail("loaded a pair that does not fit"))
    simulate_memory(monkeypatch, cache, T4_MEMORY)
    fitting = ", ".join(key for key in PAIRS_BY_KEY if key not in {"qwen2.5-0.5b-7b", "llama-3.2-1b-3.1-8b"})
    with pytest.raises(ValueError) as refused:
        load_pair(find_pair("llama-3.2-1b-3.1-8b"), cache, device=CUDA, dtype=torch.float16)
    assert str(refused.value) == (
        "The pair 'llama-3.2-1b-3.1-8b' needs about 22.5 GB in float16 even at its smallest limits, the most for "
        "weights (meta-llama/Llama-3.1-8B-Instruct 16.1 GB and meta-llama/Llama-3.2-1B-Instruct 2.5 GB), more than "
        f"the 12.7 GB usable of this GPU's 15.8 GB: pick a pair that fits ({fitting}), or run it on a machine with a "
        "larger GPU."
    )
    assert [pair.key for pair in fitting_pairs(CUDA, torch.float16)] == fitting.split(", ")
    assert "qwen2.5-0.5b-7b" not in [pair.key for pair in fitting_pairs(CUDA, torch.float32)]


def without_a_token(monkeypatch) -> None:
    for variable in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr("specdemo.models.loading.get_token", lambda: None)  # no login on this machine either


def test_a_gated_pair_without_a_token_is_refused_before_loading_and_marked(monkeypatch):
    without_a_token(monkeypatch)
    cache = ModelCache(lambda *args, **options: pytest.fail("loaded a gated pair without a token"))
    with pytest.raises(ValueError) as refused:
        load_pair(find_pair("llama-3.2-1b-3.1-8b"), cache, device=CPU)
    assert str(refused.value) == (
        "'meta-llama/Llama-3.1-8B-Instruct' and 'meta-llama/Llama-3.2-1B-Instruct' are gated on the Hub: accept "
        "their licences on their model pages and set HF_TOKEN (a Space secret) to a token of that account, or pick "
        "another pair."
    )
    with pytest.raises(ValueError, match=r"^'google/gemma-3-1b-it' and 'google/gemma-3-270m-it' are gated on the"):
        load_pair(find_pair("gemma-3-270m-1b"), cache, device=CPU)
    custom = custom_pair("meta-llama/Llama-3.2-1B-Instruct", NGRAM)
    assert custom.gated
    with pytest.raises(ValueError, match=r"^'meta-llama/Llama-3.2-1B-Instruct' is gated on the Hub: accept its "):
        load_pair(custom, cache, device=CPU)
    gated = {key for key, mark in pair_marks(CPU).items() if mark.endswith(" — gated: needs HF_TOKEN")}
    assert gated == {"llama-3.2-1b-3.1-8b", "gemma-3-270m-1b"}
    monkeypatch.setenv("HF_TOKEN", "hf_a_token")  # past the gate: to the memory check, then the loader
    simulate_memory(monkeypatch, ModelCache(), 10**15)
    with pytest.raises(pytest.fail.Exception, match="loaded a gated pair"):
        load_pair(find_pair("gemma-3-270m-1b"), cache, device=CPU)
    assert not any(mark.endswith("HF_TOKEN") for mark in pair_marks(CPU).values())


def test_pairs_too_big_for_the_device_are_marked_in_the_format_auto_picks(monkeypatch, capsys):
    """A T4: auto is float16 there (float32 for Qwen2.5 and Gemma 3, which overflow in float16), and the pairs of 7B
    and 8B are marked with their biggest term; in the CLI's list too, its columns as they were."""
    simulate_gpu(monkeypatch, 7, 5)
    monkeypatch.setenv("HF_TOKEN", "hf_a_token")
    monkeypatch.setattr("specdemo.models.fitting.device_memory", lambda device: (T4_MEMORY, T4_MEMORY))
    marks = pair_marks(CUDA)
    assert {key: mark for key, mark in marks.items() if mark} == {
        "qwen2.5-0.5b-7b": " — too big for this GPU in float32, which Qwen2 and Qwen2.5 need here (float16 overflows): "
        "needs 36.3 GB, 12.7 GB usable (the most for weights: 32.5 GB)",
        "llama-3.2-1b-3.1-8b": " — too big for this GPU: needs 22.5 GB, 12.7 GB usable (the most for weights: 18.5 GB)",
    }
    assert main(["pairs"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["key", "network", "hardware", "label"]
    llama = next(line for line in lines if line.startswith("llama-3.2-1b-3.1-8b "))
    assert llama.split()[:3] == ["llama-3.2-1b-3.1-8b", "Hub", "gpu"]
    assert llama.endswith(
        "Llama-3.2-1B → Llama-3.1-8B-Instruct — too big for this GPU: needs 22.5 GB, 12.7 GB usable (the most for "
        "weights: 18.5 GB)"
    )


def test_a_pair_that_fits_a_t4_only_within_limits_says_them_and_holds_its_groups_to_its_plan(monkeypatch):
    """SmolLM2-1.7B with its 135M draft on a T4 (float16): weights 3.7 GB, and one group of 2,048 slots (3.2 GB) where
    the settings would ask eight of 8,192 (103 GB): offered, the page's limits line says so, and a loaded pair holds
    the target's groups to the plan."""
    from specdemo.engine.setup import limits_line, pair_plan
    from specdemo.models.pools import _LIMITS

    simulate_gpu(monkeypatch, 7, 5)
    monkeypatch.setattr("specdemo.models.fitting.device_memory", lambda device: (T4_MEMORY, T4_MEMORY))
    pair = find_pair("smollm2-135m-1.7b")
    plan = pair_plan(pair, CUDA, torch.float16)
    assert plan.fits and not plan.full and (plan.limits.slots, plan.limits.groups) == (2048, 1)
    assert plan.terms["keys and values"] == 3_221_225_472 and plan.biggest == "weights"
    assert limits_line(pair, CUDA, torch.float16) == (
        "On this GPU this pair holds rows of at most 2,047 tokens (prompt and new tokens) and 8 chain rows at once "
        "(runs × candidates)"
    )
    assert limits_line(find_pair("smollm2-135m-ngram"), CPU, torch.float32) is None
    cache = ModelCache(TinyLoader([pair.target, pair.drafter]), capacity=4)
    simulate_memory(monkeypatch, cache, T4_MEMORY)
    monkeypatch.setattr("specdemo.models.fitting.uses_fixed_shape", lambda device: True)
    monkeypatch.setattr("specdemo.engine.setup.uses_fixed_shape", lambda device: True)
    target, _ = load_pair(pair, cache, device=CUDA, dtype=torch.float16)
    tiny = target.model.config  # R rows of keys and values per layer, Hkv heads of d, in float32 as it loaded
    head_dim = tiny.hidden_size // tiny.num_attention_heads
    assert _LIMITS[target.model][1] == 8 * tiny.num_hidden_layers * 2 * tiny.num_key_value_heads * head_dim * 4
