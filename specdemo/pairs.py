"""The registry of draft/target pairs: what exists, as data, and lookups on it (a key, a custom pair, whether a pair
needs a Hub token, the number format it decodes in). Whether a pair fits a device is models/fitting.py's and
engine/setup.py's; loading a pair and making its drafter, engine/setup.py's."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from specdemo.drafters.base import DrafterKind
from specdemo.drafters.registry import DRAFTER_KINDS, HYBRID, NGRAM, RECURRENT, SUFFIX, drafter_names, is_model_free
from specdemo.models.fitting import PARAMETER_COUNTS
from specdemo.models.loading import (
    OFFLINE_DEFAULT,
    check_model_name,
    gated_on_hub,
    hub_offline,
    hub_token_set,
    resolve_model_dtype,
)


@dataclass(frozen=True)
class Pair:
    """A target and its drafter, with why the pair is worth watching."""

    key: str
    label: str
    target: str  # an offline model name or a Hub id
    drafter: str  # a model-free kind's name (drafters.registry.DRAFTER_KINDS: `kind`), or a draft model's name sharing
    # the target's tokenizer (`draft_model`)
    note: str
    needs_hub: bool  # False: runs with no network (offline packages)
    suggested_hardware: str  # "cpu" or "gpu"
    draft_temperature: float | None = None  # None: the draft samples with the target's settings
    gated: bool = False  # True: a model's licence must be accepted on the Hub, and HF_TOKEN set (loading.gated_on_hub)

    @property
    def kind(self) -> DrafterKind | None:
        """Its drafter's kind; None for a draft model."""
        return DRAFTER_KINDS.get(self.drafter)

    @property
    def draft_model(self) -> str | None:
        """Its draft model's name (the target's own for a pair drafting for itself); None for a model-free kind."""
        return None if self.kind is not None else self.drafter

    @property
    def uses_draft_model(self) -> bool:
        return self.draft_model is not None

    @property
    def model_names(self) -> list[str]:
        """The models it loads: the target, and the draft model unless it is the target or a model-free kind."""
        return list(dict.fromkeys([self.target] + ([self.draft_model] if self.draft_model is not None else [])))

    @property
    def parameter_counts(self) -> dict[str, int | None]:
        """Each model's parameters, from PARAMETER_COUNTS; None for a model it does not list (a custom pair's).
        A model-free drafter counts nothing (a recurrent head's 3.7M parameters are left out)."""
        return {name: PARAMETER_COUNTS.get(name) for name in self.model_names}


