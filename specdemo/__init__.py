"""specdemo: speculative decoding, made visible — exact rejection sampling with a per-round trace."""

from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.core.rounds import Round
from specdemo.core.stats import Comparison, RunStats, compare_runs, expected_tokens_per_round, run_stats
from specdemo.core.verify import RejectionResult, rejection_sample
from specdemo.drafters.base import Draft, Drafter, ModelDrafter, NgramDrafter
from specdemo.engine.decoding import autoregressive_generate, speculative_generate
from specdemo.models.loading import OFFLINE_DEFAULT, LoadedModel, load_model

__all__ = [
    "OFFLINE_DEFAULT",
    "Comparison",
    "Draft",
    "Drafter",
    "LoadedModel",
    "ModelDrafter",
    "NgramDrafter",
    "RejectionResult",
    "Round",
    "RunStats",
    "SamplingConfig",
    "SpeculativeConfig",
    "autoregressive_generate",
    "compare_runs",
    "expected_tokens_per_round",
    "load_model",
    "rejection_sample",
    "run_stats",
    "speculative_generate",
]
