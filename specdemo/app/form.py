"""The one settings table: each row is a setting (its name, control, default, limits, label and help), and from the
table come the page's controls, the API's parameter names and defaults, the checked RunRequest, and the tests'
settings helper. Every run setting (sampling, speculation, a drafter kind's options), declared once with
config.setting, is a row made by one builder (run_setting); the page's own rows (the pair, chat, compare, the number
format) are Fields here."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import gradio as gr
import torch

from specdemo.config import (
    RULE_LABELS,
    SamplingConfig,
    SpeculativeConfig,
    check_prompt,
    run_settings,
    whole_number,
)
from specdemo.drafters.registry import NGRAM, drafter_names, drafter_options, option_kinds, option_settings
from specdemo.engine.setup import check_run_limits, limits_line, pair_marks
from specdemo.models.loading import (
    AUTO_DTYPE_HELP,
    DTYPE_CHOICES,
    LOCAL_PATHS_VARIABLE,
    model_dtype_reason,
    pick_device,
)
from specdemo.pairs import DEFAULT_PAIR, PAIRS, Pair, custom_pair, find_pair, pair_dtype

Control = Literal["dropdown", "textbox", "slider", "number", "checkbox", "radio"]
CUSTOM = "custom"
SAMPLING_SETTINGS = run_settings(SamplingConfig)
SPECULATION_SETTINGS = run_settings(SpeculativeConfig)
RUN_SETTINGS = SAMPLING_SETTINGS | SPECULATION_SETTINGS | option_settings()  # name: (default, Setting), every one
UI_MAX_NEW_TOKENS = int(RUN_SETTINGS["max_new_tokens"][1].shown[1])  # the slider's end, which the page enforces


@dataclass(frozen=True)
class Field:
    """One setting: how the page shows it, what the API calls it and what it defaults to, and how it is read."""

    name: str  # the API parameter, the RunRequest's key, the tests' helper key
    control: Control
    default: Any
    label: str
    low: float | None = None  # sliders and numbers
    high: float | None = None
    step: float | None = None
    choices: Sequence[Any] | Callable[[], Sequence[Any]] = ()  # dropdowns and radios: values, or (label, value)
    # pairs; a function: asked when the control is made (the pair list probes the device)
    info: str = ""  # the help under the control
    elem_id: str | None = None
    visible: bool = True
    section: str = "model"  # where the page puts it (SECTIONS)
    kind: str | None = None  # a drafter kind's option: shown when the pair drafts with that kind
    read: Callable[[Any], Any] = lambda value: value  # the raw value (a float from a number field...) as the setting

    def component(self, **changes: Any) -> gr.components.Component:
        """This setting's control on the page (`changes`: another elem_id or default, for another tab)."""
        spec = replace(self, **changes)
        choices = list(spec.choices() if callable(spec.choices) else spec.choices)
        common = {"label": spec.label, "visible": spec.visible, "elem_id": spec.elem_id, "info": spec.info or None}
        if spec.control == "slider":
            return gr.Slider(spec.low, spec.high, value=spec.default, step=spec.step, **common)
        if spec.control == "number":
            return gr.Number(spec.default, minimum=spec.low, step=spec.step, **common)
        if spec.control == "dropdown":
            return gr.Dropdown(choices, value=spec.default, **common)
        if spec.control == "radio":
            return gr.Radio(choices, value=spec.default, **common)
        if spec.control == "checkbox":
            return gr.Checkbox(spec.default, **common)
        return gr.Textbox(spec.default, lines=1 if spec.step is None else int(spec.step), **common)


@dataclass(frozen=True)
class LeftOut:
    """A listed pair this server does not offer, found at startup (app/serving/startup.py), and why."""

    why: str  # a few words after its label in the pair list, e.g. "its drafter does not match this target"
    sentence: str  # the problem and the way forward: the startup log's line, the pair's note, a run's refusal


