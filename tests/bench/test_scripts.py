"""Every analysis script in benchmarks/ runs, on a tiny model saved like a Hub repository: the figures published from
them come from code that a test runs."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from transformers import LlamaForCausalLM

from specdemo.drafters.recurrent import head_path
from specdemo.training import fit as fitting
from tests.helpers import save_tiny_model, train_tiny_head, word_tokenizer

SCRIPTS = Path(__file__).resolve().parents[2] / "benchmarks"
CONTEXT = "--texts 64 --new-tokens 16 --layers 0,1 --train 0-0 --held-out 1-1 --steps 3 --texts-per-step 2".split()
RECIPE = "--texts 64 --new-tokens 16 --layers 0,1 --train 0-0 --held-out 1-1 --steps 3 --noise 0.2 --greedy 0-0".split()
WORDS = ["<unk>", "</s>", "copy", "this", "list", "apples", "bread", "milk", "and", "then", "write", "a", "poem"]


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


def run_script(name: str, argv: list[str]) -> object:
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(SCRIPTS))  # run as `python benchmarks/NAME.py`, a script imports `common` beside it
    try:
        spec.loader.exec_module(module)
        return module.main(argv)
    finally:
        sys.path.remove(str(SCRIPTS))
        sys.modules.pop("common", None)


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("headroom", ["--max-new-tokens", "6", "--num-draft-tokens", "4"]),
        ("phases", ["--widths", "1", "3", "--rounds", "3"]),
        ("static", ["--rows", "2", "--max-new-tokens", "4", "--repeats", "1"]),
        ("overhead", ["--max-new-tokens", "4"]),
        ("invariance", ["--max-new-tokens", "4"]),
        ("head_cost", ["--sizes", "4", "8", "--repeats", "1"]),
        ("recurrent", ["--max-new-tokens", "6", "--seeds", "1"]),
        ("recurrent", ["--max-new-tokens", "6", "--seeds", "0", "--head", "HEAD", "--runs", "head W=1", "hybrid"]),
        ("spin_count", ["--rounds", "1", "--steps", "2", "--prompt-tokens", "8", "--settings", "default", "2000"]),
        ("cuda_graphs", ["--steps", "3", "--repeats", "1", "--prompt-tokens", "8", "--compile-check"]),
        ("text_speed", ["--texts", "4", "--new-tokens", "16", "--settings", "float32:2", "float32:4:plain"]),
        ("text_speed", ["--texts", "4", "--sampler", "--settings", "float32:2"]),
        (
            "head_layers",
            ["--texts", "64", "--new-tokens", "16", "--steps", "3", "--variants", "1:teacher", "0,1:drafts"],
        ),
        ("hybrid_floor", ["--max-new-tokens", "6", "--repeats", "1", "--costs", "linear"]),
        ("recurrent", ["--max-new-tokens", "6", "--seeds", "0", "--costs", "h200", "--runs", "hybrid"]),
        (
            "head_recipe",
            RECIPE,
        ),
        ("head_greedy", ["--held-out", "0-0", "--new-tokens", "16"]),
        ("head_context", [*CONTEXT, "--prompts", "PROMPTS"]),
        (
            "recurrent",
            ["--max-new-tokens", "6", "--seeds", "0", "--runs", "head W=1", "--prompts", "PROMPTS", "PROMPTS"],
        ),
    ],
)
def test_each_analysis_script_runs_on_a_tiny_model(tiny, name, options, capsys):
    model, prompts = tiny
    own_prompts = ("phases", "head_cost", "spin_count", "cuda_graphs", "text_speed", "head_layers", "head_recipe",
                   "head_greedy", "head_context")  # fmt: skip
    prompt_flags = [] if name in own_prompts else ["--prompts", str(prompts)]
    if name in ("head_layers", "head_recipe", "head_greedy", "head_context"):
        prompt_flags = ["--cache", str(model.parent / f"{name}-cache")]
    named = {"HEAD": str(head_path(str(model))), "PROMPTS": str(prompts)}
    options = [named.get(option, option) for option in options]
    loss = fitting.training_loss
    assert run_script(name, ["--model", str(model), "--dtype", "float32", *prompt_flags, *options])
    assert capsys.readouterr().out.strip()
    assert fitting.training_loss is loss, "a script left the training loss replaced for the tests after it"


def test_text_speed_times_requests_the_target_writes(tmp_path, capsys):
    """--requests on a tiny model with a chat template (the module's tiny model has none: no requests of its own)."""
    tokenizer = word_tokenizer(WORDS)
    tokenizer.chat_template = "{% for message in messages %}write {{ message['content'] }} </s> {% endfor %}"
    model = save_tiny_model(tmp_path / "model", tokenizer, seed=0)
    [row] = run_script("text_speed", ["--model", str(model), "--requests", "1", "--settings", "float32:4"])
    assert row["batches"] == 1 and row["requests_per_second"] >= 0 and capsys.readouterr().out.strip()


def test_compare_heads_pools_two_heads_outputs_prompt_by_prompt(tiny, capsys, tmp_path):
    """compare_heads reads recurrent.py's output as printed: a second head 0.5 lower on the open-ended prompt alone is
    counted lower there, by 0.5, and the same on the grounded one."""
    model, prompts = tiny
    argv = ["--model", str(model), "--dtype", "float32", "--prompts", str(prompts), "--max-new-tokens", "6"]
    run_script("recurrent", [*argv, "--seeds", "0", "--runs", "head W=1"])
    first, second = tmp_path / "first.txt", tmp_path / "second.txt"
    first.write_text(capsys.readouterr().out)
    lines = first.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith('{"prompt": "poem"'):
            row = json.loads(line)
            lines[i] = json.dumps(row | {"head W=1": row["head W=1"] - 0.5})
    second.write_text("\n".join(lines) + "\n")
    open_ended = run_script("compare_heads", ["--set", str(prompts), str(first), str(second)])["head W=1"]
    grounded = run_script("compare_heads", ["--set", str(prompts), str(first), str(second), "--grounded"])["head W=1"]
    assert (open_ended["prompts"], open_ended["higher"], open_ended["lower"]) == (1, 1, 0)
    assert open_ended["mean_difference"] == 0.5
    assert (grounded["prompts"], grounded["higher"], grounded["lower"], grounded["mean_difference"]) == (1, 0, 0, 0.0)
