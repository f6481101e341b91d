"""What tools/gpu/run.sh asks of Python on the GPU machine: `versions` (the line it prints first) and `needed DIR`
(the wheels in DIR that the machine lacks: transformers' dependencies where its version does not satisfy the pinned
transformers' requirement, any other wheel where its version is not installed). Imports no torch for `needed`."""

from __future__ import annotations

import importlib.metadata
import platform
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename


def versions() -> str:
    """Python, torch, CUDA, the device and its compute capability, transformers: as this process imports them."""
    import torch

    said = [f"python {platform.python_version()}", f"torch {torch.__version__}", f"CUDA {torch.version.cuda}"]
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        said.append(f"{torch.cuda.get_device_name()} (cc {major}.{minor})")
    try:
        import transformers

        said.append(f"transformers {transformers.__version__} ({Path(transformers.__file__).parent.parent})")
    except ImportError as error:
        said.append(f"transformers missing ({error})")
    return ", ".join(said)


def requirements(wheels: list[Path]) -> dict[str, Requirement]:
    """The unconditional requirements of the transformers wheel among `wheels`, by canonical name."""
    found = [wheel for wheel in wheels if parse_wheel_filename(wheel.name)[0] == "transformers"]
    if not found:
        return {}
    with zipfile.ZipFile(found[0]) as archive:
        metadata = next(name for name in archive.namelist() if name.endswith(".dist-info/METADATA"))
        lines = archive.read(metadata).decode().splitlines()
    wanted = [Requirement(line.split(":", 1)[1]) for line in lines if line.startswith("Requires-Dist:")]
    return {canonicalize_name(r.name): r for r in wanted if r.marker is None}


def installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def needed(folder: Path) -> list[Path]:
    """The wheels in `folder` to install here (see the module's docstring)."""
    wheels = sorted(folder.glob("*.whl"))
    required = requirements(wheels)
    chosen = []
    for wheel in wheels:
        name, version = parse_wheel_filename(wheel.name)[:2]
        have = installed(name)
        if have is None or (have not in required[name].specifier if name in required else have != str(version)):
            chosen.append(wheel)
    return chosen


if __name__ == "__main__":
    if sys.argv[1] == "versions":
        print(versions())
    else:
        for wheel in needed(Path(sys.argv[2])):
            print(wheel)
