"""The page's long handlers stop when their run is cancelled and when their tab is closed."""

import asyncio
import inspect
import threading
from types import SimpleNamespace

from specdemo.app.serving import handlers
from specdemo.app.serving.handlers import end_session, stop_signal, stoppable


def test_a_closed_tab_stops_its_own_runs_and_no_other_tabs():
    stops: list[threading.Event] = []

    def steps(run_id: str):
        with stop_signal(run_id) as stop:
            stops.append(stop)
            while not stop.wait(0.01):
                yield ("a round",)

    handler = stoppable(steps, inspect.Signature([]), "steps", None)
    closed, open_ = SimpleNamespace(session_hash="closed tab"), SimpleNamespace(session_hash="open tab")

    async def run() -> None:
        # Each run waits at an update, as Gradio leaves a handler between two updates; none is cancelled or closed.
        runs = [handler(closed), handler(closed), handler(open_)]
        for each in runs:
            await anext(each)
        end_session(closed)
        assert [stop.is_set() for stop in stops] == [True, True, False]
        assert await anext(runs[0], "ended") == "ended"  # the stopped steps return at their next look
        for each in runs:
            await each.aclose()
        assert all(stop.is_set() for stop in stops)  # a closed handler stops its steps too

    asyncio.run(run())
    assert not handlers._running  # ended runs are forgotten: a Space up for weeks keeps no stop events
