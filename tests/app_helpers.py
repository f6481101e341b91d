"""Helpers of the app's tests: the /generate settings a user starts from, and the app launched in-process."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager

import specdemo.app.page as page
from specdemo.app.form import defaults
from specdemo.app.tabs.one_prompt import EXAMPLES
from specdemo.models.loading import LoadedModel
from specdemo.models.shared import ModelCache
from tests.helpers import HANG_GUARD_SECONDS

SPELLING = EXAMPLES[0][0]
CHROMIUM = shutil.which("chromium")  # Debian's, for the browser tests (tests/conftest.py's `browser`)
# No background networking: this machine's closed network refuses those connections.
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def settings(prompt: str = SPELLING, **changes) -> dict:
    """The /generate inputs by name (the settings table's defaults, a user's starting point) with a 40-token run in
    float32, the pinned offline model's format where greedy parity is checked: `client.predict(**settings(...))`."""
    return {"prompt": prompt, **defaults(max_new_tokens=40, dtype="float32"), **changes}


@contextmanager
def launched_app(loaded: LoadedModel, **build_options) -> Iterator[tuple[str, object]]:
    """The app launched in-process with `loaded` already in its model cache (as its pinned default): its URL and its
    server state (the tests reach its limits there)."""
    cache = ModelCache(pinned=loaded.name)
    cache.put(loaded)
    demo = page.build_demo(cache, **build_options)
    demo.specdemo_server.budget_seconds = HANG_GUARD_SECONDS  # a budget is a clock: its tests set their own
    _, url, _ = demo.launch(prevent_thread_lock=True, quiet=True)
    try:
        yield url, demo.specdemo_server
    finally:
        demo.close()
