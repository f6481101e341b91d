"""The benchmark: your own prompts file, checked line by line, and per prompt the measured, accounted and
predicted speedups."""

from __future__ import annotations

import json

import pytest

from specdemo.bench import batch
from specdemo.bench.batch import HF_BATCHED, SHARED_CUT, run_batch_bench
from specdemo.bench.prompts import JSON_LINES, PLAIN_LINES, BenchPrompt, load_prompts, read_prompts_file
from specdemo.bench.single import (
    ACCOUNTING_TOLERANCE,
    HF_GENERATE,
    SPECULATIVE,
    TARGET_ONLY,
    bench_pass_costs,
    bench_row,
    run_bench,
    summarise,
)
from specdemo.cli.main import main
from specdemo.config import SpeculativeConfig
from specdemo.engine.costs import BatchCosts, pass_costs
from tests.helpers import make_round

STAND_IN_COSTS = BatchCosts.from_seconds(  # seconds of a shared round by tokens per row, one row and a full batch
    {1: 1.0, 2: 1.3, 4: 1.4, 6: 1.5, 17: 2.0}, {1: 1.6, 2: 2.2, 4: 3.0, 6: 3.8, 17: 8.0}, full_rows=8
)
GOOD = {"name": "copy", "grounded": True, "text": "Repeat this list: apples, bread, milk, eggs, rice, tea."}


def write_lines(tmp_path, *lines: str):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(
    ("second_line", "message"),
    [
        ('{"name": "x", "grounded": true, "text": "hi"', "line 2 is not valid JSON"),
        ('["name", "grounded", "text"]', "line 2 is not a JSON object"),
        ('{"name": "x", "grounded": true, "text": "   "}', "line 2 has an empty text"),
        ('{"name": "x", "grounded": true, "txt": "hi"}', "line 2 has the unknown key 'txt'"),
        ('{"name": "x", "grounded": true}', "line 2 lacks the key 'text'"),
        ('{"name": "x", "grounded": "yes", "text": "hi"}', "line 2 has grounded = 'yes': use true or false"),
        ('{"name": "", "grounded": true, "text": "hi"}', "line 2 has an empty or non-text name"),
        ('{"name": "x", "grounded": true, "text": "a\\u0000b"}', "line 2: The prompt contains the control character"),
        (json.dumps(GOOD), "names 'copy' twice"),
    ],
)
def test_a_bad_prompts_file_gets_one_sentence_naming_the_line(tmp_path, capsys, second_line, message):
    path = write_lines(tmp_path, json.dumps(GOOD), second_line)
    assert main(["bench", "--prompts", str(path)]) == 2  # refused before any model loads
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and error.startswith("error: ") and message in error, error


def test_a_missing_or_empty_prompts_file_is_named(tmp_path, capsys):
    assert main(["bench", "--prompts", str(tmp_path / "nope.jsonl")]) == 2
    assert "Cannot read the prompts file" in capsys.readouterr().err
    assert main(["bench", "--prompts", str(write_lines(tmp_path, "", "  "))]) == 2
    assert "holds no prompts" in capsys.readouterr().err


def test_blank_lines_are_skipped_and_prompts_keep_their_order(tmp_path):
    other = {**GOOD, "name": "free", "grounded": False}
    prompts = load_prompts(write_lines(tmp_path, json.dumps(GOOD), "", json.dumps(other)))
    assert [(p.name, p.grounded) for p in prompts] == [("copy", True), ("free", False)]


def test_one_format_for_both_commands_says_which_it_read(tmp_path):
    """JSON lines (only "text" required; a text may span lines) or plain text, one prompt per line; both commands read
    them the same way. Before, `generate` decoded each JSON object of the bench's file as a prompt."""
    plain = tmp_path / "prompts.txt"
    plain.write_text('Write a haiku.\n\n{"this": is not JSON} to YAML\n')
    read = read_prompts_file(plain)
    assert read.format == PLAIN_LINES and [p.text for p in read.prompts] == [
        "Write a haiku.",
        '{"this": is not JSON} to YAML',
    ]
    assert [p.grounded for p in read.prompts] == [None, None]
    multi_line = {"text": "Fix the spelling:\n\nTeh cat sat."}
    lines = tmp_path / "prompts.txt"
    lines.write_text(json.dumps(multi_line) + "\n" + json.dumps(GOOD) + "\n")  # .txt, but its first line is an object
    read = read_prompts_file(lines)
    assert read.format == JSON_LINES and read.prompts[0].text == multi_line["text"] and read.prompts[0].name == "line-1"


def test_bench_reports_measured_accounted_and_predicted_speedups(offline_model, tmp_path):
    prompts = load_prompts(
        write_lines(
            tmp_path,
            json.dumps(GOOD),
            json.dumps({"name": "free", "grounded": False, "text": "Write two sentences about rain."}),
        )
    )
    pass_costs(offline_model.model, 2)  # as a cost-aware drafter measures at load (once per model object)
    results = run_bench(offline_model, None, SpeculativeConfig(max_new_tokens=12), repeats=1, prompts=prompts)
    assert [row["prompt"] for row in results["rows"]] == ["copy", "free"]
    assert results["planner_costs"][1] == 1.0 and results["planner_costs"][2] >= 1.0  # t(n)/t(1), from the load
    for row in results["rows"]:
        assert row["identical"]
        assert row["measured_speedup"] > 0 and row["predicted_speedup"] > 0
        assert row["prediction_error"] == pytest.approx(row["predicted_speedup"] / row["measured_speedup"] - 1)
        # tokens per pass / round cost, from the runs' own rounds, reproduces the wall-clock speedup
        assert abs(row["accounting_error"]) <= ACCOUNTING_TOLERANCE, row
    assert results["summary"]["accounting within 5% on every prompt"]


