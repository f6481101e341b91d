"""Frozen settings for sampling and speculation, validated once with sentences a user can act on."""

from __future__ import annotations

import math
import unicodedata
from dataclasses import dataclass, field, fields, replace
from typing import Any

MAX_NUM_DRAFT_TOKENS = 16  # beyond this, verifying K+1 positions costs more than rejections save
MAX_NEW_TOKENS_LIMIT = 2048  # keeps a single run bounded in time and memory on a CPU
MAX_TOP_K = 1_000_000  # larger than any vocabulary; 0 disables top-k
MAX_REPETITION_PENALTY = 10.0  # beyond this every repeated token is effectively banned
MAX_TEMPERATURE = 10.0  # beyond this the distribution is uniform noise
MAX_NUM_CANDIDATES = 8  # W: candidate drafts per row per round; a pass then scores up to 1 + W*K tokens a row
MAX_BATCH_SIZE = 32  # rows decoded together; the cache and the W*K-token tree grow with it
MAX_PROMPT_CHARACTERS = 50_000  # refused before tokenizing: a pasted novel would take seconds just to tokenize
MAX_PROMPT_TOKENS = 4096  # half the offline default's context, so generation always has room
RULES = ("standard", "coupled")  # SamplingConfig.rule: core/verify.py's and core/coupled.py's
RULE_LABELS = {"standard": "standard", "coupled": "same text for any drafter"}  # as the page names them


def check_number(name: str, value: float, low: float, high: float, *, low_open: bool = False) -> None:
    """Raise a ValueError naming `name` unless low <= value <= high (low < value when low_open)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{name} must be a number, got {value!r}.")
    too_low = value <= low if low_open else value < low
    if too_low or value > high:
        left = "(" if low_open else "["
        raise ValueError(f"{name} must be in {left}{low:g}, {high:g}], got {value!r}.")


def check_int(name: str, value: int, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be a whole number, got {value!r}.")
    if not low <= value <= high:
        raise ValueError(f"{name} must be between {low} and {high}, got {value}.")


@dataclass(frozen=True)
class Setting:
    """A run setting's limits and words, declared once beside its config field: `__post_init__` checks the value
    against the limits, and the page's control and the command line's flag show the label, help and limits from here."""

    called: str  # how a sentence names it: "top-k", "num-draft-tokens"
    low: float
    high: float
    label: str  # the page's control
    help: str  # one line: the flag's help
    low_open: bool = False  # (low, high]: low itself is refused
    whole: bool = False  # a whole number (check_int), else any number in the limits
    step: float = 1  # the page slider's step
    shown: tuple[float, float] | None = None  # the page slider's ends, where they are narrower than the limits
    shown_default: float | None = None  # what the page shows for a default of None (a slider needs a number)
    choices: tuple[str, ...] = ()  # a choice among words, not a number: low and high are unused

    def check(self, value: float | str) -> None:
        if self.choices:
            if value not in self.choices:
                raise ValueError(f"{self.called} must be {self.limits()}, got {value!r}.")
        elif self.whole:
            check_int(self.called, value, int(self.low), int(self.high))
        else:
            check_number(self.called, value, self.low, self.high, low_open=self.low_open)

    def limits(self) -> str:
        """The limits as a sentence writes them: 1..16 for whole numbers, [0, 10] or (0, 1] for others, "standard or
        coupled" for choices."""
        if self.choices:
            return " or ".join(repr(choice) for choice in self.choices)
        if self.whole:
            return f"{int(self.low):,}..{int(self.high):,}"
        return f"{'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"


def setting(default: Any, called: str, **limits_and_words: Any) -> Any:
    """A config field that carries its Setting (what `run_settings` reads back)."""
    return field(default=default, metadata={"setting": Setting(called, **limits_and_words)})


def run_settings(config: type | object) -> dict[str, tuple[Any, Setting]]:
    """A config's settings by field name, in field order: (its default, its Setting)."""
    return {spec.name: (spec.default, spec.metadata["setting"]) for spec in fields(config)}  # type: ignore[arg-type]


