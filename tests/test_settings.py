"""Each run setting is declared once, beside its config field: the page's control and the command line's flag show the
config's default and limits (the page's slider ends sooner only where the config says so), and both read back the
config's defaults when nothing is set."""

from __future__ import annotations

import argparse

import gradio as gr
import pytest

from specdemo import SamplingConfig, SpeculativeConfig
from specdemo.app.form import RUN_FIELDS, by_name, parse_request
from specdemo.cli.settings import add_pair_flags, add_run_flags, flag, read_settings
from specdemo.config import RULE_LABELS, run_settings
from tests.app_helpers import SPELLING

SETTINGS = run_settings(SamplingConfig) | run_settings(SpeculativeConfig)  # name: (default, Setting)
NUMBERS = [name for name, (_, spec) in SETTINGS.items() if not spec.choices]
CHOICES = [name for name, (_, spec) in SETTINGS.items() if spec.choices]  # a choice among words: the rule


def cli_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_pair_flags(parser)
    add_run_flags(parser)
    return parser


def test_every_run_setting_is_on_the_page_and_on_the_command_line():
    assert list(SETTINGS) == [
        *("temperature", "top_k", "top_p", "repetition_penalty", "seed", "rule"),
        *("num_draft_tokens", "max_new_tokens", "draft_temperature", "num_candidates"),
    ]
    flags = {action.dest for action in cli_parser()._actions}
    assert set(SETTINGS) <= {spec.name for spec in RUN_FIELDS}
    assert set(SETTINGS) <= flags


@pytest.mark.parametrize("name", NUMBERS)
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


@pytest.mark.parametrize("name", CHOICES)
def test_the_pages_choice_shows_the_configs_choices_default_and_label_each_choice_named_and_explained(name):
    default, spec = SETTINGS[name]
    control = by_name(RUN_FIELDS, name).component()
    assert isinstance(control, gr.Radio) and control.label == spec.label and control.value == default
    assert [value for _, value in control.choices] == list(spec.choices)
    assert [label for label, _ in control.choices] == [RULE_LABELS[choice] for choice in spec.choices]
    assert all(label.capitalize() + ": " in control.info for label, _ in control.choices)  # a sentence on each


@pytest.mark.parametrize("name", SETTINGS)
def test_the_command_lines_flag_shows_the_configs_default_limits_and_help(name):
    default, spec = SETTINGS[name]
    [flag] = [action for action in cli_parser()._actions if action.dest == name]
    assert flag.option_strings == ["--" + name.replace("_", "-")]
    assert flag.default == default
    assert flag.type is (str if spec.choices else int if spec.whole else float)
    assert spec.help in flag.help and spec.limits() in flag.help


def test_nothing_set_is_the_configs_defaults_on_the_page_and_on_the_command_line():
    page = parse_request(SPELLING, {})  # the default pair drafts without a model: no draft temperature
    command_line = read_settings(cli_parser().parse_args([]))
    assert page.sampling == command_line.sampling == SamplingConfig()
    assert page.speculative == command_line.speculative == SpeculativeConfig()


@pytest.mark.parametrize("name", CHOICES)
def test_each_choice_is_read_alike_on_the_page_and_on_the_command_line_and_another_word_is_refused(name):
    _, spec = SETTINGS[name]
    config = SamplingConfig if name in run_settings(SamplingConfig) else SpeculativeConfig
    for choice in spec.choices:
        page = parse_request(SPELLING, {name: choice, "temperature": 0.8})
        command_line = read_settings(cli_parser().parse_args([flag(name), choice, "--temperature", "0.8"]))
        assert getattr(page.sampling, name) == getattr(command_line.sampling, name) == choice
        assert page.sampling == command_line.sampling == SamplingConfig(temperature=0.8, **{name: choice})
    for word in ("fair", choice.upper(), ""):
        with pytest.raises(ValueError, match=f"^{spec.called} must be {spec.limits()}, got {word!r}.$"):
            config(**{name: word})
        with pytest.raises(ValueError, match=f"^{spec.called} must be {spec.limits()}, got {word!r}.$"):
            parse_request(SPELLING, {name: word})


@pytest.mark.parametrize("name", NUMBERS)
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
