"""The registry of drafters that need no model: a new kind is one class and one entry here. Anything else a pair
names as its drafter is a draft model."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from specdemo.config import MAX_NUM_DRAFT_TOKENS, SpeculativeConfig
from specdemo.drafters.base import Drafter, ModelDrafter, NgramDrafter
from specdemo.drafters.suffix import SuffixDrafter
from specdemo.engine.costs import measured, pass_costs
from specdemo.models.loading import LoadedModel, Progress


@dataclass(frozen=True)
class DrafterKind:
    name: str  # what a pair, the CLI's --draft and the app's drafter field call it
    label: str  # what tables call it
    description: str
    build: Callable[[LoadedModel, SpeculativeConfig], Drafter]  # (target, settings) -> a fresh drafter
    prepare: Callable[[LoadedModel, Progress], None] = lambda target, progress: None  # once the target has loaded


def measure_pass_costs(target: LoadedModel, progress: Progress) -> None:
    """At load, not in a run's time: the pass costs a cost-aware drafter plans with, for drafts of up to
    MAX_NUM_DRAFT_TOKENS on one candidate (seconds, once per model; wider passes are measured when first asked)."""
    if measured(target.model) is None:
        progress(f"Measuring {target.name}'s pass costs on this device (once, a few seconds)...")
    pass_costs(target.model, MAX_NUM_DRAFT_TOKENS + 1)


def is_model_free(drafter: str) -> bool:
    return drafter in DRAFTER_KINDS


def drafter_names() -> str:
    """For sentences: 'ngram' or 'suffix'."""
    return " or ".join(f"'{name}'" for name in DRAFTER_KINDS)


def build_drafter(
    drafter: str, target: LoadedModel, draft: LoadedModel | None, speculative: SpeculativeConfig
) -> Drafter:
    """A fresh drafter (its state is its own): a registered kind, or the draft model sampling with each row's draft
    settings."""
    if is_model_free(drafter):
        return DRAFTER_KINDS[drafter].build(target, speculative)
    assert draft is not None, f"the draft model '{drafter}' was not loaded"
    return ModelDrafter(draft.model, None, target.vocab_size)


DRAFTER_KINDS: dict[str, DrafterKind] = {
    kind.name: kind
    for kind in (
        DrafterKind(
            "ngram",
            "prompt lookup",
            "prompt lookup: copies what followed the same n-gram earlier, K tokens whenever it finds a match",
            lambda target, speculative: NgramDrafter(speculative.max_ngram_size, speculative.min_ngram_size),
        ),
        DrafterKind(
            "suffix",
            "suffix drafting, cost-aware",
            "suffix counts over the prompt, the output and earlier outputs, drafting as much as this device's pass "
            "costs say pays, and nothing when it would lose",
            lambda target, speculative: SuffixDrafter(target.model, speculative.suffix_cache_tokens),
            measure_pass_costs,
        ),
    )
}
NGRAM, SUFFIX = "ngram", "suffix"