LEFT_OUT: dict[str, LeftOut] = {}  # by pair key: set once at startup (leave_out), before the page is built


def pair_choices(device: torch.device) -> list[tuple[str, str]]:
    """The pair dropdown's (label, key) choices, each label marked when the server left the pair out at startup
    (LEFT_OUT), else when it is too big for `device` in the format auto picks there, or gated with no Hub token set
    (engine.setup.pair_marks); then the custom pair."""
    marks = pair_marks(device) | {key: f" — not offered here: {found.why}" for key, found in LEFT_OUT.items()}
    return [(pair.label + marks[pair.key], pair.key) for pair in PAIRS] + [("Custom: any two Hub ids", CUSTOM)]


def offered_pairs() -> list[tuple[str, str]]:
    """The pair dropdown's choices on the device the cache loads models on: asked when the page is built, never at
    import (importing the form probes no device)."""
    return pair_choices(pick_device())


def leave_out(left_out: Mapping[str, LeftOut]) -> None:
    """The pairs the server does not offer, marked in the pair list and said in their note; at startup, before the
    page makes its controls from RUN_FIELDS."""
    LEFT_OUT.clear()
    LEFT_OUT.update(left_out)


def whole(name: str) -> Callable[[Any], int]:
    return lambda value: whole_number(name, value)


RULE_INFO = (  # one sentence on each choice, by the label the page shows it with
    f"{RULE_LABELS['standard'].capitalize()}: a draft token is accepted with min(1, p/q), exact in distribution; the "
    f"text depends on the drafter. {RULE_LABELS['coupled'].capitalize()}: one noise per position picks the target's "
    "token and the draft's, so a sampled run writes the target's own text for its seed, whatever drafts (in "
    "bfloat16 a near-tie or a token at the top-k or top-p edge can round apart between pass shapes: the summary then "
    "says where and why)."
)
SECTIONS = {"model": None, "sampling": "Sampling", "speculation": "Speculation", "drafter": "Drafter options"}
PLACES: dict[str, dict[str, Any]] = {  # a run setting's control and place where they differ from run_setting's own
    "temperature": {"elem_id": "temperature"},
    "draft_temperature": {"visible": False, "section": "sampling"},
    "num_draft_tokens": {"control": "slider", "read_as": "draft tokens per round", "elem_id": "num-draft-tokens"},
    "max_new_tokens": {"control": "slider", "read_as": "max new tokens", "elem_id": "max-new-tokens"},
    "num_candidates": {"control": "slider", "read_as": "candidates per round (W)", "elem_id": "num-candidates"},
    "rule": {"labels": RULE_LABELS, "info": RULE_INFO, "elem_id": "rule"},
}


def run_setting(name: str) -> Field:
    """A row made from a run setting as its config declares it: its default (or what the page shows for None), its
    limits (or the slider's narrower ends), step and label. Its control: a radio for a choice among words (labelled
    by `labels`), a number field for a whole number, a slider for the rest; its section: its config's, a drafter
    option's shown with its kind; PLACES changes these, and `read_as` names a whole number in the page's sentence."""
    kind = option_kinds().get(name)  # the registry as it is now: a kind registered later has its rows too
    default, spec = option_settings()[name] if kind is not None else RUN_SETTINGS[name]
    own = {"section": "sampling" if name in SAMPLING_SETTINGS else "speculation"}
    if kind is not None:  # shown with its kind's other options, when the pair drafts with it
        own = {
            "section": "drafter",
            "kind": kind.name,
            "visible": kind.name == DEFAULT_PAIR.drafter,
            "elem_id": spec.called,
            "info": f"{spec.help} ({spec.low:,.0f} to {spec.high:,.0f})",
        }
    place = own | PLACES.get(name, {})
    labels = place.pop("labels", {})
    read_as = place.pop("read_as", spec.called)
    if spec.choices:  # the config checks the value, with its sentence
        choices = [(labels.get(choice, choice), choice) for choice in spec.choices]
        return Field(name, place.pop("control", "radio"), default, spec.label, choices=choices, **place)
    control = place.pop("control", "number" if spec.whole else "slider")
    low, high = spec.shown or (spec.low, spec.high)
    shown_default = spec.shown_default if default is None else default
    read = whole(read_as) if spec.whole else (lambda value: value)
    return Field(name, control, shown_default, spec.label, low, high, spec.step, read=read, **place)


