"""The serving process's threads: a thread done with torch lets its OpenMP workers go."""

from __future__ import annotations

import os
import threading
import time
from contextlib import AbstractContextManager, nullcontext

import pytest
import torch

from specdemo.engine.resources import _libgomps, openmp_workers_released
from tests.helpers import wait_until


def thread_ids() -> set[int]:
    return {int(task) for task in os.listdir("/proc/self/task")}


LOOK_SECONDS = 2.0  # how long a test watches workers that should stay: they may only go early, never late


def workers_left(context: AbstractContextManager, gone: bool) -> tuple[set[int], set[int]]:
    """In a thread that stays alive: a parallel region (a matrix product) under `context`; the threads the region
    started, and those of them still alive once the context has ended: once all are gone (a worker's thread takes a
    moment to exit) when `gone`, else after watching them for LOOK_SECONDS."""
    seen: dict[str, set[int]] = {}
    leave = threading.Event()

    def work() -> None:
        product = torch.randn(512, 512)
        before = thread_ids()
        with context:
            product @ product
            seen["started"] = thread_ids() - before
        if gone:
            try:
                wait_until(lambda: not seen["started"] & thread_ids(), "the region's workers exiting")
            except AssertionError:  # the hang guard: those still alive fail the test below
                pass
        else:
            time.sleep(LOOK_SECONDS)  # a busy machine can only keep them longer: no test fails on its clock
        seen["alive"] = seen["started"] & thread_ids()
        leave.wait()

    thread = threading.Thread(target=work)
    thread.start()
    wait_until(lambda: "alive" in seen, "the region's workers watched")
    leave.set()
    thread.join()
    return seen["started"], seen["alive"]


@pytest.mark.skipif(not _libgomps() or (os.cpu_count() or 1) < 2, reason="torch here has no libgomp workers")
def test_a_thread_done_with_torch_lets_its_openmp_workers_go():
    """Workers of a thread that lives on stay while it lives (why the app lets them go), and go once it is done."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # a test worker may run on one thread (tests/conftest.py)
    try:
        started, alive = workers_left(nullcontext(), gone=False)
        assert started and alive == started, "a parallel region started no workers, or they went by themselves"
        started, alive = workers_left(openmp_workers_released(), gone=True)
        assert started and not alive, f"{len(alive)} of {len(started)} workers still alive"
    finally:
        torch.set_num_threads(threads)
