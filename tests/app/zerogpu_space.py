"""The app as a ZeroGPU Space serves it, on this CPU: `python -m tests.app.zerogpu_space LOG PORT FACTOR`.

`spaces`' own code runs the GPU functions (the worker process forked per call, the arguments and every update
pickled across, the worker's stop event) and asks for the GPU (the seconds scaled by the GPU's duration factor, every
refusal's title and message). Replaced are only what needs ZeroGPU's servers or a GPU: the device API's four calls
(`spaces.zero.api.APIClient`); the GPU's description in spaces' config, whose duration factor is FACTOR (this CPU
decodes far slower than the seconds a call asks for assume, as ZeroGPU's Blackwell halves are given 1.5 times theirs);
and `spaces.zero.torch`, which patches CUDA at import and sets the GPU up in the worker (here there is nothing to patch
or move). Every call to the device API, how long each run's preparation took before its budget started, and how each
run's steps ended in the worker, are written to LOG as lines of JSON. LOG.quota, when it exists, makes ZeroGPU refuse
calls: a number of seconds left (calls that ask for more are refused, as for a visitor whose quota is short, or, for a
call with no X-IP-Token header, as for a Space at its limit), or `no-gpu` (the queue gives up: no GPU was free).
LOG.fail, when it exists, plants a failure in the worker: `oom` or `disk` when a pair's models are loaded (the device
out of memory, an OSError), `round` after a run's first update (a CUDA error)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import types
from datetime import timedelta
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

import httpx  # noqa: E402
import spaces  # noqa: E402, F401 - first, as app.py imports it
from spaces.zero import api, client, config  # noqa: E402

LOG = open(sys.argv[1], "a", buffering=1)  # for the process's whole life
QUOTA = Path(sys.argv[1] + ".quota")
FAIL = Path(sys.argv[1] + ".fail")
GPU = config.get_config() | {"model": "this CPU, standing in", "duration_factor": float(sys.argv[3])}
_log_lock = threading.Lock()


def log(**record: object) -> None:
    with _log_lock:
        LOG.write(json.dumps(record | {"pid": os.getpid(), "time": time.time()}) + "\n")


class DeviceAPI:
    """ZeroGPU's device API as `spaces.zero.api.APIClient` calls it: every call logged, a GPU lent unless LOG.quota
    says otherwise."""

    def startup_report(self) -> httpx.codes:
        log(call="startup_report")
        return httpx.codes.OK

    def schedule(self, cgroup_path, task_id=0, token=None, token_version=1, duration_seconds=None, **_):
        log(call="schedule", seconds=duration_seconds, token=token is not None)
        refusal = QUOTA.read_text() if QUOTA.exists() else None
        if refusal == "no-gpu":  # queued, and the queue gave up
            return iter([api.QueueEvent(event="failed")]), api.ScheduleMetadata(queuing_reason="node")
        if refusal is not None and duration_seconds > float(refusal):
            return api.QuotaInfos(left=int(refusal), wait=timedelta(hours=1)), api.ScheduleMetadata()
        lent = api.ScheduleResponse(idle=True, nvidiaIndex=0, nvidiaUUID="GPU-on-the-cpu", allowToken="token")
        return lent, api.ScheduleMetadata()

    def allow(self, allow_token: str, pid: int) -> httpx.codes:
        log(call="allow")
        return httpx.codes.OK

    def release(self, allow_token: str, fail: bool = False) -> httpx.codes:
        log(call="release", fail=fail)
        return httpx.codes.OK


client.api_client = DeviceAPI
config.get_config = lambda: GPU

import torch  # noqa: E402

import specdemo.app.serving.zerogpu as zerogpu  # noqa: E402
import specdemo.app.tabs.one_prompt as one_prompt  # noqa: E402
from specdemo.app.serving.runs import Server  # noqa: E402

stream_run = one_prompt.stream_run
prepare = Server.prepare
load_pair = zerogpu.load_pair
PLANTED = {
    "oom": lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
    "disk": lambda: OSError(28, "No space left on device"),
    "round": lambda: RuntimeError("CUDA error: an illegal memory access was encountered"),
}


def planted(where: str) -> None:
    """Raise the failure LOG.fail plants, if it is planted `where` ("load" or "round")."""
    failure = FAIL.read_text() if FAIL.exists() else None
    if failure is not None and (failure == "round") == (where == "round"):
        raise PLANTED[failure]()


def failing_load_pair(*args, **kwargs):
    planted("load")
    return load_pair(*args, **kwargs)


def logged_prepare(server, *args, **kwargs):
    """A run prepared, and a line saying how long that took before its budget started, and what the budget is."""
    started = time.monotonic()
    run = prepare(server, *args, **kwargs)
    log(call="prepare", set_up=run.deadline - run.budget_seconds - started, budget=run.budget_seconds)
    return run


def logged_stream_run(server, run):
    """The run's updates, and a line saying whether its steps finished or were closed (Stop), and after how many."""
    updates = 0
    try:
        for update in stream_run(server, run):
            updates += 1
            yield update
            planted("round")
    except GeneratorExit:
        log(call="run", ended="closed", updates=updates, stopped=run.stop.is_set())
        raise
    log(call="run", ended="finished", updates=updates)


one_prompt.stream_run = logged_stream_run  # before the worker forks, so they are the worker's too
Server.prepare = logged_prepare
zerogpu.load_pair = failing_load_pair

from specdemo.app.page import build_demo  # noqa: E402

demo = build_demo()
_, url, _ = demo.launch(server_port=int(sys.argv[2]), prevent_thread_lock=True, quiet=True)
log(call="ready", url=url)
threading.Event().wait()