PAGE_ROWS = {  # the page's own rows, which no config declares
    "pair": Field("pair", "dropdown", DEFAULT_PAIR.key, "Draft / target pair", choices=offered_pairs, elem_id="pair"),
    "custom_target": Field("custom_target", "textbox", "", "Target (Hub id)", elem_id="custom-target", visible=False),
    "custom_draft": Field(
        "custom_draft",
        "textbox",
        NGRAM,
        f"Drafter (a Hub id, or {drafter_names()})",
        elem_id="custom-draft",
        visible=False,
    ),
    "chat": Field("chat", "checkbox", True, "Apply the chat template", section="speculation", read=bool),
    "compare": Field(
        "compare", "checkbox", True, "Then run the target alone, to compare", section="speculation", read=bool
    ),
    "dtype": Field(
        "dtype",
        "dropdown",
        "auto",
        f"Number format (auto: {AUTO_DTYPE_HELP})",
        choices=list(DTYPE_CHOICES),
        elem_id="dtype",
        read=str,
    ),
}
API_ORDER = (  # positional clients keep working: a row or setting not named here follows, in its table's order
    "pair",
    "custom_target",
    "custom_draft",
    "temperature",
    "top_k",
    "top_p",
    "repetition_penalty",
    "draft_temperature",
    "num_draft_tokens",
    "max_new_tokens",
    "seed",
    "chat",
    "compare",
    "num_candidates",
    "dtype",
    "max_ngram_size",
    "min_ngram_size",
    "suffix_cache_tokens",
    "rule",
)
RUN_FIELDS: list[Field] = [  # the page's own rows and every run setting, in the API's order
    PAGE_ROWS[name] if name in PAGE_ROWS else run_setting(name)
    for name in (*API_ORDER, *(name for name in PAGE_ROWS | RUN_SETTINGS if name not in API_ORDER))
]


def by_name(fields: Sequence[Field], name: str) -> Field:
    return next(spec for spec in fields if spec.name == name)


def names(fields: Sequence[Field] = RUN_FIELDS) -> list[str]:
    """The settings' names in the table's order: the handlers' positional values after the prompt."""
    return [spec.name for spec in fields]


def defaults(fields: Sequence[Field] = RUN_FIELDS, **changes: Any) -> dict[str, Any]:
    """The settings by name at their defaults (a user's starting point), with `changes`."""
    return {spec.name: spec.default for spec in fields} | changes


def signature(leading: Sequence[inspect.Parameter], fields: Sequence[Field], **overrides: Any) -> inspect.Signature:
    """A handler's signature: `leading` (the prompt), then every setting by name with its default (or `overrides`),
    then Gradio's progress tracker. The API page lists these names, and a client may send only what it changes."""
    settings = [
        inspect.Parameter(
            spec.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=overrides.get(spec.name, spec.default)
        )
        for spec in fields
    ]
    progress = inspect.Parameter(
        "progress", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=gr.Progress(), annotation=gr.Progress
    )
    return inspect.Signature([*leading, *settings, progress])


