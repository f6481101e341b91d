"""How the page's long handlers run and what they leave behind: each is an async generator that steps a plain
generator in worker threads and stops it when Gradio cancels the handler (Stop, a closed tab, a client's cancel), and
every file offered for download lives in one bounded folder of Gradio's cache.

Why async: Gradio cancels a generator by closing it, and a plain generator cannot be closed while a step runs in its
worker thread ("generator already executing"); Gradio retries every 50 ms and succeeds only between two steps. A step
mostly waits for rounds, so under load a cancelled run went on for seconds. An async generator is cancelled at its
await, at once.

How a stop reaches the steps: they are given a run id (a string: on ZeroGPU the steps run in `spaces`' worker
process, and their arguments must pickle; a threading.Event does not). In the server's own process `stop_signal(id)`
is the handler's event, which the handler's `finally` sets, and the waits inside the steps end within
STOP_POLL_SECONDS. The handler also closes the steps' generator once the step in flight returns: on ZeroGPU that
generator is `spaces`' own, whose close sets its worker's stop event, and the worker then closes the steps at their next
update, which sets the event their `stop_signal` made there.

A closed tab does not cancel: Gradio marks the run's event dead and closes the generator only after its next update,
under a lock every event's end shares, so a run could go on while nobody watched. The page's session ends when its
heartbeat connection closes, and Gradio then calls the page's unload handler: `end_session` stops every run the
session has going, whatever state its handler is in."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import gradio as gr
from gradio.utils import get_upload_folder

from specdemo.models.platform import fork_safe

MAX_DOWNLOADS = 32  # trace and audit files kept; the oldest goes when another is written
DOWNLOADS_FOLDER = "specdemo-downloads"  # inside Gradio's cache, so Gradio serves the files without copying them

_DONE = object()
_REQUEST = inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=gr.Request)

_running: dict[str, set[threading.Event]] = {}  # session hash -> the stop events of the session's runs
_stops: dict[str, threading.Event] = {}  # run id -> its stop event, in the process that decodes it
_running_lock = fork_safe(threading.Lock())


def _forget_runs() -> None:
    """A forked process (a ZeroGPU call's worker) decodes none of the server's runs: its stop events are its own."""
    _running.clear()
    _stops.clear()


os.register_at_fork(after_in_child=_forget_runs)


def end_session(request: gr.Request) -> None:
    """Stop every run of the session that `request` belongs to (the page's unload handler: the tab was closed)."""
    with _running_lock:
        events = _running.pop(request.session_hash or "", set())
    for event in events:
        event.set()


@contextmanager
def stop_signal(run_id: str) -> Iterator[threading.Event]:
    """The stop event of run `run_id` while the block runs, set when it ends: where the server decodes, the handler's
    own (Stop and a closed tab set it at once); in a ZeroGPU worker, a new one (set when `spaces` closes the steps)."""
    with _running_lock:
        event = _stops.setdefault(run_id, threading.Event())
    try:
        yield event
    finally:
        event.set()
        with _running_lock:
            _stops.pop(run_id, None)


class _Steps:
    """A generator stepped in worker threads, one step at a time, and closed once no step runs."""

    def __init__(self, iterator: Iterator[tuple]) -> None:
        self.iterator = iterator
        self.lock = threading.Lock()  # held by the step in flight

    def next(self) -> object:
        with self.lock:
            return next(self.iterator, _DONE)

    def close(self) -> None:
        """Close the generator after the step in flight returns (at once when none is), in a thread of its own so the
        handler's end does not wait for it. No step starts after this: the handler that stepped it has ended."""

        def close_when_idle() -> None:
            with self.lock:
                self.iterator.close()  # type: ignore[attr-defined]

        threading.Thread(target=close_when_idle, name="specdemo-close-steps", daemon=True).start()


def stoppable(
    steps: Callable[..., Iterator[tuple]], signature: inspect.Signature, name: str, doc: str | None
) -> Callable[..., AsyncIterator[tuple]]:
    """An async generator handler with `signature` (what the API page lists) around `steps(*values, run_id=id)`, a
    plain generator (or a ZeroGPU GPU function's) stepped in worker threads; cancelling the handler, or `end_session`
    for its page's session, sets the run's stop event and closes `steps`."""

    async def handler(request: gr.Request | None, *values: object) -> AsyncIterator[tuple]:
        run_id, stop = uuid.uuid4().hex, threading.Event()
        session = getattr(request, "session_hash", None) or ""
        with _running_lock:
            _running.setdefault(session, set()).add(stop)
            _stops[run_id] = stop
        stepped = _Steps(steps(*values, run_id=run_id))
        try:
            while not stop.is_set() and (update := await asyncio.to_thread(stepped.next)) is not _DONE:
                yield update
        finally:
            stop.set()  # a step still running sees it and returns
            stepped.close()
            with _running_lock:
                _stops.pop(run_id, None)
                runs = _running.get(session, set())
                runs.discard(stop)
                if not runs:
                    _running.pop(session, None)

    # Gradio passes the request to the parameter annotated gr.Request and lists only the others on the API page.
    signature = signature.replace(parameters=[_REQUEST, *signature.parameters.values()])
    handler.__signature__ = signature  # type: ignore[attr-defined]
    handler.__annotations__ = {name: p.annotation for name, p in signature.parameters.items() if p.annotation}
    handler.__name__ = handler.__qualname__ = name
    handler.__doc__ = doc
    return handler


class Downloads:
    """The folder of files the page offers for download: at most MAX_DOWNLOADS, the oldest removed first, so a Space
    that runs for weeks keeps a bounded folder (Gradio's delete_cache clears the rest of its cache by age)."""

    def __init__(self, root: str | None = None, limit: int | None = None) -> None:
        self.folder = Path(root or get_upload_folder()) / DOWNLOADS_FOLDER
        self.limit = limit
        self.lock = fork_safe(threading.Lock())

    def write_json(self, prefix: str, record: dict) -> str:
        """`record` as JSON in a new file of the folder; returns its path."""
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}.json"
        path.write_text(json.dumps(record, indent=1))
        with self.lock:
            self._prune()
        return str(path)

    def _prune(self) -> None:
        files = sorted(self.folder.glob("*.json"), key=lambda file: file.stat().st_mtime)
        for old in files[: max(0, len(files) - (self.limit or MAX_DOWNLOADS))]:
            old.unlink(missing_ok=True)