PAIRS: tuple[Pair, ...] = (
    Pair(
        "smollm2-135m-ngram",
        "SmolLM2-135M-Instruct + prompt lookup (offline)",
        OFFLINE_DEFAULT,
        NGRAM,
        "No draft model at all: copies text that followed the same n-gram earlier; shines on summaries, edits "
        "and extraction, idles on free writing.",
        needs_hub=False,
        suggested_hardware="cpu",
    ),
    Pair(
        "smollm2-135m-suffix",
        "SmolLM2-135M-Instruct + suffix drafting, cost-aware (offline)",
        OFFLINE_DEFAULT,
        SUFFIX,
        "No draft model: drafts the most frequent continuation of the longest repeated suffix, as long as this "
        "machine's pass costs say it pays, and nothing when it would lose; the page says what it chose each round.",
        needs_hub=False,
        suggested_hardware="cpu",
    ),
    Pair(
        "smollm2-135m-recurrent",
        "SmolLM2-135M + recurrent drafter (trained here)",
        OFFLINE_DEFAULT,
        RECURRENT,
        "ReDrafter's drafter: a 3.7M-parameter RNN reads three of the target's layers, fused, and drafts through the "
        "target's own output layer, over the 8,192 tokens it writes most; trained here on the target's own answers, "
        "half of them to requests it wrote itself (experiments/gpu_heads.sh on a GPU; python -m specdemo train-drafter "
        "on a CPU). W > 1: beams.",
        needs_hub=False,
        suggested_hardware="cpu",
    ),
    Pair(
        "smollm2-135m-hybrid",
        "SmolLM2-135M + suffix copy and recurrent drafter (offline)",
        OFFLINE_DEFAULT,
        HYBRID,
        "Copying and the trained head catch different tokens: each round keeps the copy, the head's draft or "
        "both as candidates of one pass, as this machine's pass costs say pays; the tooltip names who proposed a "
        "token.",
        needs_hub=False,
        suggested_hardware="cpu",
    ),
    Pair(
        "smollm2-135m-self",
        "SmolLM2-135M-Instruct drafting for itself (offline)",
        OFFLINE_DEFAULT,
        OFFLINE_DEFAULT,
        "A teaching pair: with identical settings every draft is accepted; a hotter draft "
        "temperature shows rejections and resamples, and the output is still exactly the target's.",
        needs_hub=False,
        suggested_hardware="cpu",
        draft_temperature=1.5,
    ),
    Pair(
        "gemma-3-270m-ngram",
        "Gemma 3 270M + prompt lookup (offline, optional package)",
        "gemma-3-270m",
        NGRAM,
        "A base model with a 262k-token vocabulary: verification reads a much wider distribution per position.",
        needs_hub=False,
        suggested_hardware="cpu",
    ),
    Pair(
        "smollm2-135m-360m",
        "SmolLM2-135M → SmolLM2-360M-Instruct",
        "HuggingFaceTB/SmolLM2-360M-Instruct",
        OFFLINE_DEFAULT,
        "Same family, 2.7× the size: high acceptance, modest gain.",
        needs_hub=True,
        suggested_hardware="cpu",
    ),
    Pair(
        "smollm2-135m-1.7b",
        "SmolLM2-135M → SmolLM2-1.7B-Instruct",
        "HuggingFaceTB/SmolLM2-1.7B-Instruct",
        OFFLINE_DEFAULT,
        "The pair of the original write-up: a 12× cheaper draft.",
        needs_hub=True,
        suggested_hardware="gpu",
    ),
    Pair(
        "qwen2.5-0.5b-1.5b",
        "Qwen2.5-0.5B → Qwen2.5-1.5B-Instruct",
        "Qwen/Qwen2.5-1.5B-Instruct",
        "Qwen/Qwen2.5-0.5B-Instruct",
        "A close pair: acceptance stays high even when sampling.",
        needs_hub=True,
        suggested_hardware="gpu",
    ),
    Pair(
        "qwen2.5-0.5b-7b",
        "Qwen2.5-0.5B → Qwen2.5-7B-Instruct",
        "Qwen/Qwen2.5-7B-Instruct",
        "Qwen/Qwen2.5-0.5B-Instruct",
        "A 15× size gap, the regime where speculation pays most on a GPU.",
        needs_hub=True,
        suggested_hardware="gpu",
    ),
    Pair(
        "llama-3.2-1b-3.1-8b",
        "Llama-3.2-1B → Llama-3.1-8B-Instruct",
        "meta-llama/Llama-3.1-8B-Instruct",
        "meta-llama/Llama-3.2-1B-Instruct",
        "Across releases of one tokenizer (gated on the Hub: accept the licence).",
        needs_hub=True,
        suggested_hardware="gpu",
        gated=True,
    ),
    Pair(
        "gemma-3-270m-1b",
        "gemma-3-270m-it → gemma-3-1b-it",
        "google/gemma-3-1b-it",
        "google/gemma-3-270m-it",
        "The smallest Gemma drafting for the next size up (gated on the Hub: accept the licence).",
        needs_hub=True,
        suggested_hardware="gpu",
        gated=True,
    ),
)
PAIRS_BY_KEY = {pair.key: pair for pair in PAIRS}
DEFAULT_PAIR = PAIRS[0]


def find_pair(key: str) -> Pair:
    if key not in PAIRS_BY_KEY:
        raise ValueError(f"Unknown pair '{str(key)[:80]}': choose one of {', '.join(PAIRS_BY_KEY)}, or 'custom'.")
    return PAIRS_BY_KEY[key]


def custom_pair(target: str, drafter: str, allow_local: bool = False) -> Pair:
    """A pair of ids a user typed; the drafter may also be a model-free kind. Checked for syntax here, for tokenizers
    on load."""
    check_model_name(target, allow_local)
    if not is_model_free(drafter):
        try:
            check_model_name(drafter, allow_local)
        except ValueError as error:  # a misspelt drafter kind lands here too: name them
            raise ValueError(f"{str(error).removesuffix('.')}; a drafter may also be {drafter_names()}.") from None
    return Pair(
        "custom",
        f"{target} drafted by {drafter}",
        target,
        drafter,
        "Your own pair.",
        needs_hub=True,
        suggested_hardware="gpu",
        gated=gated_on_hub(target) or gated_on_hub(drafter),
    )


def pairs_table(marks: Mapping[str, str]) -> str:
    """The pairs as the CLI lists them, each label followed by its mark (engine.setup.pair_marks: too big for this
    device in the format auto picks for it, or gated without a token)."""
    lines = [f"{'key':22s} {'network':8s} {'hardware':8s} label"]
    for pair in PAIRS:
        lines.append(
            f"{pair.key:22s} {'Hub' if pair.needs_hub else 'offline':8s} {pair.suggested_hardware:8s} "
            f"{pair.label}{marks[pair.key]}\n{'':40s}{pair.note}"
        )
    return "\n".join(lines)


def pair_dtype(pair: Pair, name: str, device: torch.device) -> torch.dtype:
    """The number format `name` means for the pair on `device`: auto is float32 where float16 would overflow one of
    its models (loading.resolve_model_dtype)."""
    return resolve_model_dtype(name, device, pair.model_names)


def needs_token(pair: Pair) -> bool:
    """Whether the pair is gated and no Hub token is set (with HF_HUB_OFFLINE, files come from the local cache)."""
    return pair.gated and not hub_offline() and not hub_token_set()
