"""What a person reads when the app refuses or fails something: one sentence, escaped, whatever failed and wherever
(in the server's process, or in a ZeroGPU call's worker, whose failures `spaces` passes on only as `gr.Error`)."""

from __future__ import annotations

import html
import inspect
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import wraps
from typing import TypeVar

import gradio as gr
import torch

from specdemo.engine.decoding import NonFiniteLogits, OutOfDeviceMemory
from specdemo.models.loading import pick_device

REPORTED_CHARACTERS = 200  # of an unexpected error's text, kept at the end of its sentence for a report
OUT_OF_MEMORY = (torch.OutOfMemoryError, MemoryError)  # the device's memory, or the machine's

Function = TypeVar("Function", bound=Callable)


def user_error(message: str, log: bool = False) -> gr.Error:
    """Gradio shows an error's message as HTML, and ours may quote what the user typed: escape it."""
    return gr.Error(html.escape(message, quote=False), print_exception=log)


def reported(error: BaseException) -> str:
    """An unexpected error as a report needs it, at a sentence's end: its class and the start of its text."""
    return f"{type(error).__name__}: {str(error)[:REPORTED_CHARACTERS]}"


def failure_sentence(error: Exception, what: str, pair: str | None = None) -> str:
    """`error`, which ended `what` ("The run") of `pair` (its label, where known), as one sentence: a ValueError is one
    of ours already (a refusal, a row's own failure: as it is; an overflow names the pair); out of memory says what to
    lower; anything else says the way forward first and keeps the error at its end, for a report."""
    if isinstance(error, NonFiniteLogits):
        return error.sentence(pair)
    if isinstance(error, ValueError):
        return str(error)
    if isinstance(error, OUT_OF_MEMORY):
        return str(OutOfDeviceMemory(pick_device()))
    return (
        f"{what} failed, and the app is still serving: try again, or with fewer tokens or a smaller pair, and if it "
        f"happens again report it with these settings and the error ({reported(error)})."
    )


def failure_error(error: Exception, what: str) -> gr.Error:
    """failure_sentence as the error the page shows; an unexpected one's traceback goes to the log."""
    return user_error(failure_sentence(error, what), log=not isinstance(error, ValueError))


def every_failure_said(function: Function, what: str) -> Function:
    """`function` (a generator function or a plain one, as `spaces` tells them apart) with every failure but a
    `gr.Error` raised as failure_sentence's: in a ZeroGPU worker, `spaces` shows any other only as "ZeroGPU worker
    error" and the exception's class."""
    if inspect.isgeneratorfunction(function):

        @wraps(function)
        def steps(*args, **kwargs) -> Iterator:
            try:
                yield from function(*args, **kwargs)
            except gr.Error:
                raise
            except Exception as error:
                raise failure_error(error, what) from error

        return steps  # type: ignore[return-value]

    @wraps(function)
    def call(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except gr.Error:
            raise
        except Exception as error:
            raise failure_error(error, what) from error

    return call  # type: ignore[return-value]


@contextmanager
def loading(names: Sequence[str], held: Callable[[str], bool]) -> Iterator[None]:
    """A failure while loading models `names` as one sentence naming the first not yet `held` (the one that failed)
    and why; a ValueError (a sentence already) and running out of memory pass as they are."""
    try:
        yield
    except (ValueError, *OUT_OF_MEMORY):
        raise
    except Exception as error:
        failed = next((name for name in names if not held(name)), names[-1])
        raise ValueError(
            f"Could not load '{failed}', so nothing ran: try again, or pick another pair, and if it happens again "
            f"report it with the error ({reported(error)})."
        ) from error
