"""What a Hugging Face Space builds from: README.md's front matter and requirements.txt agree with the code and with
the local set-up, and hold what ZeroGPU supports (docs/serving.md, Spaces and ZeroGPU)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

from specdemo.app.serving.zerogpu import DEFAULT_PAIRS
from specdemo.models.offline import OFFLINE_MODELS
from specdemo.pairs import PAIRS_BY_KEY

ROOT = Path(__file__).resolve().parents[1]
ZEROGPU_TORCH = ("2.8.0", "2.9.1", "2.10.0", "2.11.0")  # the versions ZeroGPU's documentation lists as supported
ZEROGPU_PYTHON = ("3.10", "3.12")
PRELOADED_FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}


def pins(name: str) -> dict[str, str]:
    lines = (ROOT / name).read_text().splitlines()
    found = (re.match(r"^([A-Za-z0-9_.-]+)==([^\s#]+)", line) for line in lines)
    return {match[1].lower(): match[2] for match in found if match}


def front_matter() -> dict:
    return yaml.safe_load((ROOT / "README.md").read_text().split("---")[1])


def hub_id(name: str) -> str:
    return OFFLINE_MODELS[name].hub_id if name in OFFLINE_MODELS else name


def test_the_space_and_the_local_set_up_pin_the_same_versions_but_torch():
    space, local = pins("requirements.txt"), pins("requirements-local.txt")
    shared = set(space) - {"torch"}
    assert shared and {name: space[name] for name in shared} == {name: local.get(name) for name in shared}


def test_the_space_installs_a_torch_zerogpu_supports_built_for_cuda_12():
    version, _, build = pins("requirements.txt")["torch"].partition("+")
    assert version in ZEROGPU_TORCH and re.fullmatch(r"cu12\d", build), (version, build)
    assert f"--extra-index-url https://download.pytorch.org/whl/{build}" in (ROOT / "requirements.txt").read_text()
    assert front_matter()["python_version"] in ZEROGPU_PYTHON


def test_the_space_preloads_the_zerogpu_pairs_models_files_and_no_gated_model():
    preloaded = {}
    for entry in front_matter()["preload_from_hub"]:
        repo, _, files = entry.partition(" ")
        preloaded[repo] = set(files.split(","))
    pairs = [PAIRS_BY_KEY[key] for key in DEFAULT_PAIRS]
    names = {hub_id(name) for pair in pairs for name in (pair.target, pair.drafter) if "/" in hub_id(name)}
    assert names <= set(preloaded), names - set(preloaded)
    assert all(PRELOADED_FILES <= files for files in preloaded.values())  # a file list, not the whole repository
    assert not [pair.key for pair in PAIRS_BY_KEY.values() if pair.gated and hub_id(pair.target) in preloaded]


def test_every_tracked_file_over_a_megabyte_goes_through_lfs():
    """The Hub refuses plain files over 1 MB on push: each must match a filter=lfs pattern of .gitattributes (planted:
    the *.pt line removed leaves the shipped head uncovered)."""
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    large = [name.decode() for name in tracked if name and (ROOT / name.decode()).stat().st_size > 1_000_000]
    assert large, "no tracked file over 1 MB: the check would be empty"
    checked = subprocess.run(["git", "check-attr", "filter", "--", *large], cwd=ROOT, capture_output=True, check=True)
    uncovered = [line for line in checked.stdout.decode().splitlines() if not line.endswith(": filter: lfs")]
    assert uncovered == [], uncovered
