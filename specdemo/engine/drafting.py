"""Building a drafter for a target: the registry's kinds, or a draft model, with what the engine measures on this device
(the target's pass costs) handed over in a DraftingContext."""

from __future__ import annotations

from functools import partial

from specdemo.config import MAX_NUM_DRAFT_TOKENS
from specdemo.drafters.base import Drafter, DraftingContext
from specdemo.drafters.model import ModelDrafter
from specdemo.drafters.registry import DRAFTER_KINDS
from specdemo.engine.costs import measured, pass_costs
from specdemo.models.loading import LoadedModel, Progress


def build_drafter(
    drafter: str,
    target: LoadedModel,
    draft: LoadedModel | None = None,
    options: object | None = None,  # the kind's options dataclass; None: its defaults
) -> Drafter:
    """A fresh drafter (its state is its own): kind `drafter` with `options`, or the draft model `draft` sampling with
    each row's own draft settings."""
    kind = DRAFTER_KINDS.get(drafter)
    if kind is None:
        assert draft is not None, f"the draft model '{drafter}' was not loaded"
        return ModelDrafter(draft.model, None, target.vocab_size)
    context = DraftingContext(
        target.vocab_size, partial(pass_costs, target.model), target_model=target.model, target_name=target.name
    )
    return kind.build(options if options is not None else kind.options(), context)


def prepare_drafter(drafter: str, target: LoadedModel, progress: Progress) -> None:
    """At load, not in a run's time: the pass costs a cost-aware kind plans with, for drafts of up to
    MAX_NUM_DRAFT_TOKENS on one candidate (seconds, once per model; wider passes are measured when first asked)."""
    kind = DRAFTER_KINDS.get(drafter)
    if kind is None or not kind.cost_aware:
        return
    if measured(target.model) is None:
        progress(f"Measuring {target.name}'s pass costs on this device (once, a few seconds)...")
    pass_costs(target.model, MAX_NUM_DRAFT_TOKENS + 1)
