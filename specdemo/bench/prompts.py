"""Prompts: the built-in benchmark set, and a prompts file (JSON lines or plain text), checked line by line."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specdemo.config import check_prompt


@dataclass(frozen=True)
class BenchPrompt:
    name: str
    grounded: bool | None  # True: the answer draws on text in the prompt (where copying pays off); None: not said
    text: str


_CODE = """def moving_average(values, window):
    result = []
    for i in range(len(values) - window + 1):
        chunk = values[i:i + window]
        result.append(sum(chunk) / window)
    return result
"""
_MEETING = (
    "The quarterly planning meeting is moved from Tuesday, March 4 to Thursday, March 6 at 10:00 in room 2.14. "
    "Anna Berg will present the budget review, Tom Lee will cover the hiring plan, and Maria Lopez will report "
    "on the customer survey. Please send your slides to Anna by Wednesday, March 5 at noon."
)
_RECIPE = (
    "Preheat the oven to 200 degrees. Cut four potatoes into thin slices. Mix the slices with two spoons of "
    "olive oil, a pinch of salt and some rosemary. Spread them on a baking tray and bake for 35 minutes, "
    "turning them once after 20 minutes."
)

PROMPTS: tuple[BenchPrompt, ...] = (
    BenchPrompt(
        "code-type-hints", True, f"Add type hints to this Python function and return the whole function:\n\n{_CODE}"
    ),
    BenchPrompt(
        "code-rename",
        True,
        f"Rename the variable `chunk` to `window_values` in this code and show the full code:\n\n{_CODE}",
    ),
    BenchPrompt(
        "fix-spelling",
        True,
        "Correct the spelling mistakes in this text and return the corrected text:\n\n"
        "The quartely planing meeting is moved from Tuesday to Thursday. Anna will presnt the budget review "
        "and Tom will cover the hirring plan. Please send your slides to Anna by Wendesday at noon.",
    ),
    BenchPrompt(
        "extract-people", True, f"List every person mentioned in this text, with what they will do:\n\n{_MEETING}"
    ),
    BenchPrompt("summarise", True, f"Summarise this message in two sentences:\n\n{_MEETING}"),
    BenchPrompt("recipe-steps", True, f"Rewrite this recipe as a numbered list of steps:\n\n{_RECIPE}"),
    BenchPrompt("story", False, "Write a short story about a lighthouse keeper who finds a message in a bottle."),
    BenchPrompt("explain", False, "Explain why the sky is blue to a ten-year-old."),
    BenchPrompt("poem", False, "Write a poem about autumn in a big city."),
)


PROMPT_KEYS = ("text", "name", "grounded")  # only text is required
MAX_PROMPTS_FILE_LINES = 256  # a prompts file is decoded in one process; more belongs in several runs
JSON_LINES, PLAIN_LINES = "JSON lines", "plain text, one prompt per line"


@dataclass(frozen=True)
class PromptsFile:
    """The prompts of a file, and which of the two formats it was read as (the command line says so)."""

    prompts: tuple[BenchPrompt, ...]
    format: str  # JSON_LINES or PLAIN_LINES


def read_prompts_file(path: str | Path) -> PromptsFile:
    """One format for `generate --prompts-file` and `bench --prompts`: JSON lines (a file ending in .jsonl, or whose
    first line is a JSON object: one object per line with `text`, and optionally `name` and `grounded`; a text may hold
    newlines, written as \\n), else plain text, one prompt per line. Blank lines are skipped. Every prompt is checked
    before anything runs; a ValueError names the line of the first problem."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(
            f"Cannot read the prompts file '{path}' ({error.__class__.__name__}): check the path."
        ) from error
    numbered = [(number, line) for number, line in enumerate(lines, 1) if line.strip()]
    if not numbered:
        raise ValueError(
            f"The prompts file '{path}' holds no prompts: write one prompt per line, or one JSON object per line."
        )
    if len(numbered) > MAX_PROMPTS_FILE_LINES:
        raise ValueError(
            f"The prompts file '{path}' holds {len(numbered)} prompts; the limit is {MAX_PROMPTS_FILE_LINES}: split it."
        )
    as_json = str(path).endswith(".jsonl") or _is_json_object(numbered[0][1])
    parse = parse_prompt_line if as_json else _plain_prompt
    prompts = tuple(parse(line, number, path) for number, line in numbered)
    names = [prompt.name for prompt in prompts]
    repeated = next((name for name in names if names.count(name) > 1), None)
    if repeated is not None:
        raise ValueError(f"The prompts file '{path}' names '{repeated}' twice: give each prompt its own name.")
    return PromptsFile(prompts, JSON_LINES if as_json else PLAIN_LINES)


def load_prompts(path: str | Path) -> tuple[BenchPrompt, ...]:
    """The prompts of a prompts file (read_prompts_file)."""
    return read_prompts_file(path).prompts


def _is_json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except json.JSONDecodeError:
        return False


def _plain_prompt(line: str, number: int, path: str | Path) -> BenchPrompt:
    _check_text(line, f"{path}, line {number}")
    return BenchPrompt(f"line-{number}", None, line)


def _check_text(text: str, where: str) -> None:
    try:
        check_prompt(text)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None


def parse_prompt_line(line: str, number: int, path: str | Path) -> BenchPrompt:
    """One JSON line: an object with `text`, and optionally `name` (default line-N) and `grounded` (true or false)."""
    where = f"{path}, line {number}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where} is not valid JSON ({error.msg}): write one object per line.") from error
    if not isinstance(record, dict):
        raise ValueError(f'{where} is not a JSON object: write {{"text": ..., "name": ..., "grounded": ...}}.')
    unknown = sorted(set(record) - set(PROMPT_KEYS))
    if unknown:
        raise ValueError(f"{where} has the unknown key '{unknown[0]}': the keys are text, name and grounded.")
    if "text" not in record:
        raise ValueError(f"{where} lacks the key 'text': give each object the prompt's text.")
    name = record.get("name", f"line-{number}")
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{where} has an empty or non-text name: name each prompt, or leave the name out.")
    grounded = record.get("grounded")
    if grounded is not None and not isinstance(grounded, bool):
        raise ValueError(f"{where} has grounded = {grounded!r}: use true or false, or leave it out.")
    if not isinstance(record["text"], str) or not record["text"].strip():
        raise ValueError(f"{where} has an empty text: give the prompt some text.")
    _check_text(record["text"], where)
    return BenchPrompt(name.strip(), grounded, record["text"])
