"""The registry of drafter kinds that need no model: a new kind is one module and one line here. Anything else a pair
names as its drafter is a draft model (drafters/model.py)."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from specdemo.config import Setting, run_settings
from specdemo.drafters.base import DrafterKind, DraftingContext
from specdemo.drafters.head_file import cached_head, head_path
from specdemo.drafters.hybrid import HybridDrafter, HybridOptions
from specdemo.drafters.ngram import NgramDrafter, NgramOptions
from specdemo.drafters.recurrent import RecurrentDrafter, RecurrentOptions
from specdemo.drafters.suffix import SuffixDrafter, SuffixOptions

NGRAM, SUFFIX, RECURRENT, HYBRID = "ngram", "suffix", "recurrent", "hybrid"


def _recurrent(context: DraftingContext) -> RecurrentDrafter:
    return RecurrentDrafter(cached_head(context.target_model, head_path(context.target_name)), context.vocab_size)


DRAFTER_KINDS: dict[str, DrafterKind] = {
    kind.name: kind
    for kind in (
        DrafterKind(
            NGRAM,
            "prompt lookup",
            "prompt lookup: copies what followed the same n-gram earlier, K tokens whenever it finds a match",
            NgramOptions,
            lambda options, context: NgramDrafter(options.max_ngram_size, options.min_ngram_size),
        ),
        DrafterKind(
            SUFFIX,
            "suffix drafting, cost-aware",
            "suffix counts over the prompt, the output and earlier outputs, drafting as much as this device's pass "
            "costs say pays, and nothing when it would lose",
            SuffixOptions,
            lambda options, context: SuffixDrafter(context.pass_costs, options.suffix_cache_tokens),
            cost_aware=True,
        ),
        DrafterKind(
            RECURRENT,
            "recurrent drafter (trained here)",
            "a small RNN reading three of the target's layers (fused), trained on the target's own texts "
            "(python -m specdemo train-drafter); W > 1 draws W sequences, or beam search at temperature 0",
            RecurrentOptions,
            lambda options, context: _recurrent(context),
        ),
        DrafterKind(
            HYBRID,
            "suffix copy + recurrent head, cost-aware",
            "the suffix drafter's copy and the recurrent head's draft as candidates of one pass: each round keeps "
            "the copy, the head's draft or both, as this device's pass costs say pays",
            HybridOptions,
            lambda options, context: HybridDrafter(
                SuffixDrafter(context.pass_costs), _recurrent(context), context.pass_costs, context.vocab_size
            ),
            cost_aware=True,
        ),
    )
}


def is_model_free(drafter: str) -> bool:
    return drafter in DRAFTER_KINDS


def drafter_names() -> str:
    """For sentences: 'ngram', 'suffix', 'recurrent' or 'hybrid'."""
    names = [f"'{name}'" for name in DRAFTER_KINDS]
    return ", ".join(names[:-1]) + " or " + names[-1]


def option_kinds() -> dict[str, DrafterKind]:
    """Each kind's options by name, in registry order, with the kind that declares it. Their names are unique across
    kinds, so each is one flag, one page control and one API parameter."""
    found = [(name, kind) for kind in DRAFTER_KINDS.values() for name in run_settings(kind.options)]
    assert len(found) == len(dict(found)), f"two drafter kinds name an option alike: {[name for name, _ in found]}"
    return dict(found)


def option_settings() -> dict[str, tuple[Any, Setting]]:
    """Every kind's options as config.run_settings gives a config's settings: (default, Setting) by name."""
    return {name: run_settings(kind.options)[name] for name, kind in option_kinds().items()}


def drafter_options(drafter: str, values: dict[str, object]) -> object | None:
    """The options of kind `drafter` from named values (others ignored, absent ones at their defaults), checked;
    None for a draft model, which has none."""
    kind = DRAFTER_KINDS.get(drafter)
    if kind is None:
        return None
    return kind.options(**{spec.name: values[spec.name] for spec in fields(kind.options) if spec.name in values})
