"""Whether a model's measured pass costs still hold: rounds' observed times against what their plans expected. Costs
are measured once, at load (engine/costs.py); a measurement taken while the machine was busy can make drafting look
dear and switch it off for the model's lifetime, so rounds that disagree with the plan ask for another."""

from __future__ import annotations

import statistics
import weakref
from collections import deque

from transformers import PreTrainedModel

from specdemo.core.planning import Plan

WINDOW = 16  # rounds whose observed ÷ expected seconds are compared
AGREEMENT = (0.5, 2.0)  # the median ratio outside this: the costs no longer describe this machine
DECLINED = 32  # rounds in a row that drafted nothing though drafts were offered: measure again, to be sure
BACKOFF = 2  # after each measurement, each check waits this many times longer: a machine whose load keeps changing
# is measured again after 16, 32, 64... rounds, not every 16


class CostWatch:
    """One model's rounds against its plans."""

    def __init__(self) -> None:
        self.ratios: deque[float] = deque(maxlen=WINDOW)
        self.declined = 0
        self.rounds = 0  # observed since the last measurement
        self.patience = 1  # how many times longer than WINDOW and DECLINED the checks wait
        self.stale = False  # the costs should be measured again before the next plan

    def observe(self, plan: Plan, seconds: float) -> None:
        """A one-row round planned with `plan` took `seconds` (its pass, the rule and the bookkeeping)."""
        self.ratios.append(seconds / max(plan.expected_steps * plan.step_seconds, 1e-9))
        offered = plan.num_tokens == 0 and plan.available_tokens > 0
        self.declined = self.declined + 1 if offered else 0
        self.rounds += 1
        low, high = AGREEMENT
        disagree = len(self.ratios) == WINDOW and not low <= statistics.median(self.ratios) <= high
        if (disagree and self.rounds >= WINDOW * self.patience) or self.declined >= DECLINED * self.patience:
            self.stale = True

    def measured_again(self) -> None:
        """The costs were measured (again): the checks start afresh, and wait longer if they asked for it."""
        self.patience *= BACKOFF if self.stale else 1
        self.ratios.clear()
        self.declined, self.rounds, self.stale = 0, 0, False


_WATCHES: weakref.WeakKeyDictionary[PreTrainedModel, CostWatch] = weakref.WeakKeyDictionary()


def watch(model: PreTrainedModel) -> CostWatch:
    """The model's watch (one per model object, as its measured costs are kept)."""
    return _WATCHES.setdefault(model, CostWatch())
