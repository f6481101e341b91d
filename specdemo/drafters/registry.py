"""The registry of drafter kinds that need no model: a new kind is one module and one line here. Anything else a pair
names as its drafter is a draft model (drafters/model.py)."""

from __future__ import annotations

from dataclasses import Field, fields

from specdemo.drafters.base import DrafterKind
from specdemo.drafters.ngram import NgramDrafter, NgramOptions
from specdemo.drafters.suffix import SuffixDrafter, SuffixOptions

NGRAM, SUFFIX = "ngram", "suffix"
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
    )
}


def is_model_free(drafter: str) -> bool:
    return drafter in DRAFTER_KINDS


def drafter_names() -> str:
    """For sentences: 'ngram' or 'suffix'."""
    return " or ".join(f"'{name}'" for name in DRAFTER_KINDS)


def option_fields() -> list[tuple[DrafterKind, Field]]:
    """Every kind's options, in registry order: what the command line's flags and the page's controls are made of.
    Their names are unique across kinds, so each is one flag and one API parameter."""
    found = [(kind, spec) for kind in DRAFTER_KINDS.values() for spec in fields(kind.options)]
    names = [spec.name for _, spec in found]
    assert len(names) == len(set(names)), f"two drafter kinds name an option alike: {names}"
    return found


def drafter_options(drafter: str, values: dict[str, object]) -> object | None:
    """The options of kind `drafter` from named values (others ignored, absent ones at their defaults), checked;
    None for a draft model, which has none."""
    kind = DRAFTER_KINDS.get(drafter)
    if kind is None:
        return None
    return kind.options(**{spec.name: values[spec.name] for spec in fields(kind.options) if spec.name in values})
