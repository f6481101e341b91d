"""What a serving process does with its memory and its threads: glibc's malloc arenas and freed memory, and libgomp's
OpenMP worker threads. Each helper does nothing where its library is absent."""

from __future__ import annotations

import ctypes
import functools
import gc
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SERVING_MALLOC_ARENAS = 2  # glibc's default is 8 per core: Gradio's worker threads then each keep an arena, and
# memory freed after a run stays resident there (the load test in tests/test_robustness.py measures the growth)
M_ARENA_MAX = -8  # mallopt's parameter number, from glibc's malloc.h
OMP_PAUSE_SOFT = 1  # omp_pause_resource_all's kind, from omp.h


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


@functools.cache
def _libgomps() -> tuple[ctypes.CDLL, ...]:
    """The libgomps this process has loaded: torch's (its file name differs between torch builds) and any other
    package's own copy; none where /proc is absent. Read at the first call, which comes after torch is imported."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return ()
    paths = sorted({line.split()[-1] for line in maps.splitlines() if "/libgomp" in line})
    return tuple(ctypes.CDLL(path) for path in paths)


def bound_allocator_arenas(arenas: int = SERVING_MALLOC_ARENAS) -> None:
    """Cap glibc's per-thread malloc arenas for a serving process, so memory freed after a run is reused by the next
    run's thread instead of staying resident in an idle thread's arena."""
    if (libc := _libc()) is not None:
        libc.mallopt(M_ARENA_MAX, arenas)


def freeze_startup_objects() -> None:
    """What a server made to start (its imports, its page, the models it loaded) is moved out of the collector's reach
    (gc.freeze), garbage collected first. A full collection walks every object tracked and holds every thread meanwhile:
    with Gradio, torch and transformers loaded, the longest under `python -m benchmarks.load` took 0.28 s on an Intel
    Xeon, and 0.07 s frozen (docs/serving.md). Frozen objects are never collected, so only what lives as long as the
    process is frozen."""
    gc.collect()
    gc.freeze()


def release_freed_memory() -> None:
    """Give memory that was freed back to the system (glibc keeps it otherwise: after the load test's 24 runs, 420
    MB stayed resident, and malloc_trim returned all of it). The app calls it when its models go idle. Objects in
    reference cycles (a finished run's frames and tensors) are collected first, so that their memory is free too."""
    gc.collect()
    if (libc := _libc()) is not None:
        libc.malloc_trim(0)


def release_openmp_workers() -> None:
    """Let the calling thread's OpenMP workers go (libgomp's omp_pause_resource_all); its next parallel region starts
    new ones. libgomp keeps a thread's workers while the thread lives; once it counts more workers than CPUs, every
    thread's workers stop spinning between parallel regions and each region waits to wake them, so every pass slows
    while one idle thread keeps its workers (docs/serving.md)."""
    for libgomp in _libgomps():
        if hasattr(libgomp, "omp_pause_resource_all"):
            libgomp.omp_pause_resource_all(OMP_PAUSE_SOFT)


@contextmanager
def openmp_workers_released() -> Iterator[None]:
    """Torch work on a thread that outlives it (the main thread after loading, Gradio's worker threads): at the end,
    the thread lets its OpenMP workers go (release_openmp_workers)."""
    try:
        yield
    finally:
        release_openmp_workers()
