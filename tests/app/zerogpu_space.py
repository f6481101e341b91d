"""The app as a ZeroGPU Space serves it, on this CPU: `python -m tests.app.zerogpu_space LOG PORT`.

`spaces`' own code runs the GPU functions (the worker process forked per call, the arguments and every update
pickled across, the worker's stop event, the quota's refusal). Replaced are only what needs ZeroGPU's servers or a
GPU: the scheduling client's five calls, and `spaces.zero.torch`, which patches CUDA at import and sets the GPU up
in the worker (here there is nothing to patch or move). Every scheduling call, and how each run's steps ended in the
worker, is written to LOG as a line of JSON. ZEROGPU_TEST_QUOTA (seconds) refuses calls that ask for more, as ZeroGPU
does when a visitor's quota is short."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import types
from pathlib import Path

os.environ["SPACES_ZERO_GPU"] = "true"
os.environ.setdefault("SPACES_ZERO_DEVICE_API_URL", "http://127.0.0.1:9")  # spaces requires it; nothing calls it
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

cuda = types.ModuleType("spaces.zero.torch")  # stands in before `import spaces` imports the real one
for name in ("enter_mode", "patch", "unpatch", "init", "move"):
    setattr(cuda, name, lambda *args, **kwargs: None)
cuda.pack = cuda.size = lambda *args, **kwargs: 0
cuda.is_in_bad_fork = lambda: False
sys.modules["spaces.zero.torch"] = cuda

import spaces  # noqa: E402, F401 - first, as app.py imports it
from spaces.zero import api, client  # noqa: E402
from spaces.zero.gradio import error  # noqa: E402

LOG = open(sys.argv[1], "a", buffering=1)  # for the process's whole life
QUOTA = Path(sys.argv[1] + ".quota")
_log_lock = threading.Lock()


def log(**record: object) -> None:
    with _log_lock:
        LOG.write(json.dumps(record | {"pid": os.getpid(), "time": time.time()}) + "\n")


def schedule(task_id, request=None, duration=None, gpu_size=None, _first_attempt=True):
    seconds = duration.total_seconds()
    log(call="schedule", seconds=seconds)
    left = float(QUOTA.read_text()) if QUOTA.exists() else float("inf")
    if seconds > left:  # spaces' own title and sentence for a visitor whose quota is short (zero/client.py)
        raise error(
            "ZeroGPU quota exceeded",
            f"You have exceeded your ZeroGPU quota ({seconds:.0f}s requested vs. {left:.0f}s left). "
            "Try again in 1:00:00",
        )
    return api.ScheduleResponse(idle=True, nvidiaIndex=0, nvidiaUUID="GPU-on-the-cpu", allowToken="token")


client.schedule = schedule
client.allow = lambda allow_token: log(call="allow")
client.release = lambda allow_token, fail=False, allow_404=False: log(call="release", fail=fail)
client.startup_report = lambda: log(call="startup_report")

import specdemo.app.tabs.one_prompt as one_prompt  # noqa: E402

stream_run = one_prompt.stream_run


def logged_stream_run(server, run):
    """The run's updates, and a line saying whether its steps finished or were closed (Stop), and after how many."""
    updates = 0
    try:
        for update in stream_run(server, run):
            updates += 1
            yield update
    except GeneratorExit:
        log(call="run", ended="closed", updates=updates, stopped=run.stop.is_set())
        raise
    log(call="run", ended="finished", updates=updates)


one_prompt.stream_run = logged_stream_run  # before the worker forks, so it is the worker's too

from specdemo.app.page import build_demo  # noqa: E402

demo = build_demo()
_, url, _ = demo.launch(server_port=int(sys.argv[2]), prevent_thread_lock=True, quiet=True)
log(call="ready", url=url)
threading.Event().wait()
