"""specdemo: speculative decoding, made visible — exact rejection sampling with a per-round trace."""

from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.decoding import Round, autoregressive_generate, speculative_generate
from specdemo.drafters import Draft, Drafter, ModelDrafter, NgramDrafter
from specdemo.models import OFFLINE_DEFAULT, LoadedModel, load_model
from specdemo.rejection import RejectionResult, rejection_sample
from specdemo.stats import Comparison, RunStats, compare_runs, expected_tokens_per_round, run_stats

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
