"""specdemo: speculative decoding, made visible — exact rejection sampling with a per-round trace.

The public API: every name below keeps working whatever moves inside the package (tests/test_public_api.py)."""

import os

from specdemo.models import onednn

# Batch-invariant bfloat16 kernels on AMX CPUs unless the user chose, set before anything runs (models/onednn.py).
os.environ.setdefault(onednn.VARIABLE, onednn.BATCH_INVARIANT)

from specdemo.bench.prompts import BenchPrompt, load_prompts
from specdemo.bench.single import run_bench
from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.core.rounds import CandidateTrace, Round
from specdemo.core.sampling import build_warpers, logits_to_probs, sample_from_probs
from specdemo.core.stats import Comparison, RunStats, compare_runs, expected_tokens_per_round, run_stats
from specdemo.core.verify import (
    PADDING_ID,
    CandidateVerdict,
    RejectionResult,
    emitted_token_ids,
    first_rejection_index,
    rejection_sample,
    residual_probs,
    verify_rows,
)
from specdemo.drafters import (
    DRAFTER_KINDS,
    Draft,
    Drafter,
    DrafterKind,
    DraftingContext,
    DraftRequest,
    HybridDrafter,
    ModelDrafter,
    NgramDrafter,
    NgramOptions,
    NoDrafter,
    RecurrentDrafter,
    SuffixDrafter,
    SuffixOptions,
)
from specdemo.engine.decoding import BatchDecoder, autoregressive_generate, batch_generate, speculative_generate
from specdemo.engine.drafting import build_drafter
from specdemo.models.loading import OFFLINE_DEFAULT, LoadedModel, load_model

__all__ = [
    "DRAFTER_KINDS",
    "OFFLINE_DEFAULT",
    "PADDING_ID",
    "BatchDecoder",
    "BenchPrompt",
    "CandidateTrace",
    "CandidateVerdict",
    "Comparison",
    "Draft",
    "DraftRequest",
    "Drafter",
    "DrafterKind",
    "DraftingContext",
    "HybridDrafter",
    "LoadedModel",
    "ModelDrafter",
    "NgramDrafter",
    "NgramOptions",
    "NoDrafter",
    "RecurrentDrafter",
    "RejectionResult",
    "Round",
    "RunStats",
    "SamplingConfig",
    "SpeculativeConfig",
    "SuffixDrafter",
    "SuffixOptions",
    "autoregressive_generate",
    "batch_generate",
    "build_drafter",
    "build_warpers",
    "compare_runs",
    "emitted_token_ids",
    "expected_tokens_per_round",
    "first_rejection_index",
    "load_model",
    "load_prompts",
    "logits_to_probs",
    "rejection_sample",
    "residual_probs",
    "run_bench",
    "run_stats",
    "sample_from_probs",
    "speculative_generate",
    "verify_rows",
]
