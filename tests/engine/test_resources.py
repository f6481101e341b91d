"""The serving process's threads: a thread done with torch lets its OpenMP workers go."""

from __future__ import annotations

import os
import threading
import time
from contextlib import AbstractContextManager, nullcontext

import pytest
import torch

from specdemo.engine.resources import _libgomps, openmp_workers_released


def thread_ids() -> set[int]:
    return {int(task) for task in os.listdir("/proc/self/task")}


def workers_left(context: AbstractContextManager) -> tuple[set[int], set[int]]:
    """In a thread that stays alive: a parallel region (a matrix product) under `context`; the threads the region
    started, and those of them still alive once the context has ended."""
    seen: dict[str, set[int]] = {}
    leave = threading.Event()

    def work() -> None:
        product = torch.randn(512, 512)
        before = thread_ids()
        with context:
            product @ product
            seen["started"] = thread_ids() - before
        deadline = time.monotonic() + 2.0
        while seen["started"] & thread_ids() and time.monotonic() < deadline:
            time.sleep(0.01)  # a worker's thread takes a moment to exit
        seen["alive"] = seen["started"] & thread_ids()
        leave.wait()

    thread = threading.Thread(target=work)
    thread.start()
    while "alive" not in seen:
        time.sleep(0.01)
    leave.set()
    thread.join()
    return seen["started"], seen["alive"]


@pytest.mark.skipif(not _libgomps() or torch.get_num_threads() < 2, reason="torch here has no libgomp workers")
def test_a_thread_done_with_torch_lets_its_openmp_workers_go():
    """Workers of a thread that lives on stay while it lives (why the app lets them go), and go once it is done."""
    started, alive = workers_left(nullcontext())
    assert started and alive == started, "a parallel region started no workers, or they went by themselves"
    started, alive = workers_left(openmp_workers_released())
    assert started and not alive, f"{len(alive)} of {len(started)} workers still alive"
