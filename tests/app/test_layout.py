"""specdemo/app by role: the page over its tabs, panels and serving, with the settings table and the pure views at the
bottom (contracts in pyproject.toml, read by import-linter); no tab imports another, no view imports gradio, and no
function in the app runs past 60 lines. Each contract fails when its rule is broken, planted in a copy of the
package."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

from tests.test_layers import ROOT, lint_imports

APP = ROOT / "specdemo" / "app"
MAX_FUNCTION_LINES = 60  # STYLE.md: small named helpers; a longer function is split into named parts
PLANTED = {  # a module of the copy: the import planted in it, and the contract it breaks
    "tabs/batch.py": ("from specdemo.app.tabs.one_prompt import EXAMPLES", "No tab imports another tab BROKEN"),
    "views/plots.py": ("import gradio", "Views are pure: no gradio, no models, no engine BROKEN"),
    "views/render.py": (
        "from specdemo.app.serving.runs import Server",
        "The app in layers: page, tabs, panels, serving, then form and views BROKEN",
    ),
}


def function_lengths(folder: Path) -> dict[str, int]:
    lengths = {}
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lengths[f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"] = node.end_lineno - node.lineno + 1
    return lengths


def test_no_function_in_the_app_runs_past_60_lines():
    lengths = function_lengths(APP)
    assert len(lengths) > 100  # the walk found the app's functions
    assert {name: n for name, n in lengths.items() if n > MAX_FUNCTION_LINES} == {}


def test_each_subpackage_says_what_it_holds():
    for package in ("tabs", "panels", "serving", "views"):
        assert ast.get_docstring(ast.parse((APP / package / "__init__.py").read_text())), package


def test_a_tab_that_imports_a_tab_or_a_view_that_imports_gradio_or_serving_breaks_a_contract(tmp_path):
    shutil.copytree(ROOT / "specdemo", tmp_path / "specdemo", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    for module, (line, _) in PLANTED.items():
        path = tmp_path / "specdemo" / "app" / module
        path.write_text(path.read_text() + f"\n{line}  # planted\n")
    checked = lint_imports(tmp_path)
    assert checked.returncode != 0
    for module, (_, broken) in PLANTED.items():
        assert broken in " ".join(checked.stdout.split()), (module, checked.stdout[-3000:])
