"""Each run setting is declared once, beside its config field: the page's control and the command line's flag show the
config's default and limits (the page's slider ends sooner only where the config says so), and both read back the
config's defaults when nothing is set."""

from __future__ import annotations

import argparse

import gradio as gr
import pytest

from specdemo import SamplingConfig, SpeculativeConfig
from specdemo.app.form import RUN_FIELDS, by_name, parse_request
from specdemo.cli.settings import add_pair_flags, add_run_flags, read_settings
from specdemo.config import run_settings
from tests.app_helpers import SPELLING

SETTINGS = run_settings(SamplingConfig) | run_settings(SpeculativeConfig)  # name: (default, Setting)


def cli_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_pair_flags(parser)
    add_run_flags(parser)
    return parser


def test_every_run_setting_is_on_the_page_and_on_the_command_line():
    assert list(SETTINGS) == [
        *("temperature", "top_k", "top_p", "repetition_penalty", "seed"),
        *("num_draft_tokens", "max_new_tokens", "draft_temperature", "num_candidates"),
    ]
    flags = {action.dest for action in cli_parser()._actions}
    assert set(SETTINGS) <= {spec.name for spec in RUN_FIELDS}
    assert set(SETTINGS) <= flags


@pytest.mark.parametrize("name", SETTINGS)
def test_the_pages_control_shows_the_configs_default_limits_and_label(name):
    default, spec = SETTINGS[name]
    low, high = spec.shown or (spec.low, spec.high)
    assert spec.low <= low < high <= spec.high  # a slider may end sooner, never later
    control = by_name(RUN_FIELDS, name).component()
    assert control.label == spec.label
    assert control.value == (spec.shown_default if default is None else default)  # a slider needs a number for None
    assert control.minimum == low
    if isinstance(control, gr.Slider):
        assert control.maximum == high
        assert control.step == spec.step


@pytest.mark.parametrize("name", SETTINGS)
def test_the_command_lines_flag_shows_the_configs_default_limits_and_help(name):
    default, spec = SETTINGS[name]
    [flag] = [action for action in cli_parser()._actions if action.dest == name]
    assert flag.option_strings == ["--" + name.replace("_", "-")]
    assert flag.default == default
    assert flag.type is (int if spec.whole else float)
    assert spec.help in flag.help and spec.limits() in flag.help


def test_nothing_set_is_the_configs_defaults_on_the_page_and_on_the_command_line():
    page = parse_request(SPELLING, {})  # the default pair drafts without a model: no draft temperature
    command_line = read_settings(cli_parser().parse_args([]))
    assert page.sampling == command_line.sampling == SamplingConfig()
    assert page.speculative == command_line.speculative == SpeculativeConfig()


@pytest.mark.parametrize("name", SETTINGS)
def test_the_config_refuses_just_outside_its_limits_and_takes_its_ends(name):
    _, spec = SETTINGS[name]
    config = SamplingConfig if name in run_settings(SamplingConfig) else SpeculativeConfig
    step = 1 if spec.whole else 1e-6
    kind = int if spec.whole else float
    for value in (spec.high, spec.low + (step if spec.low_open else 0)):
        config(**{name: kind(value)})
    for value in (spec.high + step, spec.low - step if not spec.low_open else spec.low):
        with pytest.raises(ValueError, match=f"^{spec.called} must be"):
            config(**{name: kind(value)})
