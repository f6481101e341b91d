"""How the page's long handlers run and what they leave behind: each is an async generator that runs its steps in a
worker thread and stops them when Gradio cancels it (Stop, a closed tab, a client's cancel), and every file offered for
download lives in one bounded folder of Gradio's cache.

Why async: Gradio cancels a generator by closing it, and a plain generator cannot be closed while a step runs in its
worker thread ("generator already executing"); Gradio retries every 50 ms and succeeds only between two steps. A step
mostly waits for rounds, so under load a cancelled run went on for seconds (the audit test counted 1,536 rounds 2.5 s
after a cancel). An async generator is cancelled at its await, at once; its `finally` sets the step's stop event, and
the waits inside the step end within STOP_POLL_SECONDS."""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

from gradio.utils import get_upload_folder

from specdemo.engine.scheduler import STOP_POLL_SECONDS

MAX_DOWNLOADS = 32  # trace and audit files kept; the oldest goes when another is written
DOWNLOADS_FOLDER = "specdemo-downloads"  # inside Gradio's cache, so Gradio serves the files without copying them

_DONE = object()


def stoppable(
    steps: Callable[..., Iterator[tuple]], signature: inspect.Signature, name: str, doc: str | None
) -> Callable[..., AsyncIterator[tuple]]:
    """An async generator handler with `signature` (what the API page lists) around `steps(*values, stop=event)`,
    a plain generator run step by step in a worker thread; cancelling the handler sets `event`."""

    async def handler(*values: object) -> AsyncIterator[tuple]:
        stop = threading.Event()
        iterator = steps(*values, stop=stop)
        try:
            while (update := await asyncio.to_thread(next, iterator, _DONE)) is not _DONE:
                yield update
        finally:
            stop.set()  # a step still running sees it and returns; the iterator is left to the collector

    handler.__signature__ = signature  # type: ignore[attr-defined]
    handler.__annotations__ = {name: p.annotation for name, p in signature.parameters.items() if p.annotation}
    handler.__name__ = handler.__qualname__ = name
    handler.__doc__ = doc
    return handler


def wait_until(stop: threading.Event | None, done: Callable[[], bool], seconds: float) -> bool:
    """Wait up to `seconds` for `done()`, looking at `stop` every STOP_POLL_SECONDS; False when stopped."""
    deadline = time.monotonic() + seconds
    while not done():
        if stop is not None and stop.is_set():
            return False
        if time.monotonic() >= deadline:
            break
        time.sleep(min(STOP_POLL_SECONDS, max(0.0, deadline - time.monotonic())))
    return True


class Downloads:
    """The folder of files the page offers for download: at most MAX_DOWNLOADS, the oldest removed first, so a Space
    that runs for weeks keeps a bounded folder (Gradio's delete_cache clears the rest of its cache by age)."""

    def __init__(self, root: str | None = None, limit: int | None = None) -> None:
        self.folder = Path(root or get_upload_folder()) / DOWNLOADS_FOLDER
        self.limit = limit
        self.lock = threading.Lock()

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
