"""The README is a front page: short, its relative links resolve (in docs/ and benchmarks/ too), and assets/ holds
only what the app or the README shows."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_the_readme_reads_in_a_minute():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150


def test_every_relative_link_resolves():
    broken = [
        (page.relative_to(ROOT), target)
        for page in PAGES
        for target in LINK.findall(page.read_text())
        if not target.startswith(("http://", "https://")) and not (page.parent / target).exists()
    ]
    assert not broken, broken


def test_assets_hold_only_pictures_that_the_app_or_the_readme_shows():
    """Data the app reads lives beside the code that reads it; prompt sets and results in benchmarks/."""
    shown = (ROOT / "README.md").read_text() + "".join(p.read_text() for p in (ROOT / "specdemo").rglob("*.py"))
    assets = list((ROOT / "assets").iterdir())
    assert not [a.name for a in assets if a.suffix not in (".png", ".jpg", ".svg", ".css")], "not a picture or style"
    assert not [a.name for a in assets if f"assets/{a.name}" not in shown], "not shown"