def test_speeds_count_each_methods_own_tokens():
    """In bfloat16 the outputs may differ: a method's tokens/s uses its own token count, and so does the speedup."""
    spec_rounds = [make_round(i, [1, 2, 3], 3, "bonus", 0.25) for i in range(4)]  # 16 tokens in 1 s
    base_rounds = [make_round(i, [], 0, "bonus", 0.1) for i in range(20)]  # 20 tokens in 2 s
    outputs = {TARGET_ONLY: [7] * 20, SPECULATIVE: [7] * 16}
    seconds = {TARGET_ONLY: [2.0], SPECULATIVE: [1.0]}
    prompt = BenchPrompt(**GOOD)
    row = bench_row(
        prompt,
        10,
        [TARGET_ONLY, SPECULATIVE],
        seconds,
        outputs,
        {TARGET_ONLY: [base_rounds], SPECULATIVE: [spec_rounds]},
        num_draft_tokens=3,
    )
    assert row["tokens_per_second"] == pytest.approx({TARGET_ONLY: 10.0, SPECULATIVE: 16.0})
    assert row["measured_speedup"] == pytest.approx(1.6)  # not 2.0, the ratio of the times
    assert not row["identical"] and row["differs"] == [SPECULATIVE]
    assert row["new_tokens_by_method"] == {TARGET_ONLY: 20, SPECULATIVE: 16}


def test_the_peer_is_compared_on_the_prompts_where_both_wrote_the_same_text():
    names = [TARGET_ONLY, SPECULATIVE, HF_GENERATE, "HF prompt lookup"]
    rows = [
        {  # the peer wrote another text here, one that copies better
            "grounded": True,
            "identical": False,
            "same_text_as_peer": same,
            "tokens_per_second": dict(zip(names, speeds, strict=True)),
            "alpha": 0.5,
            "acceptance_rate": 0.5,
            "prediction_error": 0.0,
            "accounting_error": 0.0,
            "overhead_fraction": 0.0,
        }
        for same, speeds in [(False, (10, 20, 10, 40)), (True, (10, 30, 10, 20)), (True, (10, 24, 10, 20))]
    ]
    grounded = summarise(rows, names)["grounded"]
    assert grounded[f"{SPECULATIVE} / HF prompt lookup"] == pytest.approx(1.2)  # the median of 0.5, 1.5 and 1.2
    assert grounded[f"prompts where {SPECULATIVE} and HF prompt lookup wrote the same text"] == 2
    assert grounded[f"{SPECULATIVE} / HF prompt lookup on those prompts"] == pytest.approx(1.35)


def test_pass_costs_time_each_size_through_the_engines_cache(tiny_target):
    costs = bench_pass_costs(tiny_target, context_tokens=20, sizes=(1, 3, 6), repeats=3)
    assert list(costs) == [1, 3, 6] and costs[1] == 1.0 and all(cost > 0 for cost in costs.values())


def test_batch_bench_gives_every_batch_size_the_same_work(offline_model, tmp_path, monkeypatch):
    """Every B decodes all prompts (repeated up to the largest B), so aggregate tokens/s compare across B; greedy, in
    float32, every method emits the same number of tokens. The shared rounds' costs are a stand-in (their measurement,
    ten seconds on the offline model, is engine/test_sharing.py's), and each method's warm-up is one token."""
    monkeypatch.setattr(batch, "batch_costs", lambda model, rows: STAND_IN_COSTS)
    monkeypatch.setattr(batch, "WARM_UP_TOKENS", 1)
    prompts = load_prompts(
        write_lines(
            tmp_path,
            json.dumps(GOOD),
            json.dumps({"name": "free", "grounded": False, "text": "Write two sentences about rain."}),
        )
    )
    speculative = SpeculativeConfig(max_new_tokens=4)
    results = run_batch_bench(offline_model, None, speculative, prompts, [2, 3], [1, 2], repeats=1, log=lambda _: None)
    assert results["methods"] == [
        HF_BATCHED,
        TARGET_ONLY,
        SHARED_CUT,
        "speculative W=1 (ours)",
        "speculative W=2 (ours)",
    ]
    tokens = {(row["batch_size"], name): row[name]["tokens"] for row in results["rows"] for name in results["methods"]}
    assert [row["num_prompts"] for row in results["rows"]] == [3, 3]
    assert len(set(tokens.values())) == 1, tokens  # the same work at B = 2 and B = 3, by every method
    for row in results["rows"]:
        assert row[TARGET_ONLY]["tokens_per_pass"] == 1.0
        assert row["speculative W=1 (ours)"]["tokens_per_pass"] >= 1.0
