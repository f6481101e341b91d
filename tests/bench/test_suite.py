"""benchmarks/ is a small suite a newcomer can run: its prompt sets are the ones its manifest lists, with the counts it
gives; every results folder is one a current page cites; every benchmark is in the README's index of commands; and
the experiments apart are imported by nothing in the package or the tests."""

from __future__ import annotations

import re
from pathlib import Path

from specdemo.bench.prompts import load_prompts

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
PROMPTS = BENCHMARKS / "prompts"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), BENCHMARKS / "README.md"]
EXPERIMENTS = ROOT / "experiments" / "README.md"


def manifest() -> dict[str, dict[str, int]]:
    """The manifest's table: each set's name and its counts (prompts, grounded, open-ended)."""
    rows = {}
    for line in (PROMPTS / "README.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("| `"):
            name, _, count, grounded, open_ended, _ = cells
            assert name.strip("`") not in rows, f"{name} is listed twice"
            rows[name.strip("`")] = dict(prompts=int(count), grounded=int(grounded), open_ended=int(open_ended))
    return rows


def test_the_manifest_lists_every_prompt_set_with_its_counts():
    listed = manifest()
    files = {path.stem: path for path in PROMPTS.iterdir() if path.name != "README.md"}
    assert not [path.name for path in files.values() if path.suffix != ".jsonl"], "a prompt set is JSON lines"
    assert sorted(files) == sorted(listed), "every file listed, every listed file there"
    for name, counts in listed.items():
        prompts = load_prompts(files[name])
        found = dict(
            prompts=len(prompts),
            grounded=sum(p.grounded is True for p in prompts),
            open_ended=sum(p.grounded is False for p in prompts),
        )
        assert found == counts, name


def test_every_prompt_set_is_used_by_a_current_page():
    cited = "".join(page.read_text() for page in [*PAGES, EXPERIMENTS])
    assert [name for name in manifest() if f"`{name}" not in cited and f"/{name}.jsonl" not in cited] == []


def test_every_results_folder_is_cited_by_a_current_page():
    """Results no current figure cites are deleted (git keeps them)."""
    cited = "".join(page.read_text() for page in [*PAGES, EXPERIMENTS])
    folders = [path.name for path in (BENCHMARKS / "results").iterdir() if path.is_dir()]
    assert [name for name in folders if f"{name}/" not in cited] == []


def test_the_benchmarks_readme_indexes_every_benchmark_first_and_stays_short():
    text = (BENCHMARKS / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    index = text.split("\n## ")[1]
    assert index.startswith("Commands"), "the index of commands comes first"
    modules = {path.stem for path in BENCHMARKS.glob("*.py")} - {"__init__", "common"}
    assert {name for name in modules if f"`python -m benchmarks.{name}" not in index} == set()


def test_scripts_run_as_modules_and_name_their_prompt_sets():
    """`python -m benchmarks.NAME` from the root: no sys.path or PYTHONPATH edits, and no globbing of the prompts."""
    scripts = [*BENCHMARKS.glob("*.py"), *(ROOT / "experiments").glob("*.py"), *(ROOT / "experiments").glob("*.sh")]
    pages = [*PAGES, EXPERIMENTS, *BENCHMARKS.glob("results/*/README.md")]
    found = [path.name for path in scripts + pages if re.search(r"sys\.path|PYTHONPATH=\.|glob\(", path.read_text())]
    assert found == []


def test_nothing_in_the_package_or_the_tests_imports_the_experiments():
    importing = re.compile(r"^\s*(from|import)\s+experiments\b", re.MULTILINE)
    sources = [*(ROOT / "specdemo").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]
    assert [str(path.relative_to(ROOT)) for path in sources if importing.search(path.read_text())] == []
