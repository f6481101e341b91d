"""One bad value per setting, refused with the same sentence by the page's check, the API and the command line, before
anything runs."""

from __future__ import annotations

import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError

from specdemo.app.form import RUN_FIELDS
from specdemo.app.tabs.one_prompt import check_run
from specdemo.cli.main import main
from tests.app_helpers import settings

BAD = [  # (the setting, what the page and the API send, what the command line gets, the sentence)
    ("prompt", {"prompt": "   "}, ["--prompt", "   "], "The prompt is empty"),
    ("temperature", {"temperature": -0.5}, ["--temperature", "-0.5"], "temperature must be in [0, 10]"),
    ("top_k", {"top_k": -1}, ["--top-k", "-1"], "top-k must be between 0 and"),
    ("top_p", {"top_p": 1.5}, ["--top-p", "1.5"], "top-p must be in (0, 1]"),
    ("repetition_penalty", {"repetition_penalty": 0}, ["--repetition-penalty", "0"], "repetition penalty must be in"),
    ("seed", {"seed": -1}, ["--seed", "-1"], "seed must be between 0 and"),
    ("rule", {"rule": "fair"}, ["--rule", "fair"], "rule must be 'standard' or 'coupled', got 'fair'."),
    (
        "draft_temperature",
        {"pair": "smollm2-135m-self", "draft_temperature": -1},
        ["--pair", "smollm2-135m-self", "--draft-temperature", "-1"],
        "draft temperature must be in [0, 10]",
    ),
    ("num_draft_tokens", {"num_draft_tokens": 17}, ["--num-draft-tokens", "17"], "num-draft-tokens must be between 1"),
    ("max_new_tokens", {"max_new_tokens": 0}, ["--max-new-tokens", "0"], "max-new-tokens must be between 1 and 2048"),
    ("num_candidates", {"num_candidates": 9}, ["--num-candidates", "9"], "num-candidates must be between 1 and 8"),
    ("dtype", {"dtype": "float64"}, ["--dtype", "float64"], "Unknown number format 'float64'"),
    ("pair", {"pair": "fastest"}, ["--pair", "fastest"], "Unknown pair 'fastest'"),
    ("custom_target", {"pair": "custom", "custom_target": "gpt2"}, ["--target", "gpt2"], "'gpt2' is not a valid"),
    (
        "custom_draft",
        {"pair": "custom", "custom_target": "a/b", "custom_draft": "not an id"},
        ["--target", "a/b", "--draft", "not an id"],
        "'not an id' is not a valid model id",
    ),
    ("max_ngram_size", {"max_ngram_size": 9}, ["--max-ngram-size", "9"], "max-ngram-size must be between 1 and 8"),
    (
        "min_ngram_size",
        {"min_ngram_size": 4},
        ["--min-ngram-size", "4"],
        "min-ngram-size must be at most max-ngram-size (3), got 4.",
    ),
    (
        "suffix_cache_tokens",
        {"pair": "smollm2-135m-suffix", "suffix_cache_tokens": 300_000},
        ["--draft", "suffix", "--suffix-cache-tokens", "300000"],
        "suffix-cache-tokens must be between 0 and 200000",
    ),
]
NOTHING_TO_REFUSE = {"chat", "compare"}  # checkboxes: any value is true or false


def cli_arguments(arguments: list[str]) -> list[str]:
    return ["generate", *([] if "--prompt" in arguments else ["--prompt", "hi"]), *arguments]


def test_every_setting_has_a_bad_value_here():
    assert {row[0] for row in BAD} | NOTHING_TO_REFUSE == {"prompt", *(spec.name for spec in RUN_FIELDS)}


@pytest.mark.parametrize(("setting", "sent", "arguments", "sentence"), BAD, ids=[row[0] for row in BAD])
def test_the_page_and_the_command_line_refuse_it_alike(setting, sent, arguments, sentence, capsys):
    with pytest.raises(ValueError, match=None) as refused:
        check_run(settings(**sent))  # what the page runs before a run, with the raw values it sends
    assert sentence in str(refused.value), str(refused.value)
    assert main(cli_arguments(arguments)) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("error: ") and sentence in error, error


def test_the_api_refuses_each_with_the_same_sentence(app):
    client = Client(app, verbose=False)
    for setting, sent, _, sentence in BAD:
        with pytest.raises(AppError) as refused:
            client.predict(**settings(**sent), api_name="/generate")
        assert sentence in str(refused.value), (setting, str(refused.value)[:300])
    assert "tok-" in client.predict(**settings(max_new_tokens=4, compare=False), api_name="/generate")[0]
