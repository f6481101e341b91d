"""The command line: JSON output of a real run, and one clear sentence with exit code 2 for bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from specdemo.cli.main import main
from specdemo.cli.race import race_table
from specdemo.config import SamplingConfig, check_prompt_fits, check_row_seeds, run_settings
from specdemo.core.race import LaneFigures
from specdemo.models.loading import LoadedModel, native_bfloat16
from specdemo.models.shared import ModelCache
from specdemo.pairs import DEFAULT_PAIR, pair_dtype

PROMPT = "Correct the spelling: The quartely planing meeting is moved from Tuesday to Thursday."

CPU = torch.device("cpu")
MAX_SEED = run_settings(SamplingConfig)["seed"][1].high  # 2**63 - 1


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
        (["--draft", "sufix"], "'sufix' is not a valid model id"),
        (["--draft", "sufix"], "a drafter may also be 'ngram', 'suffix', 'recurrent' or 'hybrid'."),
        (
            ["--draft", "suffix", "--suffix-cache-tokens", "-1"],
            "suffix-cache-tokens must be between 0 and 200000, got -1.",
        ),
        (["--draft", "suffix", "--suffix-cache-tokens", "300000"], "suffix-cache-tokens must be between 0 and 200000"),
        (["--suffix-cache-tokens", "10"], "--suffix-cache-tokens is an option of --draft suffix, and this run drafts"),
        (["--max-ngram-size", "9"], "max-ngram-size must be between 1 and 8, got 9."),
        (["--rule", "gumbel"], "rule must be 'standard' or 'coupled', got 'gumbel'."),
        (["--rule", "coupled", "--seed", "-1"], "seed must be between 0 and 9223372036854775807, got -1."),
        (["--max-ngram-size", "2", "--min-ngram-size", "3"], "min-ngram-size must be at most max-ngram-size (2)"),
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


@pytest.fixture
def session_model(offline_model, request, monkeypatch) -> LoadedModel:
    """The offline default in the format `--dtype auto` picks here, loaded once per worker (the session's fixture):
    each `generate` of the test finds it in its model cache instead of loading it again (two seconds a run). The
    tests without this fixture load through the command line as a user's run does."""
    auto = pair_dtype(DEFAULT_PAIR, "auto", CPU)
    loaded = request.getfixturevalue("offline_bfloat16") if auto == torch.bfloat16 else offline_model
    assert loaded.model.dtype == auto

    def holding() -> ModelCache:
        cache = ModelCache(pinned=loaded.name)
        cache.put(loaded)
        return cache

    monkeypatch.setattr("specdemo.cli.generate.ModelCache", holding)
    return loaded


def test_json_output_of_a_greedy_run_matches_the_baseline(session_model, capsys):
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


def test_a_coupled_sampled_run_writes_the_baseline_text_for_its_seed(session_model, capsys):
    """--rule coupled at temperature 0.8: the speculative text is the target-alone text for the seed, token for token;
    another seed writes another text."""
    common = ["generate", "--prompt", PROMPT, "--max-new-tokens", "12", "--json", "--temperature", "0.8"]

    def tokens(*more: str) -> list[int]:
        assert main([*common, "--rule", "coupled", *more]) == 0
        return json.loads(capsys.readouterr().out)["generated_token_ids"]

    assert tokens("--seed", "7") == tokens("--seed", "7", "--baseline") != tokens("--seed", "8", "--baseline")


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
    import specdemo.cli.generate as cli

    def failing(*args, **kwargs):
        yield from ()
        raise RuntimeError("crop was called, but the current layer does not track past states\nsecond line")

    monkeypatch.setattr(cli, "batch_generate", failing)
    assert main(["generate", "--prompt", PROMPT, "--max-new-tokens", "4"]) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error == (
        "error: the run failed (RuntimeError: crop was called, but the current layer does not track past states); "
        "run it again with --debug for the traceback."
    )
    with pytest.raises(RuntimeError, match="crop was called"):
        main(["generate", "--prompt", PROMPT, "--max-new-tokens", "4", "--debug"])


def test_running_out_of_device_memory_is_one_sentence_and_exit_2(monkeypatch, capsys):
    """The target's pass raises PyTorch's out-of-memory error (as CUDA's would): one sentence naming the memory free
    and the way forward, exit code 2, no traceback."""
    from specdemo.models.tree_cache import TreeCachedModel

    def out_of_memory(self, asked):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(TreeCachedModel, "logits", out_of_memory)
    assert main(["generate", "--pair", "smollm2-135m-ngram", "--prompt", PROMPT, "--max-new-tokens", "4"]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("error: This run needed more memory than the cpu device had (")
    assert error.endswith(
        "lower max-new-tokens, the batch size or num-candidates, shorten the prompt, or pick a smaller pair."
    )


NO_NATIVE_BFLOAT16 = (
    "error: This CPU has no native bfloat16 (AMX or AVX-512 BF16), so bfloat16 would run in software and be slow; "
    "GPUs of compute 8.0 or newer and CPUs with AMX or AVX-512 BF16 support it: use auto or float32."
)


def test_dtype_auto_is_the_default_and_the_json_says_why(offline_model, capsys):
    assert main(["generate", "--prompt", PROMPT, "--max-new-tokens", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["device"] == "cpu"
    if native_bfloat16(CPU):
        assert (result["dtype"], result["dtype_reason"]) == (
            "bfloat16",
            "bfloat16 (auto: this CPU has native bfloat16)",
        )
    else:  # this project's AMD EPYC (AVX2 only)
        assert (result["dtype"], result["dtype_reason"]) == (
            "float32",
            "float32 (auto: this CPU has no native bfloat16)",
        )


@pytest.mark.skipif(native_bfloat16(CPU), reason="this CPU has native bfloat16, so it is not refused")
@pytest.mark.parametrize("command", [["generate", "--prompt", PROMPT], ["bench", "--repeats", "1"]])
def test_dtype_bfloat16_is_refused_on_a_cpu_without_native_bfloat16(command, capsys):
    assert main([*command, "--dtype", "bfloat16"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == NO_NATIVE_BFLOAT16


@pytest.mark.skipif(not native_bfloat16(CPU), reason="needs a CPU with AMX or AVX-512 BF16")
def test_dtype_bfloat16_decodes_in_bfloat16_where_the_cpu_has_it(offline_model, capsys):
    assert main(["generate", "--prompt", PROMPT, "--max-new-tokens", "8", "--json", "--dtype", "bfloat16"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["dtype"], result["dtype_reason"], result["device"]) == ("bfloat16", "bfloat16 (chosen)", "cpu")
    assert 0 < len(result["generated_token_ids"]) <= 8
    assert all(0 <= p <= 1 for r in result["rounds"] for p in r["acceptance_probs"])  # probabilities in float32


@pytest.mark.parametrize("command", [["generate", "--prompt", PROMPT], ["bench", "--repeats", "1"]])
def test_an_unknown_dtype_gets_one_sentence_naming_the_choices(command, capsys):
    assert main([*command, "--dtype", "float64"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: Unknown number format 'float64': use auto (bfloat16 where the device computes in it natively, float16 "
        "on older GPUs, else float32), float32, bfloat16 or float16."
    )


def test_dtype_float16_decodes_in_float16_on_the_cpu_with_float32_probabilities(offline_model, capsys):
    """What a T4 runs, dry-run here: --dtype float16 is offered (and named in --help), and the run's probabilities
    are float32's, between 0 and 1."""
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "--dtype {auto,float32,bfloat16,float16}" in capsys.readouterr().out
    assert main(["generate", "--prompt", PROMPT, "--max-new-tokens", "8", "--json", "--dtype", "float16"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["dtype"], result["dtype_reason"], result["device"]) == ("float16", "float16 (chosen)", "cpu")
    assert 0 < len(result["generated_token_ids"]) <= 8
    assert all(0 <= p <= 1 for r in result["rounds"] for p in r["acceptance_probs"])


@pytest.mark.parametrize(
    ("lines", "arguments", "message"),
    [
        (None, [], "Cannot read the prompts file"),
        ([], [], "holds no prompts: write one prompt per line, or one JSON object per line"),
        (["  ", ""], [], "holds no prompts"),
        (["hi"] * 257, [], "holds 257 prompts; the limit is 256: split it"),
        (["hi", "x" * 50_001], [], "prompts.txt, line 2: The prompt is 50,001 characters"),
        (["hi", "a\u0000b"], [], "prompts.txt, line 2: The prompt contains the control character U+0000"),
        (['{"text": "hi"}', '{"txt": "there"}'], [], "line 2 has the unknown key 'txt'"),
        (['{"text": "hi"}', "there"], [], "line 2 is not valid JSON"),
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


class StopBeforeLoading(Exception):
    """Raised where the pair would load: the run got past every check."""


def stop_at_load(monkeypatch, tmp_path) -> tuple[list, str]:
    """A 3-row prompts file, and generate's pair loading replaced by a stop that records each call."""
    import specdemo.cli.generate as cli

    loads = []

    def stop(*args, **kwargs):
        loads.append(args)
        raise StopBeforeLoading

    monkeypatch.setattr(cli, "load_pair", stop)
    path = tmp_path / "prompts.txt"
    path.write_text("one\ntwo\nthree")
    return loads, str(path)


def test_a_seed_too_large_for_the_prompts_file_exits_2_before_any_model_loads(tmp_path, monkeypatch, capsys):
    """Row k decodes with seed + k - 1: at the largest seed a 3-row file's last row would overflow, so the command
    refuses in one sentence naming that row and the largest --seed it could use, and loads nothing."""
    loads, path = stop_at_load(monkeypatch, tmp_path)
    assert main(["generate", "--prompts-file", path, "--seed", str(MAX_SEED)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: Seed {MAX_SEED} is too large for the 3 prompts in '{path}': row k decodes with seed + k - 1, so "
        f"the last row (row 3) would need seed {MAX_SEED + 2}, past the largest seed {MAX_SEED}; use seed "
        f"{MAX_SEED - 2} or less."
    ]
    assert loads == []


def test_the_largest_usable_seed_for_a_prompts_file_reaches_the_model_load(tmp_path, monkeypatch):
    """--seed limit - (n - 1) passes every check: the command goes on to load the pair (stopped there)."""
    loads, path = stop_at_load(monkeypatch, tmp_path)
    with pytest.raises(StopBeforeLoading):  # --debug: not a ValueError, so it propagates
        main(["generate", "--prompts-file", path, "--seed", str(MAX_SEED - 2), "--debug"])
    assert len(loads) == 1
    check_row_seeds(MAX_SEED, 1, "one.txt")  # one row decodes with the seed itself
    with pytest.raises(ValueError, match=f"use seed {MAX_SEED - 255} or less"):
        check_row_seeds(MAX_SEED - 254, 256, "many.txt")


def test_prompts_file_prints_one_json_object_per_prompt_equal_to_single_runs(session_model, tmp_path, capsys):
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
                "8",
            ]
        )
        == 0
    )
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["index"] for r in records] == [0, 1, 2]
    for record in records:
        assert (
            main(["generate", "--prompt", record["prompt"], "--max-new-tokens", "8", "--num-candidates", "2", "--json"])
            == 0
        )
        alone = json.loads(capsys.readouterr().out)
        assert record["generated_token_ids"] == alone["generated_token_ids"]
        assert set(record) >= set(alone) and "candidates" in record["rounds"][0]


def test_the_suffix_drafter_says_what_it_chose_each_round(session_model, capsys):
    """`--draft suffix` picks the registered offline pair; every round it drafted for carries its plan in the JSON."""
    prompt = "Repeat exactly: alpha beta gamma delta, alpha beta gamma delta."
    args = ["generate", "--prompt", prompt, "--draft", "suffix", "--num-draft-tokens", "12", "--max-new-tokens", "24"]
    assert main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["pair"] == "smollm2-135m-suffix"
    plans = [r["plan"] for r in result["rounds"] if r["plan"]]
    assert plans and all(p["says"].startswith(("drafted nothing", "drafted ")) for p in plans)
    assert any(p["num_tokens"] > 0 for p in plans) and all(p["num_tokens"] <= 12 for p in plans)


def test_race_prints_a_line_per_lane_and_that_their_texts_agree(offline_model, monkeypatch, capsys):
    def holding() -> ModelCache:
        cache = ModelCache(pinned=offline_model.name)
        cache.put(offline_model)
        return cache

    monkeypatch.setattr("specdemo.cli.race.ModelCache", holding)
    common = ["race", "--prompt", PROMPT, "--max-new-tokens", "12", "--dtype", "float32", "--lanes", "ngram,suffix"]
    assert main([*common, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [lane["name"] for lane in result["lanes"]] == ["target", "ngram", "suffix"]
    assert len({tuple(lane["token_ids"]) for lane in result["lanes"]}) == 1
    assert result["lanes"][0]["speedup"] == 1.0
    assert result["agreement"].startswith("All 3 finished lanes wrote the same")
    figures = [LaneFigures(lane["name"], lane["token_ids"], lane["passes"], 0.1, 0.0) for lane in result["lanes"]]
    table = race_table(figures).splitlines()  # what the command prints without --json
    assert [line.split()[0] for line in table] == ["lane", "target", "ngram", "suffix"]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--lanes", ""], "The race has no drafter lanes"),
        (["--lanes", "ngram,draft"], "The lane 'draft' races the pair's draft model"),
        (["--lanes", "ngram", "--suffix-cache-tokens", "9"], "--suffix-cache-tokens is an option of the suffix lane"),
    ],
)
def test_race_refuses_bad_lanes_in_one_sentence(arguments, message, capsys):
    assert main(["race", "--prompt", PROMPT, *arguments]) == 2
    assert message in capsys.readouterr().err
