"""oneDNN's kernels: batch-invariant ones for serving (`import specdemo` caps them), the fastest for training."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from specdemo.cli import train
from specdemo.cli.main import main
from specdemo.models import onednn


@pytest.mark.parametrize(("users", "expected"), [(None, onednn.BATCH_INVARIANT), ("AVX2", "AVX2")])
def test_import_specdemo_caps_onednn_unless_the_user_chose(users, expected):
    env = {key: value for key, value in os.environ.items() if key != onednn.VARIABLE}
    if users:
        env[onednn.VARIABLE] = users
    code = f"import os, specdemo; print(os.environ[{onednn.VARIABLE!r}])"
    said = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert said.strip() == expected


@pytest.mark.parametrize(("users", "expected"), [(None, "ALL"), ("AVX2", "AVX2")])
def test_train_drafter_lifts_the_cap_before_the_target_loads_unless_the_user_chose(users, expected, monkeypatch):
    monkeypatch.setattr(onednn, "USERS_CHOICE", users)
    monkeypatch.setenv(onednn.VARIABLE, users or onednn.BATCH_INVARIANT)
    seen = []

    def load_model(name, progress):
        seen.append(os.environ[onednn.VARIABLE])
        raise RuntimeError("stop here")

    monkeypatch.setattr(train, "load_model", load_model)
    assert main(["train-drafter", "--quick"]) != 0  # the stand-in stops it, in one sentence
    assert seen == [expected]
