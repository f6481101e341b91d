"""The app's streaming overhead: tokens/s as a streaming client sees them against the engine's own figure for the
same run (bench --app)."""

from __future__ import annotations

import json
import time

from specdemo.bench.prompts import PROMPTS, BenchPrompt


def bench_app(prompts: tuple[BenchPrompt, ...] = PROMPTS[6:], max_new_tokens: int = 128) -> list[dict]:
    """Tokens/s as a streaming client sees them against the engine's own figure for the same run, and how often
    the charts were re-sent (the app launched in-process, driven through gradio_client)."""
    from gradio_client import Client

    from specdemo.app.page import build_demo

    demo = build_demo()
    _, url, _ = demo.launch(prevent_thread_lock=True, quiet=True)
    try:
        client = Client(url, verbose=False)
        rows = []
        for prompt in (prompts[0], *prompts):  # the first run loads the model and is not counted
            started = time.perf_counter()
            job = client.submit(prompt=prompt.text, max_new_tokens=max_new_tokens, compare=False, api_name="/generate")
            updates = [(time.perf_counter(), update) for update in job]
            client_seconds = updates[-1][0] - started
            # a skipped output arrives as {'__type__': 'update'}; a chart update carries the plot
            chart_times = [when for when, update in updates if "plot" in update[2]]
            with open(job.outputs()[-1][6]["value"]) as handle:
                trace = json.load(handle)
            engine = trace["stats"]
            rows.append(
                {
                    "prompt": prompt.name,
                    "tokens": engine["num_generated"],
                    "engine_tokens_per_second": engine["tokens_per_second"],
                    "client_tokens_per_second": engine["num_generated"] / client_seconds,
                    "ratio": engine["num_generated"] / client_seconds / engine["tokens_per_second"],
                    "updates": len(updates),
                    "replay_bytes_per_round": len(json.dumps(trace["replay"])) / max(1, len(trace["rounds"])),
                    "chart_updates_per_second": len(chart_times) / max(1e-9, chart_times[-1] - chart_times[0])
                    if len(chart_times) > 1
                    else 0.0,
                }
            )
        return rows[1:]
    finally:
        demo.close()
