"""The layers hold (import-linter reads the contracts in pyproject.toml), and the check fails when a core module imports
from the app: planted in a copy of the package."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(root / "pyproject.toml"), "--no-cache"],
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_every_layer_imports_only_from_the_layers_below_it():
    checked = lint_imports(ROOT)
    assert checked.returncode == 0, checked.stdout[-3000:]
    assert "Contracts: 5 kept, 0 broken." in checked.stdout


def test_a_core_module_that_imports_the_app_breaks_the_contract(tmp_path):
    shutil.copytree(ROOT / "specdemo", tmp_path / "specdemo", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    sampling = tmp_path / "specdemo" / "core" / "sampling.py"
    sampling.write_text(sampling.read_text() + "\nfrom specdemo.app.views.render import token_text  # planted\n")
    checked = lint_imports(tmp_path)
    assert checked.returncode != 0
    assert "specdemo.core.sampling -> specdemo.app.views.render" in checked.stdout, checked.stdout[-3000:]
    assert "Each layer imports only from the layers below it BROKEN" in checked.stdout


def test_the_pair_registry_that_imports_the_engine_breaks_the_contract(tmp_path):
    """pairs.py sits below the engine: the registry says what exists, and loading a pair (engine/setup.py) is above
    it. Planted: the registry imports load_pair back."""
    shutil.copytree(ROOT / "specdemo", tmp_path / "specdemo", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    pairs = tmp_path / "specdemo" / "pairs.py"
    pairs.write_text(pairs.read_text() + "\nfrom specdemo.engine.setup import load_pair  # planted\n")
    checked = lint_imports(tmp_path)
    assert checked.returncode != 0
    assert "specdemo.pairs -> specdemo.engine.setup" in checked.stdout, checked.stdout[-3000:]
