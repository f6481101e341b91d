"""ZeroGPU: the page's GPU functions through `spaces.GPU` (elsewhere they are the functions themselves), how long each
asks to be lent the GPU for, the pairs a ZeroGPU Space loads at startup, and a quota too small said in one sentence.

On ZeroGPU the Space's own process has no GPU. `spaces.GPU` runs each call in a worker process forked from it, with
the GPU lent for the call: the call's arguments and every value it yields are pickled across, the worker sees the
models as they were when it was forked (so they are loaded at startup, never inside a call), and nothing a call leaves
in the worker outlives the worker. A call is refused when the visitor's daily quota holds less than its duration."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterator
from functools import wraps
from typing import TypeVar

import gradio as gr

from specdemo.app.serving.messages import user_error
from specdemo.models.platform import on_zerogpu
from specdemo.pairs import DEFAULT_PAIR, PAIRS_BY_KEY, Pair

ON_ZEROGPU = on_zerogpu()  # read once, as `spaces` reads it at import
# Estimates, not yet measured on ZeroGPU: a visitor's daily quota is 2 minutes (anonymous) to 40 (PRO), and spaces
# charges a call's seconds 1.5 times on half a Blackwell card, so a call asks for what its settings need, no more.
START_SECONDS = 15  # a call's fixed cost: the worker's start, the weights moved to the GPU, pass costs measured
SECONDS_PER_TOKEN = 0.03  # a decoded token, generous: our target-only decoding takes 11-12 ms a token on an H200
MIN_SECONDS, MAX_SECONDS = 20, 120  # what a call asks for; 120 s is also a run's budget elsewhere
MARGIN_SECONDS = 5  # a run's own budget ends this long before the GPU is taken back, so it stops and says so
PAIRS_VARIABLE = "SPECDEMO_ZEROGPU_PAIRS"  # comma-separated pair keys an operator loads at startup instead
DEFAULT_PAIRS = (  # every SmolLM2-135M pair, and the Hub pairs of up to 1.7B (8.4 GB in bfloat16 in all)
    "smollm2-135m-ngram",
    "smollm2-135m-suffix",
    "smollm2-135m-recurrent",
    "smollm2-135m-hybrid",
    "smollm2-135m-self",
    "smollm2-135m-360m",
    "smollm2-135m-1.7b",
    "qwen2.5-0.5b-1.5b",
)
QUOTA_TITLES = ("ZeroGPU quota exceeded", "ZeroGPU illegal duration")  # spaces' titles for a call it refuses

Function = TypeVar("Function", bound=Callable)


def gpu_function(function: Function, seconds: Callable[..., int]) -> Function:
    """`function` (a generator function or a plain one) lent the GPU for `seconds(*args, **kwargs)` per call on
    ZeroGPU, with a refusal for want of quota said in one sentence; elsewhere `function` itself. Made once per
    function: `spaces` keeps a call's worker for that function's next call."""
    if not ON_ZEROGPU:
        return function
    import spaces  # only on ZeroGPU, where app.py imported it before torch

    lent = spaces.GPU(function, duration=seconds)
    if not inspect.isgeneratorfunction(function):  # as spaces decides (it looks through functools.partial)

        @wraps(function)
        def call(*args, **kwargs):
            try:
                return lent(*args, **kwargs)
            except gr.Error as error:
                raise quota_refusal(error, seconds(*args, **kwargs)) from error

        return call  # type: ignore[return-value]

    @wraps(function)
    def steps(*args, **kwargs) -> Iterator:
        try:
            yield from lent(*args, **kwargs)  # closing this generator closes spaces' own, which stops the worker's
        except gr.Error as error:
            raise quota_refusal(error, seconds(*args, **kwargs)) from error

    return steps  # type: ignore[return-value]


def quota_refusal(error: gr.Error, seconds: int) -> gr.Error:
    """A ZeroGPU refusal for want of quota as one sentence of ours: how long the run needs and what to lower; any other
    error as it was."""
    if getattr(error, "title", None) not in QUOTA_TITLES:
        return error
    return user_error(
        f"This run asks ZeroGPU for {seconds} s of GPU time and your quota has less left ({error.message}): lower max "
        "new tokens, turn off the comparison, or replay a recorded run in the step view, which needs no GPU."
    )


def decoding_seconds(tokens: int) -> int:
    """What a call that decodes `tokens` tokens in all asks for."""
    return max(MIN_SECONDS, min(MAX_SECONDS, round(START_SECONDS + SECONDS_PER_TOKEN * tokens)))


def run_seconds(max_new_tokens: int, decodes: int) -> int:
    """A run's call: `decodes` decodings of up to `max_new_tokens` (the speculative one and each comparison)."""
    return decoding_seconds(max_new_tokens * decodes)


def budget_seconds(seconds: int) -> float:
    """A run's own time budget inside a call lent `seconds`."""
    return float(seconds - MARGIN_SECONDS)


def startup_pairs() -> list[Pair]:
    """The pairs a ZeroGPU Space loads at startup: the page's default pair, then SPECDEMO_ZEROGPU_PAIRS if the
    operator set it, else DEFAULT_PAIRS. An unknown key is refused in one sentence."""
    chosen = os.environ.get(PAIRS_VARIABLE, ",".join(DEFAULT_PAIRS)).split(",")
    keys = list(dict.fromkeys([DEFAULT_PAIR.key, *(key.strip() for key in chosen if key.strip())]))
    unknown = [key for key in keys if key not in PAIRS_BY_KEY]
    if unknown:
        raise ValueError(
            f"{PAIRS_VARIABLE} names unknown pairs ({', '.join(unknown)}): use keys from `python -m specdemo pairs`."
        )
    return [PAIRS_BY_KEY[key] for key in keys]
