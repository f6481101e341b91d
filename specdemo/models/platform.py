"""Where the models run, as a visitor and an operator need to know it: ZeroGPU or not (decided as the `spaces` package
decides it), the device and its memory, torch's CUDA build, and a loud warning when a GPU is there but unusable; and
the locks a ZeroGPU worker, forked from the Space's process, finds free."""

from __future__ import annotations

import os
import shutil
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

ZERO_GPU_VARIABLE = "SPACES_ZERO_GPU"  # set to true by Hugging Face on ZeroGPU Spaces only
# ZeroGPU's card where this process cannot ask `spaces` (not imported: a command, a test), and its memory as spaces
# 0.51.3's table gives it (spaces.zero.config); a call of the default size is lent half of it (ZeroGPU's documentation).
ZERO_GPU_CARD, ZERO_GPU_CARD_MEMORY = "NVIDIA RTX PRO 6000 Blackwell Server Edition", 101_973_950_464
NVIDIA_DEVICE_FILES = ("/dev/nvidia0", "/proc/driver/nvidia/version")  # present where an NVIDIA driver runs

Primitive = TypeVar("Primitive")  # threading's Lock, RLock, Condition or Event
_FORK_SAFE: weakref.WeakSet = weakref.WeakSet()  # made new in a forked child: fork_safe


@dataclass(frozen=True)
class LentGPU:
    """The GPU a ZeroGPU call is lent."""

    name: str  # the card's, as torch names it
    memory_bytes: int  # what one call may fill
    half: bool  # the call is lent half the card


def on_zerogpu() -> bool:
    """Whether this is a ZeroGPU Space, read as `spaces.config.Config.zero_gpu` reads it. Spaces install `spaces` on
    every hardware and its decorator does nothing off ZeroGPU, so that the package imports says nothing."""
    return os.environ.get(ZERO_GPU_VARIABLE, "").lower() in ("1", "t", "true")


def lent_gpu() -> LentGPU:
    """The GPU a ZeroGPU call is lent, from torch.cuda: in the Space's own process, which holds no GPU and never
    initialises CUDA, as `spaces` patches it from its table of ZeroGPU's cards (for the card this machine has); in a
    call's worker, the lent GPU itself."""
    if not torch.cuda.is_available():  # spaces has not patched torch: ZeroGPU's default
        return LentGPU(ZERO_GPU_CARD, ZERO_GPU_CARD_MEMORY // 2, half=True)
    half = not torch.cuda.is_initialized() and lends_half_the_card()  # spaces' table, not the GPU, says the whole card
    memory = torch.cuda.get_device_properties(0).total_memory
    return LentGPU(torch.cuda.get_device_name(0), memory // 2 if half else memory, half)


def lends_half_the_card() -> bool:
    """Whether a call is lent half of the card torch names. spaces' table gives a card it splits in two (the RTX PRO
    6000) a size of packed weights past which every call takes the whole card (`xlarge`, at twice the quota); until
    then calls are `large`, half of it. Its H200 entry is already the slice a call gets. Read from `spaces` only where
    it is imported: on ZeroGPU, importing it patches torch."""
    zero, table = sys.modules.get("spaces.zero"), sys.modules.get("spaces.zero.config")
    if zero is None or table is None:
        return False
    return table.get_config()["xlarge_threshold"] is not None and zero.default_gpu_size() != "xlarge"


def zerogpu_memory_bytes() -> int:
    """The memory a ZeroGPU call is lent (lent_gpu): every call gets all of it, whatever the Space holds."""
    return lent_gpu().memory_bytes


def fork_safe(primitive: Primitive) -> Primitive:
    """`primitive` (a lock, condition or event shared across threads), made new in a process forked from this one.
    `spaces` forks a ZeroGPU call's worker from a handler thread, and the child has that thread only: a lock another
    thread held at the fork would stay held there for good, and the worker would wait on it for ever."""
    _FORK_SAFE.add(primitive)
    return primitive


def _renew_in_child() -> None:
    for primitive in list(_FORK_SAFE):
        primitive._at_fork_reinit()  # as the standard library renews its own (logging's handlers, threading's)


os.register_at_fork(after_in_child=_renew_in_child)


def nvidia_gpu_present() -> bool:
    """An NVIDIA driver is running here, whatever torch can do with it."""
    return any(Path(path).exists() for path in NVIDIA_DEVICE_FILES) or shutil.which("nvidia-smi") is not None


def torch_build() -> str:
    """torch's version and the CUDA it was built for, e.g. "torch 2.13.0, CUDA 13.0" or "torch 2.13.0+cpu, no CUDA"."""
    cuda = torch.version.cuda
    return f"torch {torch.__version__}, " + (f"CUDA {cuda}" if cuda else "no CUDA (a CPU build)")


def device_name(device: torch.device) -> str:
    """The device in words: the GPU's name and compute capability, or the CPU."""
    if on_zerogpu():
        lent = lent_gpu()
        card = f"half an {lent.name}" if lent.half else lent.name
        return f"ZeroGPU: {card} ({lent.memory_bytes / 1e9:.1f} GB), lent for each run"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} (compute {major}.{minor})"
    if device.type == "mps":
        return "Apple GPU (mps)"
    return f"CPU ({os.cpu_count()} cores)"


def device_line(device: torch.device, number_format: str) -> str:
    """One line for the page and the startup log: where runs decode, in which number format, with which torch."""
    return f"Runs on {device_name(device)} · {number_format} · {torch_build()}"


def unusable_gpu_warning(device: torch.device) -> str | None:
    """A warning when an NVIDIA GPU is here but the app decodes elsewhere (a CPU build of torch, or a CUDA build the
    driver cannot run); None when nothing is wrong."""
    if device.type == "cuda" or on_zerogpu() or not nvidia_gpu_present() or os.environ.get("SPECDEMO_DEVICE"):
        return None
    built = torch.version.cuda
    why = (
        f"torch {torch.__version__} is built for CUDA {built} and cannot use it (the driver may be older)"
        if built
        else f"torch {torch.__version__} is a CPU build"
    )
    return (
        f"An NVIDIA GPU is here, but {why}: every run decodes on the CPU. Install a torch built for the driver's "
        "CUDA (docs/serving.md, Spaces and ZeroGPU)."
    )


def announce(device: torch.device, number_format: str, log=print) -> str:
    """Log where runs decode at startup, and shout when a GPU is here but unusable; returns the device line."""
    line = device_line(device, number_format)
    log(line)
    warning = unusable_gpu_warning(device)
    if warning:
        banner = "!" * 100
        print(f"{banner}\nWARNING: {warning}\n{banner}", file=sys.stderr, flush=True)
    return line
