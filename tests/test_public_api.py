"""The public API is a promise: every name users and outside checks import from `specdemo` keeps working through any
move inside the package, and does what it did."""

from __future__ import annotations

import torch

import specdemo

PROMISED = [  # loading, the configs, the loops, the rule, the sampling helpers, the drafters, the statistics, the bench
    *("load_model", "OFFLINE_DEFAULT", "LoadedModel", "SamplingConfig", "SpeculativeConfig"),
    *("speculative_generate", "autoregressive_generate", "batch_generate", "BatchDecoder", "Round"),
    *("rejection_sample", "RejectionResult", "PADDING_ID", "residual_probs", "first_rejection_index"),
    *("emitted_token_ids", "verify_rows", "Draft", "DraftRequest", "CandidateVerdict"),
    *("build_warpers", "logits_to_probs", "sample_from_probs"),
    *(
        "Drafter",
        "NgramDrafter",
        "ModelDrafter",
        "SuffixDrafter",
        "NoDrafter",
        "RecurrentDrafter",
        "HybridDrafter",
        "DRAFTER_KINDS",
        "build_drafter",
    ),
    *("run_stats", "compare_runs", "RunStats", "Comparison", "expected_tokens_per_round"),
    *("run_bench", "BenchPrompt", "load_prompts"),
]


def test_every_promised_name_is_importable_from_the_package():
    missing = [name for name in PROMISED if not hasattr(specdemo, name)]
    assert not missing, missing
    assert set(PROMISED) <= set(specdemo.__all__)


def test_the_documented_calls_still_work(tiny_target):
    """The README's API call, on a tiny model: speculative decoding with prompt lookup equals the target alone."""
    prompt = torch.tensor([[0, 5, 9, 5, 9, 12, 7, 5, 9]])  # [1, T]
    greedy, spec = specdemo.SamplingConfig(), specdemo.SpeculativeConfig(num_draft_tokens=3, max_new_tokens=12)
    rounds = list(
        specdemo.speculative_generate(tiny_target, specdemo.NgramDrafter(), prompt, greedy, spec, frozenset())
    )
    alone = list(specdemo.autoregressive_generate(tiny_target, prompt, greedy, 12, frozenset()))
    assert [t for r in rounds for t in r.emitted_token_ids] == [t for r in alone for t in r.emitted_token_ids]
    assert specdemo.run_stats(rounds).num_generated == 12
    probs = torch.tensor([[[0.5, 0.5, 0.0]]])  # [B=1, K=1, V=3]
    result = specdemo.rejection_sample(torch.tensor([[0]]), probs, torch.cat([probs, probs], 1), generator=None)
    assert int(result.num_accepted[0]) == 1 and int(result.token_ids[0, 1]) in (0, 1)