@dataclass(frozen=True)
class RunRequest:
    """Everything a run needs, checked: the pair and the settings, and every setting by name as it was read."""

    prompt: str
    pair: Pair
    sampling: SamplingConfig
    speculative: SpeculativeConfig
    drafter_options: object | None  # the pair's drafter kind's options; None for a draft model
    chat: bool
    compare: bool
    allow_local: bool  # the operator allowed local directories (SPECDEMO_ALLOW_LOCAL_PATHS=1)
    dtype: torch.dtype  # weights and activations, from the form's Number format on this device
    dtype_reason: str  # what the page says, e.g. "float32 (auto: this CPU has no native bfloat16)"
    values: dict[str, Any] = field(default_factory=dict)  # every setting, read


def parse_request(prompt: str, values: dict[str, Any]) -> RunRequest:
    """The form's values (by name; missing ones at their defaults) as checked settings; a ValueError names the first
    bad one."""
    check_prompt(prompt)
    read = {spec.name: spec.read(values.get(spec.name, spec.default)) for spec in RUN_FIELDS}
    if read["max_new_tokens"] > UI_MAX_NEW_TOKENS:  # below 1, SpeculativeConfig's sentence
        raise ValueError(
            f"max new tokens must be between 1 and {UI_MAX_NEW_TOKENS} here, got {values.get('max_new_tokens')}."
        )
    allow_local = os.environ.get(LOCAL_PATHS_VARIABLE) == "1"
    pair_key = read["pair"]
    custom_draft = str(read["custom_draft"] or "").strip() or NGRAM
    pair = (
        custom_pair(str(read["custom_target"] or "").strip(), custom_draft, allow_local)
        if pair_key == CUSTOM
        else (find_pair(pair_key))
    )
    sampling = SamplingConfig(**{name: read[name] for name in SAMPLING_SETTINGS})
    speculative = SpeculativeConfig(
        **{name: read[name] for name in SPECULATION_SETTINGS}
        | {"draft_temperature": read["draft_temperature"] if pair.uses_draft_model else None}
    )
    options = drafter_options(pair.drafter, read)  # the other kinds' options are hidden on the page: not read
    device = pick_device()  # where the cache loads models
    dtype = pair_dtype(pair, read["dtype"], device)
    reason = model_dtype_reason(read["dtype"], device, pair.model_names)
    check_run_limits(pair, device, dtype, speculative.max_new_tokens + 1, speculative.num_candidates)
    limits = limits_line(pair, device, dtype)
    reason = f"{reason}; {limits[0].lower()}{limits[1:]}" if limits else reason
    chat, compare = read["chat"], read["compare"]
    return RunRequest(prompt, pair, sampling, speculative, options, chat, compare, allow_local, dtype, reason, read)


def describe_pair(pair_key: str) -> list:
    """What changes with the pair, however it was set: its note, the custom id fields, whether the draft temperature
    shows (draft models only) and the options of the kind it drafts with (the others hidden). No value changes here:
    a shared link or a lesson that sets the pair sets the values that go with it."""
    custom = pair_key == CUSTOM
    pair = None if custom else find_pair(pair_key)
    note = (
        f"Type a target and a drafter that share a tokenizer, or {drafter_names()} as the drafter."
        if custom
        else (pair.note)
    )
    if pair_key in LEFT_OUT:
        note = f"**Not offered here.** {LEFT_OUT[pair_key].sentence}\n\n{note}"
    draft_model = custom or pair.uses_draft_model
    updates = [note, gr.update(visible=custom), gr.update(visible=custom), gr.update(visible=draft_model)]
    kinds = {spec.kind for spec in RUN_FIELDS if spec.kind}
    drafter = pair.drafter if pair is not None else None
    updates += [gr.update(visible=custom or kind == drafter) for kind in sorted(kinds)]  # one column per kind
    return updates


def pair_draft_temperature(pair_key: str) -> Any:
    """The draft temperature a pair suggests, when a person picks the pair (its own, or 0 for a draft model without
    one); other pairs leave the value alone."""
    pair = None if pair_key == CUSTOM else find_pair(pair_key)
    if pair is None or not pair.uses_draft_model:
        return gr.skip()
    return pair.draft_temperature or 0.0
