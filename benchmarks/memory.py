"""The memory table: for each simulated device, each listed pair's memory plan in the format auto picks for it there,
bytes needed against bytes usable, its biggest term, the limits it runs at, and whether it is offered. Needs no GPU and
no network (models/memory.py; the shapes are models/fitting.py's MODEL_SHAPES).

    python -m benchmarks.memory
    python -m benchmarks.memory --terms   # every term of every plan
"""

from __future__ import annotations

import argparse

import torch

from specdemo.engine.setup import plan_pair
from specdemo.models.loading import auto_dtype, readable_bytes
from specdemo.models.memory import Device, MemoryPlan
from specdemo.pairs import PAIRS, Pair

DEVICES = (  # the Space hardware a visitor meets; totals as nvidia-smi or spaces name them
    Device("T4", 15_360 * 2**20, True),  # nvidia-smi: 15,360 MiB
    Device("A10G", 23_028 * 2**20, True),  # nvidia-smi: 23,028 MiB
    Device("ZeroGPU half RTX Pro 6000 Blackwell", 101_973_950_464 // 2, True),  # spaces 0.51.3's table, halved
    Device("H200 MIG 3g.71gb", 74_625_056_768, True),  # what spaces 0.51.3's config reported for ZeroGPU
)
CAPABILITIES = dict(zip([device.name for device in DEVICES], [(7, 5), (8, 6), (12, 0), (9, 0)], strict=True))  # compute


def device_dtype(pair: Pair, device: Device) -> torch.dtype:
    """The format auto picks for the pair on a simulated CUDA GPU, by its compute capability (loading.auto_dtype)."""
    return auto_dtype(CAPABILITIES[device.name] >= (8, 0), True, pair.model_names)


def plans() -> list[tuple[Device, Pair, torch.dtype, MemoryPlan]]:
    rows = []
    for device in DEVICES:
        for pair in PAIRS:
            dtype = device_dtype(pair, device)
            plan = plan_pair(pair, device, dtype)
            assert plan is not None, f"every listed model has a shape, not {pair.model_names}"
            rows.append((device, pair, dtype, plan))
    return rows


def table(terms: bool = False) -> str:
    lines = [
        f"{'device':36s} {'pair':22s} {'format':9s} {'needed':>8s} {'usable':>8s} {'biggest term':>28s} "
        f"{'tokens a row':>12s} {'chain rows':>10s} offered"
    ]
    for device, pair, dtype, plan in plans():
        biggest = f"{plan.biggest} {readable_bytes(plan.terms[plan.biggest])}"
        offered = "yes" if plan.fits and plan.full else "yes, limited" if plan.fits else "no"
        lines.append(
            f"{device.name:36s} {pair.key:22s} {str(dtype).removeprefix('torch.'):9s} "
            f"{readable_bytes(plan.needed):>8s} {readable_bytes(plan.usable):>8s} {biggest:>28s} "
            f"{plan.limits.tokens:>12,} {plan.limits.chains:>10} {offered}"
        )
        if terms:
            lines.append(" " * 8 + ", ".join(f"{term} {readable_bytes(size)}" for term, size in plan.terms.items()))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--terms", action="store_true", help="every term of every plan")
    print(table(parser.parse_args().terms))


if __name__ == "__main__":
    main()
