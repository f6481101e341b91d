"""Frozen settings for sampling and speculation, validated once with sentences a user can act on."""

from __future__ import annotations

import math
import unicodedata
from dataclasses import dataclass, replace

MAX_NUM_DRAFT_TOKENS = 16  # beyond this, verifying K+1 positions costs more than rejections save
MAX_NEW_TOKENS_LIMIT = 2048  # keeps a single run bounded in time and memory on a CPU
MAX_TOP_K = 1_000_000  # larger than any vocabulary; 0 disables top-k
MAX_REPETITION_PENALTY = 10.0  # beyond this every repeated token is effectively banned
MAX_TEMPERATURE = 10.0  # beyond this the distribution is uniform noise
MAX_NUM_CANDIDATES = 8  # W: candidate drafts per row per round; a pass then scores up to 1 + W*K tokens a row
MAX_BATCH_SIZE = 32  # rows decoded together; the cache and the W*K-token tree grow with it
MAX_PROMPT_CHARACTERS = 50_000  # refused before tokenizing: a pasted novel would take seconds just to tokenize
MAX_PROMPT_TOKENS = 4096  # half the offline default's context, so generation always has room


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
class SamplingConfig:
    """How the next token is chosen; applied identically to the target and to a draft model."""

    temperature: float = 0.0  # 0: greedy (argmax), as generate(do_sample=False)
    top_k: int = 0  # 0: off, as in transformers
    top_p: float = 1.0  # 1.0: off
    repetition_penalty: float = 1.0  # 1.0: off; CTRL-style, on prompt + everything generated so far
    seed: int = 0  # seeds the run's torch.Generator, so a run is reproducible

    def __post_init__(self) -> None:
        check_number("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        check_int("top-k", self.top_k, 0, MAX_TOP_K)
        check_number("top-p", self.top_p, 0.0, 1.0, low_open=True)
        check_number("repetition penalty", self.repetition_penalty, 0.0, MAX_REPETITION_PENALTY, low_open=True)
        check_int("seed", self.seed, 0, 2**63 - 1)
        for name in ("temperature", "top_p", "repetition_penalty"):  # transformers' processors refuse ints
            object.__setattr__(self, name, float(getattr(self, name)))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class SpeculativeConfig:
    """How much to speculate and how long to generate (a drafter's own options are its kind's: drafters/)."""

    num_draft_tokens: int = 5  # K; 5 balances acceptance and verify cost for prompt lookup on a CPU
    max_new_tokens: int = 128
    draft_temperature: float | None = None  # None: a draft model samples with the target's settings
    num_candidates: int = 1  # W: drafts per round; the target scores all W in one pass and keeps the best path

    def __post_init__(self) -> None:
        check_int("num-draft-tokens", self.num_draft_tokens, 1, MAX_NUM_DRAFT_TOKENS)
        check_int("max-new-tokens", self.max_new_tokens, 1, MAX_NEW_TOKENS_LIMIT)
        check_int("num-candidates", self.num_candidates, 1, MAX_NUM_CANDIDATES)
        if self.draft_temperature is not None:
            check_number("draft temperature", self.draft_temperature, 0.0, MAX_TEMPERATURE)
            object.__setattr__(self, "draft_temperature", float(self.draft_temperature))

    def draft_sampling(self, sampling: SamplingConfig) -> SamplingConfig:
        """What a draft model samples with: the target's settings, at draft_temperature when one is set.
        Lossless either way, since q is what the draft really sampled from."""
        if self.draft_temperature is None:
            return sampling
        return replace(sampling, temperature=self.draft_temperature)


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
