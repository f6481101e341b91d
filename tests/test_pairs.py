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
from specdemo.drafters.registry import DRAFTER_KINDS
from specdemo.engine.decoding import speculative_generate
from specdemo.models.loading import (
    MEMORY_HEADROOM,
    chat_prompt_ids,
    check_model_name,
    load_config,
    load_model,
    weight_bytes,
)
from specdemo.models.offline import OFFLINE_MODELS, package_dir
from specdemo.models.shared import ModelCache
from specdemo.pairs import DEFAULT_PAIR, NGRAM, PAIRS, custom_pair, find_pair, load_pair, make_drafter
from tests.helpers import save_tiny_model, word_tokenizer


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
    script = (
        "from specdemo.models.loading import load_model; m = load_model('tiny-org/tiny-llama', allow_local=False); "
        "print(m.vocab_size, m.tokenizer.decode([2, 3]))"
    )
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert completed.stdout.split() == ["4", "hello", "world"]
    missing = script.replace("tiny-llama", "no-such-model")
    completed = subprocess.run([sys.executable, "-c", missing], capture_output=True, text=True, env=env, timeout=120)
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
    monkeypatch.setattr("specdemo.pairs.free_memory_bytes", lambda device: int(1.5 * size / MEMORY_HEADROOM))
    cache = ModelCache()
    pair = custom_pair(str(target), str(draft), allow_local=True)
    with pytest.raises(ValueError, match=r"needs about .* kB for its weights \(.* and .*\) but only .* kB is free on"):
        load_pair(pair, cache, device=torch.device("cpu"), allow_local=True, dtype=torch.float32)
    assert not cache.models
    monkeypatch.setattr("specdemo.pairs.free_memory_bytes", lambda device: int(2.5 * size / MEMORY_HEADROOM))
    _, loaded_draft = load_pair(pair, cache, device=torch.device("cpu"), allow_local=True)
    assert loaded_draft is not None and set(cache.models) == {str(target), str(draft)}
