"""Every benchmark in benchmarks/ runs, imported as `benchmarks.NAME` and run on a tiny model saved like a Hub
repository: the figures the README and docs publish from them come from code that a test runs."""

from __future__ import annotations

import importlib
import json
import os
import shlex
from pathlib import Path

import pytest
from transformers import LlamaForCausalLM

from specdemo.drafters.head_file import head_path
from tests.helpers import save_tiny_model, train_tiny_head, word_tokenizer

WORDS = ["<unk>", "</s>", "copy", "this", "list", "apples", "bread", "milk", "and", "then", "write", "a", "poem"]
TINY_RUNS = [  # (benchmark, its options on the tiny model); PROMPTS and HEAD stand for the fixture's files
    ("invariance", "--prompts PROMPTS --max-new-tokens 4"),
    ("round_ms", "--widths 1 3 --rows 1 2 --repeats 1"),
    ("head_cost", "--sizes 4 8 --repeats 1"),
    ("recurrent", "--prompts PROMPTS --max-new-tokens 6 --seeds 1"),
    ("recurrent", "--prompts PROMPTS --max-new-tokens 6 --seeds 0 --head HEAD --runs 'head W=1' hybrid"),
    ("recurrent", "--prompts PROMPTS --max-new-tokens 6 --seeds 0 --costs h200 --runs hybrid"),
    ("recurrent", "--prompts PROMPTS PROMPTS --max-new-tokens 6 --seeds 0 --runs 'head W=1'"),
    ("hybrid_floor", "--prompts PROMPTS --max-new-tokens 6 --repeats 1 --costs linear"),
    ("text_speed", "--texts 4 --new-tokens 16 --settings float32:2 float32:4:plain"),
    ("text_speed", "--texts 4 --sampler --settings float32:2"),
    ("cuda_graphs", "--steps 3 --repeats 1 --prompt-tokens 8 --compile-check"),
    ("round_kernels", "--smoke"),
    ("coupled", "identity --max-new-tokens 3"),
    ("coupled", "cost --prompts PROMPTS --seeds 2 --max-new-tokens 6 --num-draft-tokens 3"),
    ("race", "--prompts PROMPTS --max-new-tokens 6 --repeats 1 --num-draft-tokens 3"),
    ("token_time", "--prompts PROMPTS --max-new-tokens 4 --repeats 1"),
    ("busy", "--max-new-tokens 2 --repeats 1 --states busy --settings specdemo"),
    ("llama_cpp", "--prompts PROMPTS --max-new-tokens 2 --repeats 1 --gguf missing.gguf"),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("tiny")
    model = save_tiny_model(folder / "model", word_tokenizer(WORDS), seed=0)
    train_tiny_head(LlamaForCausalLM.from_pretrained(model), model / "training", output=head_path(str(model)))
    prompts = folder / "prompts.jsonl"
    lines = [
        {"name": "copy", "grounded": True, "text": "copy this list apples bread milk and then apples bread milk"},
        {"name": "poem", "grounded": False, "text": "write a poem"},
    ]
    prompts.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return model, prompts


def run_benchmark(name: str, argv: list[str]) -> object:
    """`python -m benchmarks.NAME ARGV`, in this process."""
    return importlib.import_module(f"benchmarks.{name}").main(argv)


def test_each_benchmark_is_tested_here():
    """A benchmark added to benchmarks/ without a run here fails: every figure it publishes should come from code a
    test runs."""
    folder = Path(__file__).resolve().parents[2] / "benchmarks"
    modules = {path.stem for path in folder.glob("*.py")} - {"__init__", "common"}
    # load: tests/app/test_robustness.py; memory (no model: plans on simulated devices): tests/models/test_memory.py
    assert modules == {name for name, _ in TINY_RUNS} | {"round_host", "load", "memory"}


@pytest.mark.parametrize(("name", "options"), TINY_RUNS)
def test_each_benchmark_runs_on_a_tiny_model(tiny, name, options, capsys):
    model, prompts = tiny
    named = {"HEAD": str(head_path(str(model))), "PROMPTS": str(prompts)}
    options = [named.get(option, option) for option in shlex.split(options)]
    assert run_benchmark(name, ["--model", str(model), "--dtype", "float32", *options])
    assert capsys.readouterr().out.strip()


def test_the_host_around_a_gpu_round_is_timed_and_the_gpu_path_let_go_after(capsys):
    """round_host forces the GPU's fixed-shape passes and graphs for its own rounds only: the process's settings are
    what they were after it."""
    before = dict(os.environ)
    result = run_benchmark("round_host", ["--lengths", "60", "--new-tokens", "40", "--runs", "1"])
    assert result["suffix K=16, 16 accepted, 60 tokens"]["drafted_per_round"] > 1  # the suffix drafter drafted
    assert result["target-only, 60 tokens"]["drafted_per_round"] == 0
    assert dict(os.environ) == before
    assert capsys.readouterr().out.strip()


def test_text_speed_times_requests_the_target_writes(tmp_path, capsys):
    """--requests on a tiny model with a chat template (the module's tiny model has none: no requests of its own)."""
    tokenizer = word_tokenizer(WORDS)
    tokenizer.chat_template = "{% for message in messages %}write {{ message['content'] }} </s> {% endfor %}"
    model = save_tiny_model(tmp_path / "model", tokenizer, seed=0)
    [row] = run_benchmark("text_speed", ["--model", str(model), "--requests", "1", "--settings", "float32:4"])
    assert row["batches"] == 1 and row["requests_per_second"] >= 0 and capsys.readouterr().out.strip()
