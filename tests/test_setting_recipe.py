"""The recipe for a new sampling setting (docs/how-it-works.md, "Adding things"), followed end to end for every setting
SamplingConfig declares: declared once in config.py, it is a control of the page's form read into the run's
SamplingConfig, a command-line flag read into the CLI's, it changes p as the eager rule computes it
(core/sampling.logits_to_probs with build_warpers), and the captured rule's row settings carry it (core/fixed_rule's
RowSettings, written into a row's ROW_COLUMNS by models/fixed_pass.write_row), so that the captured rule's p equals the
eager rule's; or it is listed in NOT_IN_P, with why. Planted: --top-p dropped from the CLI's loop, and top-k dropped
from RowSettings.of; each fails its case."""

from __future__ import annotations

from dataclasses import fields, replace

import numpy as np
import pytest
import torch

from specdemo.app.form import RUN_FIELDS, SECTIONS, by_name, parse_request
from specdemo.cli.main import build_parser
from specdemo.cli.settings import flag, read_settings
from specdemo.config import SamplingConfig, run_settings
from specdemo.core.fixed_rule import RowSettings, processed_probs, seen_along
from specdemo.core.rules import rule_for
from specdemo.core.sampling import build_warpers, logits_to_probs
from specdemo.core.verdicts import RoundAsk
from specdemo.models.fixed_pass import INPUT_COLUMNS, PASS_COLUMNS, ROW_COLUMNS, write_row

# N = positions of the pass, V = vocab_size
SETTINGS = run_settings(SamplingConfig)
BASE = SamplingConfig(temperature=1.0)  # sampled, every filter and the penalty off: any setting that moves shows
CHANGED = {  # each setting at a value other than BASE's, within its limits
    "temperature": 0.5,
    "top_k": 3,
    "top_p": 0.5,
    "repetition_penalty": 1.5,
    "seed": 7,
    "rule": "coupled",
}
NOT_IN_P = {  # settings that are not what p is, so neither rule's p reads them
    "seed": "it seeds the draws made from p (the captured rule's own column, `seed`), not p",
    "rule": "it chooses how drafts are tested against p (the standard or the coupled rule), not p",
}
SEQUENCE, DRAFT, VOCAB = [1, 2, 3, 4], [5, 6], 16  # the penalty's tokens are in both the sequence and the draft


def test_every_sampling_setting_has_a_value_to_follow():
    """A new setting fails here until CHANGED holds a value for it (and NOT_IN_P names it, if p does not read it)."""
    assert set(CHANGED) == set(SETTINGS)
    assert set(NOT_IN_P) < set(SETTINGS)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_the_form_shows_it_and_reads_it_into_the_runs_settings(name):
    field = by_name(RUN_FIELDS, name)
    assert field.label == SETTINGS[name][1].label and field.section in SECTIONS
    field.component()  # the control the page makes
    request = parse_request("Hello", {"temperature": BASE.temperature, name: CHANGED[name]})
    assert request.sampling == replace(BASE, **{name: CHANGED[name]})


@pytest.mark.parametrize("name", list(SETTINGS))
def test_the_command_line_has_its_flag_and_reads_it_into_the_runs_settings(name):
    argv = ["generate", "--prompt", "Hello", "--temperature", str(BASE.temperature), flag(name), str(CHANGED[name])]
    assert read_settings(build_parser().parse_args(argv)).sampling == replace(BASE, **{name: CHANGED[name]})


def eager_probs(sampling: SamplingConfig, logits: torch.Tensor) -> torch.Tensor:  # [1, N, V]
    context_ids = torch.tensor([SEQUENCE + DRAFT])  # [1, T+N-1]
    return logits_to_probs(logits, context_ids, sampling, build_warpers(sampling))


def captured_probs(settings: RowSettings, logits: torch.Tensor) -> torch.Tensor:  # [1, N, V]
    ids = torch.tensor([SEQUENCE[-1:] + DRAFT])  # [1, N] the pass's input: the last token, then the draft
    seen = torch.zeros(1, VOCAB, dtype=torch.bool)  # [1, V]
    seen[0, SEQUENCE] = True
    return processed_probs(logits, seen_along(seen, ids, torch.ones_like(ids, dtype=torch.bool)), settings)


def written_settings(sampling: SamplingConfig) -> RowSettings:
    """The row settings a captured round reads back from the row write_row fills (models/fixed_pass.round_rule)."""
    row = np.zeros(INPUT_COLUMNS)
    write_row(row, RoundAsk(SEQUENCE, [DRAFT], 32, sampling, rule_for(sampling), seed=0, draws=0, round_index=0))
    column = dict(zip(ROW_COLUMNS, torch.from_numpy(row[4 * PASS_COLUMNS :]), strict=True))
    of = RowSettings.of([sampling], torch.device("cpu"))
    return RowSettings(**{spec.name: column[spec.name][None].to(getattr(of, spec.name).dtype) for spec in fields(of)})


@pytest.mark.parametrize("name", [name for name in SETTINGS if name not in NOT_IN_P])
def test_it_changes_the_eager_rules_p_and_the_captured_rule_carries_it(name):
    logits = torch.randn(1, len(DRAFT) + 1, VOCAB, generator=torch.Generator().manual_seed(0))  # [1, N, V]
    changed = replace(BASE, **{name: CHANGED[name]})
    assert not torch.equal(eager_probs(changed, logits), eager_probs(BASE, logits)), f"{name} leaves p alone"
    assert {spec.name for spec in fields(RowSettings)} <= set(ROW_COLUMNS)
    for sampling in (BASE, changed):
        expected = eager_probs(sampling, logits)
        assert torch.equal(captured_probs(RowSettings.of([sampling], torch.device("cpu")), logits), expected)
        assert torch.equal(captured_probs(written_settings(sampling), logits), expected)
