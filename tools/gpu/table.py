"""The GPU check's table, from what its tests recorded (tests/test_gpu.py's RESULTS, or the gpu-progress.json they
write as each ends): `python -m tools.gpu.table PATH` prints it from the file, so a run cut short still shows one."""

from __future__ import annotations

import json
import sys
from pathlib import Path

KINDS = ("ngram", "suffix", "model", "self", "recurrent", "hybrid")  # tests/test_gpu.py's drafter kinds
PLAIN = ("versions", "tests", "setup", "rule", "speed", "coupled", "per prompt", *KINDS)  # shown otherwise, or not


def table(results: dict[str, dict]) -> str:
    """The versions, the tests' outcomes, one line per drafter kind, then every other recorded line."""
    versions, setup = results.get("versions", {}), results.get("setup", {})
    lines = [
        f"GPU check: {setup.get('target', '?')} on {versions.get('device', '?')}",
        "versions: " + ", ".join(f"{name} {value}" for name, value in versions.items() if name != "device"),
        tests_line(results.get("tests", {})),
        *kind_lines(results),
    ]
    lines += [f"{name}: {value}" for name, value in setup.items() if name != "target"]
    lines += [f"coupled noise: {results['coupled']}"] if "coupled" in results else []
    for name, figures in results.items():
        if name not in PLAIN:
            lines.append(f"{name}: " + "; ".join(f"{label} {value}" for label, value in figures.items()))
    return "\n".join(lines)


def tests_line(outcomes: dict[str, str]) -> str:
    """How many tests passed, failed and were skipped, naming those that did not pass."""
    words = ("passed", "failed", "error", "skipped")
    counts = {word: sum(outcome.startswith(word) for outcome in outcomes.values()) for word in words}
    others = [name for name, outcome in outcomes.items() if not outcome.startswith("passed")]
    said = ", ".join(f"{count} {word}" for word, count in counts.items() if count) or "none ended"
    return f"tests: {said}" + (f" (not passed: {', '.join(others)})" if others else "")


def kind_lines(results: dict[str, dict]) -> list[str]:
    """The header and one line per drafter kind: identity, sampled runs, the rule's TV, the coupled rule, speed."""
    rule, speed = results.get("rule", {}), results.get("speed", {})
    lines = [
        f"{'kind':10s} {'greedy = target':>16s} {'batched = alone':>16s} {'sampled ok':>11s} {'TV W=1':>7s} "
        f"{'TV W=3':>7s} {'coupled = target':>16s} {'ours ms/tok':>11s} {'HF ms/tok':>10s} {'HF static ms/tok':>16s}"
    ]
    for kind in KINDS:
        row = results.get(kind, {})
        lines.append(
            f"{kind:10s} {row.get('greedy_identical', '-'):>16s} {row.get('batched_identical', '-'):>16s} "
            f"{row.get('sampled_without_error', '-'):>11s} {rule.get('tv_one_candidate', '-')!s:>7s} "
            f"{rule.get('tv_three_candidates', '-')!s:>7s} {row.get('coupled_identical', '-'):>16s} "
            f"{speed.get('ours_target_only_ms_per_token', '-')!s:>11s} "
            f"{speed.get('hf_generate_ms_per_token', '-')!s:>10s} "
            f"{speed.get('hf_static_compiled_ms_per_token', '-')!s:>16s}"
        )
    return lines


if __name__ == "__main__":
    print(table(json.loads(Path(sys.argv[1]).read_text())))
