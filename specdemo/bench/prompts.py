"""Benchmark prompts: the built-in set, and a user's own from a JSON-lines file, checked line by line."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

from specdemo.config import check_prompt


@dataclass(frozen=True)
class BenchPrompt:
    name: str
    grounded: bool  # True: the answer draws on text in the prompt (where prompt lookup should pay off)
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


PROMPT_KEYS = frozenset(field.name for field in fields(BenchPrompt))


def load_prompts(path: str | Path) -> tuple[BenchPrompt, ...]:
    """Prompts from a JSON-lines file, one object per line with `name`, `grounded` and `text`; blank lines are
    skipped. A ValueError names the line of the first problem."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(
            f"Cannot read the prompts file '{path}' ({error.__class__.__name__}): check the path."
        ) from error
    prompts = [parse_prompt_line(line, number, path) for number, line in enumerate(lines, 1) if line.strip()]
    if not prompts:
        raise ValueError(f"The prompts file '{path}' holds no prompts: write one JSON object per line.")
    names = [prompt.name for prompt in prompts]
    repeated = next((name for name in names if names.count(name) > 1), None)
    if repeated is not None:
        raise ValueError(f"The prompts file '{path}' names '{repeated}' twice: give each prompt its own name.")
    return tuple(prompts)


def parse_prompt_line(line: str, number: int, path: str | Path) -> BenchPrompt:
    where = f"{path}, line {number}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where} is not valid JSON ({error.msg}): write one object per line.") from error
    if not isinstance(record, dict):
        raise ValueError(f'{where} is not a JSON object: write {{"name": ..., "grounded": ..., "text": ...}}.')
    unknown, missing = sorted(set(record) - PROMPT_KEYS), sorted(PROMPT_KEYS - set(record))
    if unknown:
        raise ValueError(f"{where} has the unknown key '{unknown[0]}': the keys are name, grounded and text.")
    if missing:
        raise ValueError(f"{where} lacks the key '{missing[0]}': the keys are name, grounded and text.")
    if not isinstance(record["name"], str) or not record["name"].strip():
        raise ValueError(f"{where} has an empty or non-text name: name each prompt.")
    if not isinstance(record["grounded"], bool):
        raise ValueError(f"{where} has grounded = {record['grounded']!r}: use true or false.")
    if not isinstance(record["text"], str) or not record["text"].strip():
        raise ValueError(f"{where} has an empty text: give the prompt some text.")
    try:
        check_prompt(record["text"])
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from error
    return BenchPrompt(record["name"].strip(), record["grounded"], record["text"])


MAX_PROMPTS_FILE_LINES = 256  # a prompts file is decoded in one process; more belongs in several runs


def load_prompt_lines(path: str) -> list[str]:
    """A prompts file for `generate --prompts-file`: one prompt per line, every line checked before anything runs."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"The prompts file {path} does not exist: give the path of a text file, one prompt per line.")
    lines = file.read_text(encoding="utf-8").splitlines()
    if not lines:
        raise ValueError(f"The prompts file {path} is empty: write one prompt per line.")
    if len(lines) > MAX_PROMPTS_FILE_LINES:
        raise ValueError(
            f"The prompts file {path} has {len(lines)} lines; the limit is {MAX_PROMPTS_FILE_LINES}: split it."
        )
    return check_prompt_lines(lines, f"{path}")


def check_prompt_lines(lines: list[str], source: str) -> list[str]:
    """Every line a prompt: an empty or bad line is refused with its number ("Line 3 of the batch is empty: ...")."""
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            raise ValueError(f"Line {number} of {source} is empty: remove it or write a prompt on it.")
        try:
            check_prompt(line)
        except ValueError as error:
            raise ValueError(f"Line {number} of {source}: {error}") from None
    return lines
