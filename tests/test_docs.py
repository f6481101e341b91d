"""The README is a front page: short, a command on its first screen, one picture with a short description, a speed
table without prose; its relative links resolve (in docs/ and benchmarks/ too); assets/ holds only what the app or the
README shows; the docs say what is, not how it came to be."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_the_readme_reads_in_a_minute():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150


def test_the_first_screen_says_how_to_run_it():
    """ "Run it" within 15 lines of the title (the front matter above it is the Space's configuration, not shown)."""
    lines = (ROOT / "README.md").read_text().splitlines()
    title = next(number for number, line in enumerate(lines) if line.startswith("# "))
    assert "## Run it" in lines[title : title + 15]


def test_the_readme_shows_one_picture_described_in_a_sentence():
    pictures = re.findall(r"!\[([^\]]*)\]", (ROOT / "README.md").read_text())
    assert len(pictures) == 1 and 0 < len(pictures[0]) <= 120, pictures


def test_how_fast_is_a_table_and_a_link():
    """Dates, devices and commands live in the table's cells; what follows is one line pointing at every table."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## How fast", 1)[1].split("\n## ", 1)[0]
    prose = [line for line in section.strip().splitlines() if line and not line.startswith("|")]
    assert len(prose) == 1 and "benchmarks/README.md" in prose[0], prose


def test_the_docs_tell_no_history():
    """No issue numbers, "used to" or "no longer" in the docs and the benchmarks' README: git keeps what happened."""
    told = [
        (page.relative_to(ROOT), match.group(0))
        for page in PAGES
        for match in re.finditer(r"\bissue \d+|\bused to\b|\bno longer\b", page.read_text(), re.I)
    ]
    assert not told, told


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