def check_settings(config: object) -> None:
    """Every setting within its limits (None passes where None is the default), in field order; the numbers that are
    not whole become floats (transformers' logits processors refuse ints)."""
    for name, (default, spec) in run_settings(config).items():
        value = getattr(config, name)
        if value is None and default is None:
            continue
        spec.check(value)
        if not (spec.whole or spec.choices):
            object.__setattr__(config, name, float(value))


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen; applied identically to the target and to a draft model."""

    temperature: float = setting(  # 0: greedy (argmax), as generate(do_sample=False)
        0.0,
        "temperature",
        low=0.0,
        high=MAX_TEMPERATURE,
        label="Temperature (0 = greedy)",
        help="0 = greedy (argmax)",
        step=0.05,
        shown=(0, 2),  # the page's slider: where useful values lie
    )
    top_k: int = setting(  # 0: off, as in transformers
        0,
        "top-k",
        low=0,
        high=MAX_TOP_K,
        label="Top-k (0 = off)",
        help="0 = off",
        whole=True,
    )
    top_p: float = setting(  # 1.0: off
        1.0,
        "top-p",
        low=0.0,
        high=1.0,
        low_open=True,
        label="Top-p (1 = off)",
        help="1 = off",
        step=0.01,
        shown=(0.05, 1),
    )
    repetition_penalty: float = setting(  # 1.0: off; CTRL-style, on prompt + everything generated so far
        1.0,
        "repetition penalty",
        low=0.0,
        high=MAX_REPETITION_PENALTY,
        low_open=True,
        label="Repetition penalty (1 = off)",
        help="1 = off; on the prompt and everything generated so far",
        step=0.05,
        shown=(1, 2),
    )
    seed: int = setting(  # seeds the run's torch.Generator, so a run is reproducible
        0,
        "seed",
        low=0,
        high=2**63 - 1,
        label="Seed",
        help="seeds the run's random draws",
        whole=True,
    )
    rule: str = setting(  # how drafts are verified; both are exact, "coupled" also gives target-only's very text
        "standard",
        "rule",
        low=0,
        high=0,
        choices=RULES,
        label="Acceptance rule",
        help="standard: accept a draft token with min(1, p/q), redraw from the residual (the text depends on the "
        "drafter); coupled: one noise per position decides both the target's token and the draft's, so a sampled run "
        "writes target-only decoding's text for its seed, whatever drafts (in bfloat16, a near-tie or a token at the "
        "top-k or top-p edge can round apart between pass shapes)",
    )

    def __post_init__(self) -> None:
        check_settings(self)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def is_coupled(self) -> bool:
        """The coupled rule on a sampled run (greedy decoding is already the coupled walk with no noise)."""
        return self.rule == "coupled" and not self.is_greedy


@dataclass(frozen=True)
class SpeculativeConfig:
    """How much to speculate and how long to generate (a drafter's own options are its kind's: drafters/)."""

    num_draft_tokens: int = setting(  # K; 5 balances acceptance and verify cost for prompt lookup on a CPU
        5,
        "num-draft-tokens",
        low=1,
        high=MAX_NUM_DRAFT_TOKENS,
        label="Draft tokens per round (γ; the most, for a cost-aware drafter)",
        help="K: tokens drafted per round (the most, for a cost-aware drafter)",
        whole=True,
    )
    max_new_tokens: int = setting(
        128,
        "max-new-tokens",
        low=1,
        high=MAX_NEW_TOKENS_LIMIT,
        label="Max new tokens",
        help="tokens to generate at most",
        whole=True,
        shown=(1, 512),  # the page's end (it refuses more): a run stays well under a minute on a CPU
    )
    draft_temperature: float | None = setting(  # None: a draft model samples with the target's settings
        None,
        "draft temperature",
        low=0.0,
        high=MAX_TEMPERATURE,
        label="Draft temperature (the draft samples at its own)",
        help="a draft model's own temperature (unset: the pair's, else the target's settings)",
        step=0.05,
        shown=(0, 2),
        shown_default=1.5,  # shown for draft-model pairs only, whose pick sets it: SmolLM2-135M's own
    )
    num_candidates: int = setting(  # W: drafts per round; the target scores all W in one pass, keeps the best path
        1,
        "num-candidates",
        low=1,
        high=MAX_NUM_CANDIDATES,
        label="Candidates per round (W): drafts the target checks together",
        help="W: candidate drafts per round, scored together in one pass",
        whole=True,
    )

    def __post_init__(self) -> None:
        check_settings(self)

    def draft_sampling(self, sampling: SamplingConfig) -> SamplingConfig:
        """What a draft model samples with: the target's settings, at draft_temperature when one is set.
        Lossless either way, since q is what the draft really sampled from."""
        if self.draft_temperature is None:
            return sampling
        return replace(sampling, temperature=self.draft_temperature)


def check_row_seeds(seed: int, num_rows: int, rows: str) -> None:
    """Row k of a batch decodes with seed + k - 1, so a valid seed can still push the last rows past the limit: one
    sentence naming the last row and the largest usable seed, before any model loads. `rows` names them ("the 3
    prompts in 'prompts.jsonl'")."""
    largest = run_settings(SamplingConfig)["seed"][1].high
    last_seed = seed + num_rows - 1
    if last_seed > largest:
        raise ValueError(
            f"Seed {seed} is too large for {rows}: row k decodes with seed + k - 1, so the last row (row {num_rows}) "
            f"would need seed {last_seed}, past the largest seed {largest}; use seed {largest - num_rows + 1} or less."
        )


def check_batch_size(batch_size: int) -> None:
    check_int("batch-size", batch_size, 1, MAX_BATCH_SIZE)


def check_prompt(text: str) -> None:
    """Refuse a prompt with nothing to continue, a huge one, or one with control characters."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("The prompt is empty: type some text for the model to continue.")
    if len(text) > MAX_PROMPT_CHARACTERS:
        raise ValueError(f"The prompt is {len(text):,} characters; the limit is {MAX_PROMPT_CHARACTERS:,}: shorten it.")
    control = next((char for char in text if unicodedata.category(char) == "Cc" and char not in "\n\r\t"), None)
    if control is not None:
        raise ValueError(
            f"The prompt contains the control character U+{ord(control):04X}: remove it (newlines and tabs are fine)."
        )


def check_prompt_fits(num_prompt_tokens: int, max_new_tokens: int, context_length: int) -> None:
    """Refuse a prompt that, with the tokens to generate, would not fit in the model's context."""
    if num_prompt_tokens > MAX_PROMPT_TOKENS:
        raise ValueError(f"The prompt is {num_prompt_tokens:,} tokens; the limit is {MAX_PROMPT_TOKENS:,}: shorten it.")
    if num_prompt_tokens + max_new_tokens > context_length:
        raise ValueError(
            f"The prompt is {num_prompt_tokens:,} tokens and max-new-tokens is {max_new_tokens}, but the model's "
            f"context holds {context_length} tokens: shorten the prompt or lower max-new-tokens."
        )


def whole_number(name: str, value: float | None) -> int:
    """A whole number from a number field (which may send 3.0, or None when emptied)."""
    if value is None or isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise ValueError(f"{name} must be a whole number, got {value!r}.")
    if value != int(value):
        raise ValueError(f"{name} must be a whole number, got {value}.")
    return int(value)
