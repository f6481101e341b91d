"""Pass costs on a busy machine: the measurement keeps the least disturbed time of each size, and rounds that
disagree with their plans (or decline every draft for long) ask for another measurement. No test here depends on
the machine being idle: time is a stand-in clock."""

from __future__ import annotations

import pytest

from specdemo.core.planning import Plan, plan_draft
from specdemo.engine import cost_watch, costs
from specdemo.engine.cost_watch import DECLINED, WINDOW, CostWatch
from tests.helpers import tiny_model


class BusyClock:
    """A stand-in perf_counter: a round over n tokens takes 1 + 0.01 n seconds, 10 s more when another process
    disturbs it (`disturbed(round index)`, in the measurement's interleaved order, warm-up rounds included)."""

    def __init__(self, disturbed) -> None:
        self.now, self.rounds, self.disturbed = 0.0, 0, disturbed

    def __call__(self) -> float:
        return self.now

    def round(self, num_tokens: int) -> None:
        self.now += 1 + 0.01 * num_tokens + (10.0 if self.disturbed(self.rounds) else 0.0)
        self.rounds += 1


@pytest.mark.parametrize(
    "disturbed", [lambda r: r % 3 != 0, lambda r: r % 3 == 0], ids=["two rounds in three", "one round in three"]
)
def test_a_measurement_disturbed_in_most_repeats_still_finds_each_sizes_cost(monkeypatch, disturbed):
    """Most (or a third) of the rounds measured take ten times longer, as when another job shares the cores: each
    size's cost is still its undisturbed one (a median kept disturbed ones, and a plan then declined every draft)."""
    model, sizes = tiny_model(0), (1, 2, 4, 8)
    clock = BusyClock(disturbed)
    original_step = costs.BatchDecoder.step

    def step(decoder):
        clock.round(decoder.drafter.num_tokens + 1)
        return original_step(decoder)

    monkeypatch.setattr(costs.BatchDecoder, "step", step)
    seconds = costs.measure_pass_seconds(model, sizes, context_tokens=8, repeats=4, clock=clock)
    assert seconds == pytest.approx({size: 1 + 0.01 * size for size in sizes})


def a_plan(num_tokens: int, available: int, steps: float = 1.0) -> Plan:
    return Plan(num_tokens, 1, 1.0 + num_tokens * 0.5, steps, available, step_seconds=0.01)


def test_rounds_that_take_what_their_plans_expected_keep_the_costs():
    watch = CostWatch()
    for _ in range(5 * WINDOW):
        watch.observe(a_plan(4, 6, steps=1.2), 0.012 * 1.3)
        watch.observe(a_plan(0, 0), 0.01 * 0.9)
    assert not watch.stale


@pytest.mark.parametrize("ratio", [0.3, 3.0])
def test_rounds_far_from_what_their_plans_expected_ask_for_another_measurement_less_and_less_often(ratio):
    """A machine whose load keeps changing is measured again after 16 rounds, then 32, then 64: a run on a busy
    machine is not stopped every 16 rounds by a measurement."""
    watch = CostWatch()
    for wait in (WINDOW, 2 * WINDOW, 4 * WINDOW):
        for _ in range(wait - 1):
            watch.observe(a_plan(4, 6, steps=1.2), 0.012 * ratio)
        assert not watch.stale
        watch.observe(a_plan(4, 6, steps=1.2), 0.012 * ratio)
        assert watch.stale
        watch.measured_again()


def test_declining_every_offered_draft_for_long_asks_again_then_waits_longer():
    """Costs measured while busy can make every draft look dear: plain steps then agree with the plan, and nothing
    but another measurement can tell. After DECLINED such rounds one is taken; if drafting still does not pay, the
    next check waits twice as long."""
    watch = CostWatch()
    for _ in range(DECLINED - 1):
        watch.observe(a_plan(0, 5), 0.01)
    watch.observe(a_plan(4, 6, steps=1.2), 0.012)  # a round that drafted: the count starts again
    for _ in range(DECLINED - 1):
        watch.observe(a_plan(0, 5), 0.01)
    assert not watch.stale
    watch.observe(a_plan(0, 5), 0.01)
    assert watch.stale
    watch.measured_again()
    for _ in range(2 * DECLINED - 1):
        watch.observe(a_plan(0, 5), 0.01)
    assert not watch.stale
    watch.observe(a_plan(0, 5), 0.01)
    assert watch.stale


def test_pass_costs_are_measured_again_when_the_watch_says_so(monkeypatch):
    """A measurement taken while busy (k > 1 looks dear) declines drafts; the watch asks again, and the next costs,
    measured while idle, make drafting pay."""
    model = tiny_model(0)
    busy = {1: 1.0, 2: 3.0, 3: 3.5, 4: 4.0, 6: 5.0, 8: 6.0}
    idle = {size: 1.0 + 0.02 * size for size in busy}
    measurements = iter([busy, idle])
    monkeypatch.setattr(costs, "measure_pass_seconds", lambda model, sizes: next(measurements))
    monkeypatch.setattr(costs, "MEASURED_SIZES", tuple(busy))
    monkeypatch.setattr(cost_watch, "_WATCHES", cost_watch.weakref.WeakKeyDictionary())
    monkeypatch.setattr(costs, "_MEASURED", {})
    chances = [[0.8, 0.8, 0.8, 0.8, 0.8]]
    plan = plan_draft(chances, costs.pass_costs(model, 6))
    assert plan.num_tokens == 0
    for _ in range(DECLINED):
        cost_watch.watch(model).observe(plan, plan.step_seconds)
    plan = plan_draft(chances, costs.pass_costs(model, 6))
    assert plan.num_tokens == 5
