"""`python -m specdemo train-drafter`: every refusal is one sentence and exit code 2, before any model loads; a
disk too small for the cache is refused before anything is written."""

from __future__ import annotations

import shutil
from collections import namedtuple

import pytest

from specdemo.cli.main import main
from specdemo.training.data import DataSettings, check_disk


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--steps", "0"], "steps must be between 1 and"),
        (["--texts", "5"], "texts must be between 16 and 9600, got 5."),
        (["--texts", "9700"], "texts must be between 16 and 9600, got 9700."),  # the package holds 9,600
        (["--instructions", "both", "--texts", "19300"], "texts must be between 16 and 19200, got 19300."),
        (["--generate-batch-size", "2048"], "generate-batch-size must be between 1 and 1024, got 2048."),
        (["--new-tokens", "4000"], "new-tokens must be between 16 and 1024"),
        (["--depth", "0"], "depth must be between 1 and 16"),
        (["--vocabulary-size", "3"], "vocabulary-size must be between 16 and"),
        (["--batch-size", "0"], "batch-size must be between 1 and"),
        (["--target", "gpt-17"], "'gpt-17' is not a valid model id"),
        (["--layers", "8", "8", "-1"], "layers must be at most 8 different layers, got [8, 8, -1]."),
    ],
)
def test_train_drafter_settings_out_of_range_exit_2_with_one_sentence(arguments, message, capsys):
    assert main(["train-drafter", *arguments]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("error: ") and message in error


def test_too_little_disk_for_the_cache_is_one_sentence(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 10**6, 10**6))
    with pytest.raises(ValueError, match=r"needs about 0\.\d+ GB and its disk has 0\.00 GB free: free some space"):
        check_disk(tmp_path / "cache", DataSettings(), hidden_size=576)
    assert not list((tmp_path / "cache").iterdir())
