"""ZeroGPU: the page's GPU functions through `spaces.GPU` (elsewhere they are the functions themselves), how long each
asks to be lent the GPU for, the pairs a ZeroGPU Space loads at startup, a fresh worker's first use of its models, and
each of ZeroGPU's refusals said in one sentence.

On ZeroGPU the Space's own process has no GPU. `spaces.GPU` runs each call in a worker process forked from it, with
the GPU lent for the call: the call's arguments and every value it yields are pickled across, the worker sees the
models as they were when it was forked (so they are loaded at startup, never inside a call), and nothing a call leaves
in the worker outlives the worker. A call is refused when the visitor's daily quota holds less than its duration.

A worker's first use of its models (kernels warmed, round programs captured, pass costs measured) happens in the call,
before its run's budget starts, in seconds every call asks for: `spaces` decides whether a call reuses the worker of
the function's last call only after the call has asked (when ZeroGPU's answer names the same GPU, idle), so the main
process cannot know whether the worker will be fresh."""

from __future__ import annotations

import inspect
import os
import re
from collections.abc import Callable, Iterator
from datetime import timedelta
from functools import wraps
from typing import TypeVar

import gradio as gr
import torch

from specdemo.app.serving.messages import every_failure_said, loading, user_error
from specdemo.engine.setup import load_pair
from specdemo.models.loading import LoadedModel, Progress, set_up_on_device
from specdemo.models.platform import on_zerogpu
from specdemo.models.shared import ModelCache
from specdemo.pairs import DEFAULT_PAIR, PAIRS_BY_KEY, Pair

ON_ZEROGPU = on_zerogpu()  # read once, as `spaces` reads it at import
# Estimates, not yet measured on ZeroGPU: a visitor's daily quota is 2 minutes (anonymous) to 40 (PRO), and spaces
# charges a call's seconds 1.5 times on half a Blackwell card, so a call asks for what its settings need, no more.
SET_UP_SECONDS = 10  # a fresh worker's start and first use, before its run's budget starts: the fork, the weights
# moved to the GPU, kernels warmed, round programs captured, pass costs measured. An estimate for a GPU: the stand-in
# (tests/app/zerogpu_space.py) spends 3.4 s on a first call on 2 idle CPU cores (84-116 s at a load of 8), nearly all
# of it the pass costs' 45 rounds, and 0.004 s on the next call in the same worker
MARGIN_SECONDS = 5  # a run's own budget ends this long before the GPU is taken back, so it stops and says so
START_SECONDS = SET_UP_SECONDS + MARGIN_SECONDS  # what a call asks for besides its tokens
SECONDS_PER_TOKEN = 0.03  # a decoded token, generous: our target-only decoding takes 11-12 ms a token on an H200
MIN_SECONDS, MAX_SECONDS = 20, 120  # what a call asks for; 120 s is also a run's budget elsewhere
PAIRS_VARIABLE = "SPECDEMO_ZEROGPU_PAIRS"  # comma-separated pair keys an operator loads at startup instead
DEFAULT_PAIRS = (  # every SmolLM2-135M pair, and the Hub pairs of up to 1.7B (8.5 GB in bfloat16 in all)
    "smollm2-135m-ngram",
    "smollm2-135m-suffix",
    "smollm2-135m-recurrent",
    "smollm2-135m-hybrid",
    "smollm2-135m-self",
    "smollm2-135m-360m",
    "smollm2-135m-1.7b",
    "qwen2.5-0.5b-1.5b",
)
# spaces' messages (zero/client.py, zero/wrappers.py), each said again in a sentence of ours
VISITOR_QUOTA = re.compile(r"\((\d+)s requested vs\. (\d+)s left\)\. Try again in ([^.]+)\.")
RUNS_LIMIT = "exceeded your ZeroGPU runs limit"
SPACE_LIMIT = "Space app has reached its GPU limit"  # a call with no X-IP-Token header: an API client's, without one
NO_GPU = "No GPU was available"  # also "... after 60s", when ZeroGPU's queue gave up
TOO_LONG = "ZeroGPU illegal duration"  # a title: more seconds than ZeroGPU lends to one call
ABORTED = "GPU task aborted"  # the worker ended before the call did: ZeroGPU took the GPU back

RECORDED = "or replay a recorded run in the step view, which needs no GPU"  # what a refused visitor can still do

Function = TypeVar("Function", bound=Callable)


def gpu_function(
    function: Function,
    seconds: Callable[..., int],
    what: str = "The run",
    lower: str = "lower max new tokens or turn off the comparison",
) -> Function:
    """`function` (a generator function or a plain one) with every failure one sentence (messages.py) and, on ZeroGPU,
    lent the GPU for `seconds(*args, **kwargs)` per call, each of ZeroGPU's refusals one sentence too; `what` names
    the work in a failure's sentence and `lower` says how to ask for less. Made once per function: `spaces` keeps a
    call's worker for that function's next call."""
    said = every_failure_said(function, what)  # inside the worker: spaces passes on only a gr.Error's sentence
    if not ON_ZEROGPU:
        return said
    import spaces  # only on ZeroGPU, where app.py imported it before torch

    lent = spaces.GPU(said, duration=seconds)
    if not inspect.isgeneratorfunction(function):  # as spaces decides (it looks through functools.partial)

        @wraps(function)
        def call(*args, **kwargs):
            try:
                return lent(*args, **kwargs)
            except gr.Error as error:
                raise refusal(error, seconds(*args, **kwargs), lower) from error

        return call  # type: ignore[return-value]

    @wraps(function)
    def steps(*args, **kwargs) -> Iterator:
        try:
            yield from lent(*args, **kwargs)  # closing this generator closes spaces' own, which stops the worker's
        except gr.Error as error:
            raise refusal(error, seconds(*args, **kwargs), lower) from error

    return steps  # type: ignore[return-value]


