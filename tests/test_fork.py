"""`spaces` forks a ZeroGPU call's worker from a handler thread, and the child has that thread only: every lock the
server and a worker share is found free in a child forked while another thread holds it, and the child keeps none of
the server's runs."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import torch

from specdemo.app.serving import handlers
from specdemo.app.serving.handlers import Downloads, stop_signal
from specdemo.drafters import NgramDrafter
from specdemo.engine.scheduler import Scheduler, Schedulers
from specdemo.models import graphs, pools
from specdemo.models.platform import fork_safe
from specdemo.models.shared import ModelCache

CHILD_SECONDS = 5  # a guard only: a lock free in the child is taken at once, a held one never
HOLD_SECONDS = 60  # how long the holding thread waits for the test to let go, a guard too


def in_a_forked_child(check: Callable[[], bool]) -> bool:
    """Whether `check()` holds in a child forked from this thread; a child still running after twice CHILD_SECONDS is
    killed and counts as False, so a planted deadlock fails the test instead of hanging it."""
    child = os.fork()
    if child == 0:
        code = 1
        try:
            code = 0 if check() else 1
        finally:
            os._exit(code)  # never back into pytest
    deadline = time.monotonic() + 2 * CHILD_SECONDS
    while time.monotonic() < deadline:
        done, status = os.waitpid(child, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status) == 0
        time.sleep(0.05)
    os.kill(child, 9)
    os.waitpid(child, 0)
    return False


def free_in_a_child_forked_while_held(lock) -> bool:
    """Whether a child forked while another thread holds `lock` (a Lock, RLock or Condition) acquires it."""
    held, let_go = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            held.set()
            let_go.wait(timeout=HOLD_SECONDS)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert held.wait(timeout=HOLD_SECONDS), "the holding thread never took the lock"
    try:
        return in_a_forked_child(lambda: lock.acquire(timeout=CHILD_SECONDS))
    finally:
        let_go.set()
        holder.join(timeout=HOLD_SECONDS)


def test_a_fork_safe_lock_is_free_in_the_child_and_a_plain_one_is_not():
    assert free_in_a_child_forked_while_held(fork_safe(threading.Lock()))
    assert free_in_a_child_forked_while_held(fork_safe(threading.RLock()))
    assert free_in_a_child_forked_while_held(fork_safe(threading.Condition()))
    assert not free_in_a_child_forked_while_held(threading.Lock())  # the test can fail: a plain lock stays held


def test_every_lock_the_server_and_a_zerogpu_worker_share_is_free_in_the_worker(tiny_target, tmp_path):
    cache = ModelCache(lambda name, progress, **options: object(), capacity=1)
    cache.get("a/model")  # makes its loading lock
    schedulers = Schedulers()
    shared = {
        "handlers._running_lock": handlers._running_lock,
        "Downloads.lock": Downloads(str(tmp_path)).lock,
        "ModelCache.lock": cache.lock,
        "ModelCache.loading_locks": cache.loading_locks["a/model"],
        "Schedulers.models_lock": schedulers.models_lock,
        "Schedulers.lock": schedulers.lock,
        "Scheduler.condition": Scheduler(tiny_target, NgramDrafter(3, 1), frozenset(), threading.Lock()).condition,
        "ModelPools.lock": pools.ModelPools(torch.device("cpu")).lock,
        "pools._POOLS_LOCK": pools._POOLS_LOCK,
        "graphs.DEVICE_WORK": graphs.DEVICE_WORK,
    }
    held_in_the_child = [name for name, lock in shared.items() if not free_in_a_child_forked_while_held(lock)]
    assert held_in_the_child == []


def test_the_worker_keeps_none_of_the_servers_runs():
    """A run's stop event in the worker is its own (set when `spaces` closes the steps), not a copy of the server's."""
    with stop_signal("a-run") as server_event:
        assert handlers._stops["a-run"] is server_event
        assert in_a_forked_child(lambda: handlers._stops == {} and handlers._running == {})
