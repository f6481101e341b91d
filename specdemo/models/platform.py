"""Where the models run, as a visitor and an operator need to know it: ZeroGPU or not (decided as the `spaces` package
decides it), the device and its memory, torch's CUDA build, and a loud warning when a GPU is there but unusable."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import torch

ZERO_GPU_VARIABLE = "SPACES_ZERO_GPU"  # set to true by Hugging Face on ZeroGPU Spaces only
# What `spaces` tells a ZeroGPU Space's main process about the GPU it lends per call (spaces.config, 0.51.3): the
# process holds no GPU itself, so these, not torch.cuda, say what a run will get.
ZERO_GPU_NAME_VARIABLE, ZERO_GPU_NAME = "ZEROGPU_CUDA_DEVICE_NAME", "NVIDIA H200 MIG 3g.71gb"
ZERO_GPU_MEMORY_VARIABLE, ZERO_GPU_MEMORY = "ZEROGPU_CUDA_TOTAL_MEMORY", 74_625_056_768
NVIDIA_DEVICE_FILES = ("/dev/nvidia0", "/proc/driver/nvidia/version")  # present where an NVIDIA driver runs


def on_zerogpu() -> bool:
    """Whether this is a ZeroGPU Space, read as `spaces.config.Config.zero_gpu` reads it. Spaces install `spaces` on
    every hardware and its decorator does nothing off ZeroGPU, so that the package imports says nothing."""
    return os.environ.get(ZERO_GPU_VARIABLE, "").lower() in ("1", "t", "true")


def zerogpu_device_name() -> str:
    return os.environ.get(ZERO_GPU_NAME_VARIABLE, ZERO_GPU_NAME)


def zerogpu_memory_bytes() -> int:
    """The memory of the GPU a ZeroGPU call is lent: every call gets the whole of it, whatever the Space holds."""
    return int(os.environ.get(ZERO_GPU_MEMORY_VARIABLE, ZERO_GPU_MEMORY))


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
        return f"ZeroGPU: {zerogpu_device_name()}, lent for each run"
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