def refusal(error: gr.Error, seconds: int, lower: str) -> gr.Error:
    """One of ZeroGPU's refusals of a call that asked for `seconds`, as one sentence of ours saying which limit it hit
    and what to do (spaces titles three of them "ZeroGPU quota exceeded"); any other error as it was."""
    message, asked = str(error.message), quota_seconds(seconds)
    if getattr(error, "title", None) == TOO_LONG:
        return user_error(f"This run asks ZeroGPU for {asked} s of GPU time, more than it lends to one call: {lower}.")
    if visitor := VISITOR_QUOTA.search(message):
        counted = "" if asked == seconds else f" ({seconds} s, counted {asked / seconds:g} times on this Space's GPU)"
        return user_error(
            f"This run asks ZeroGPU for {asked} s of GPU time{counted} and your quota has {visitor[2]} s left: "
            f"{lower}, try again in {visitor[3]}, {RECORDED}."
        )
    if RUNS_LIMIT in message:
        return user_error(
            f"You have started as many ZeroGPU runs as your quota allows for now: try again later, {RECORDED}."
        )
    if SPACE_LIMIT in message:
        return user_error(
            "This Space has used up the GPU time ZeroGPU lends to calls that carry no visitor's token (an API client "
            "that sends no X-IP-Token header): run it from the Space's page, or call it with your Hugging Face token "
            "(gradio_client's hf_token), so that the call counts against your own quota."
        )
    if NO_GPU in message:
        return user_error(
            f"No ZeroGPU card was free for this run, all were lent to other calls: try again in a minute, {RECORDED}."
        )
    if ABORTED in message:
        return user_error(
            f"The GPU's worker ended before this run did (ZeroGPU takes the GPU back after the {asked} s a call asks "
            f"for): {lower}, and try again."
        )
    return error


def lent_seconds(seconds: int) -> float:
    """How long ZeroGPU lends the GPU to a call that asks for `seconds`: spaces asks for them times its GPU's duration
    factor (1.5 on half a Blackwell card, 1 on an H200 slice or a whole card); elsewhere `seconds`."""
    if not ON_ZEROGPU:
        return float(seconds)
    from spaces.zero import client

    return float(client.get_duration_seconds(timedelta(seconds=seconds), None))


def quota_seconds(seconds: int) -> int:
    """The seconds of a visitor's quota a call that asks for `seconds` is checked against, as spaces' own message
    counts them: the seconds lent, twice over on a whole card (`xlarge`, where no duration factor applies)."""
    if not ON_ZEROGPU:
        return seconds
    from spaces.zero import default_gpu_size

    return round(lent_seconds(seconds)) * (2 if default_gpu_size() == "xlarge" else 1)


def decoding_seconds(tokens: int) -> int:
    """What a call that decodes `tokens` tokens in all asks for."""
    return max(MIN_SECONDS, min(MAX_SECONDS, round(START_SECONDS + SECONDS_PER_TOKEN * tokens)))


def run_seconds(max_new_tokens: int, decodes: int) -> int:
    """A run's call: `decodes` decodings of up to `max_new_tokens` (the speculative one and each comparison)."""
    return decoding_seconds(max_new_tokens * decodes)


def budget_seconds(seconds: int, set_up: float) -> float:
    """A run's own time budget inside a call that asked for `seconds`, counted from the end of its set-up, which took
    `set_up` seconds: what ZeroGPU lends less the set-up's allowance (the set-up itself where it ran over, so the run
    still ends before the GPU is taken back) and the margin."""
    lent = lent_seconds(seconds)
    return lent - max(SET_UP_SECONDS * lent / seconds, set_up) - MARGIN_SECONDS


_SET_UP: set[int] = set()  # the models this process has set up, by id: a worker's fork starts with none


def set_up_in_worker(models: list[LoadedModel], progress: Progress) -> None:
    """In a ZeroGPU call's worker, the first use of `models` there (a one-token step that warms the kernels, the round
    programs captured, holding graphs.DEVICE_WORK), which load_model does where the process has a GPU of its own; once
    per worker."""
    fresh = {id(loaded.model): loaded for loaded in models if id(loaded.model) not in _SET_UP}
    for key, loaded in fresh.items():
        progress(f"Setting {loaded.name} up on the lent GPU (once per worker)...")
        set_up_on_device(loaded.model, progress)
        _SET_UP.add(key)


def ready_pair(
    pair: Pair,
    cache: ModelCache,
    progress: Progress,
    allow_local: bool = False,
    dtype: torch.dtype | None = None,
) -> tuple[LoadedModel, LoadedModel | None]:
    """A pair's models as load_pair gives them (a cost-aware drafter's pass costs measured once per process), and in a
    ZeroGPU worker set up for their first use there: all before a run's budget starts. A model that fails to load is
    named in the sentence."""
    with loading(pair.model_names, lambda name: cache.holds(name, dtype=dtype)):
        target, draft = load_pair(pair, cache, progress, allow_local=allow_local, dtype=dtype)
    if ON_ZEROGPU:
        set_up_in_worker([target] if draft is None else [target, draft], progress)
    return target, draft


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
