"""The command line: JSON output of a real run, and one clear sentence with exit code 2 for bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specdemo.__main__ import main
from specdemo.config import check_prompt_fits

PROMPT = "Correct the spelling: The quartely planing meeting is moved from Tuesday to Thursday."


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--temperature", "-1"], "temperature must be in [0, 10]"),
        (["--temperature", "nan"], "temperature must be a number"),
        (["--top-p", "0"], "top-p must be in (0, 1]"),
        (["--top-p", "1.5"], "top-p must be in (0, 1]"),
        (["--top-k", "-1"], "top-k must be between 0 and"),
        (["--repetition-penalty", "0"], "repetition penalty must be in (0, 10]"),
        (["--num-draft-tokens", "0"], "num-draft-tokens must be between 1 and 16"),
        (["--num-draft-tokens", "17"], "num-draft-tokens must be between 1 and 16"),
        (["--max-new-tokens", "0"], "max-new-tokens must be between 1 and 2048"),
        (["--seed", "-3"], "seed must be between 0 and"),
        (["--target", "gpt-17"], "'gpt-17' is not a valid model id"),
        (["--pair", "fastest"], "Unknown pair 'fastest'"),
        (["--pair", "smollm2-135m-self", "--draft", "x/y"], "Give either --pair or --target/--draft"),
        (["--draft-temperature", "-2"], "draft temperature must be in [0, 10]"),
    ],
)
def test_bad_settings_exit_2_with_one_sentence(arguments, message, capsys):
    assert main(["generate", "--prompt", "hi", *arguments]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("error: ") and message in error


def test_empty_prompt_is_refused(capsys):
    assert main(["generate", "--prompt", "   "]) == 2
    assert "The prompt is empty" in capsys.readouterr().err


def test_prompt_over_the_token_limit_is_refused(offline_model, capsys):
    assert main(["generate", "--prompt", "word " * 9000, "--no-chat"]) == 2
    assert "The prompt is 9,001 tokens; the limit is 4,096: shorten it." in capsys.readouterr().err


def test_prompt_and_new_tokens_must_fit_the_context():
    check_prompt_fits(1000, 24, context_length=1024)
    with pytest.raises(ValueError, match="prompt is 1,000 tokens and max-new-tokens is 25, but the model's context"):
        check_prompt_fits(1000, 25, context_length=1024)


def test_json_output_of_a_greedy_run_matches_the_baseline(offline_model, capsys):
    assert main(["generate", "--prompt", PROMPT, "--max-new-tokens", "24", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert main(["generate", "--prompt", PROMPT, "--max-new-tokens", "24", "--json", "--baseline"]) == 0
    baseline = json.loads(capsys.readouterr().out)
    assert result["generated_token_ids"] == baseline["generated_token_ids"]
    assert result["prompt_token_ids"][0] == 1  # the chat template's <|im_start|>
    assert "Thursday" in result["text"]
    rounds = result["rounds"]
    assert sum(r["num_accepted"] + (r["next_token_id"] is not None) for r in rounds) == len(
        result["generated_token_ids"]
    )
    assert {r["next_kind"] for r in rounds} <= {"resampled", "bonus", None}
    assert result["stats"]["num_target_forwards"] == len(rounds) < baseline["stats"]["num_target_forwards"]
    for key in ("acceptance_rate", "mean_tokens_per_round", "tokens_per_second", "wall_seconds"):
        assert result["stats"][key] > 0


def test_bad_input_gives_no_traceback_in_a_real_process():
    completed = subprocess.run(
        [sys.executable, "-m", "specdemo", "generate", "--prompt", "hi", "--top-p", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 2
    assert completed.stderr.strip() == "error: top-p must be in (0, 1], got 2.0."


def test_a_failing_run_is_one_sentence_and_exit_1_and_debug_shows_the_traceback(monkeypatch, capsys):
    import specdemo.__main__ as cli

    def failing(*args, **kwargs):
        yield from ()
        raise RuntimeError("crop was called, but the current layer does not track past states\nsecond line")

    monkeypatch.setattr(cli, "speculative_generate", failing)
    assert main(["generate", "--prompt", PROMPT, "--max-new-tokens", "4"]) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error == (
        "error: the run failed (RuntimeError: crop was called, but the current layer does not track past states); "
        "run it again with --debug for the traceback."
    )
    with pytest.raises(RuntimeError, match="crop was called"):
        main(["generate", "--prompt", PROMPT, "--max-new-tokens", "4", "--debug"])


def test_dtype_bfloat16_decodes_in_bfloat16_and_says_so(offline_model, capsys):
    assert main(["generate", "--prompt", PROMPT, "--max-new-tokens", "8", "--json", "--dtype", "bfloat16"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["dtype"] == "bfloat16" and result["device"] == "cpu"
    assert 0 < len(result["generated_token_ids"]) <= 8
    assert all(0 <= p <= 1 for r in result["rounds"] for p in r["acceptance_probs"])  # probabilities in float32


@pytest.mark.parametrize(
    ("lines", "arguments", "message"),
    [
        (None, [], "does not exist: give the path of a text file"),
        ([], [], "is empty: write one prompt per line"),
        (["hi"] * 257, [], "has 257 lines; the limit is 256: split it"),
        (["hi", "  ", "there"], [], "Line 2 of"),
        (["hi", "x" * 50_001], [], "Line 2 of"),
        (["hi"], ["--batch-size", "33"], "batch-size must be between 1 and 32"),
        (["hi"], ["--batch-size", "0"], "batch-size must be between 1 and 32"),
        (["hi"], ["--num-candidates", "9"], "num-candidates must be between 1 and 8"),
    ],
)
def test_bad_prompts_files_and_batch_settings_exit_2_before_anything_runs(tmp_path, lines, arguments, message, capsys):
    path = tmp_path / "prompts.txt"
    if lines is not None:
        path.write_text("\n".join(lines))
    assert main(["generate", "--prompts-file", str(path), *arguments]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("error: ") and message in error[0]


def test_prompts_file_prints_one_json_object_per_prompt_equal_to_single_runs(offline_model, tmp_path, capsys):
    texts = [PROMPT, "Repeat: red green blue red green blue", "Count from 1 to 12."]
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(texts))
    assert (
        main(
            [
                "generate",
                "--prompts-file",
                str(path),
                "--batch-size",
                "2",
                "--num-candidates",
                "2",
                "--max-new-tokens",
                "16",
            ]
        )
        == 0
    )
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["index"] for r in records] == [0, 1, 2]
    for record in records:
        assert (
            main(
                ["generate", "--prompt", record["prompt"], "--max-new-tokens", "16", "--num-candidates", "2", "--json"]
            )
            == 0
        )
        alone = json.loads(capsys.readouterr().out)
        assert record["generated_token_ids"] == alone["generated_token_ids"]
        assert set(record) >= set(alone) and "candidates" in record["rounds"][0]
