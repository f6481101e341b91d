"""Drafts cut for a shared pass: the batch keeps the depth with the most expected tokens per step (every row of a
pass is padded to the widest), rows learn their acceptance from their own rounds, greedy rows emit what they emit
alone, and sampled rows whose drafts were cut by their past still follow the target exactly."""

from __future__ import annotations

import pytest
import torch

from specdemo.app.views.summary import cut_note
from specdemo.audit import chi_square_pvalue, tv_distance
from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.core.planning import BatchCosts, plan_shared_pass
from specdemo.drafters import ModelDrafter, NgramDrafter
from specdemo.engine.costs import SHARED_WIDTHS, batch_costs, shared_costs
from specdemo.engine.decoding import BatchDecoder
from tests.engine.test_batch import PROMPTS
from tests.engine.test_decoding import NO_EOS, PROMPT, exact_marginals
from tests.helpers import TINY_VOCAB

# like SmolLM2 on 2 cores: a round of eight rows, each on its own context, costs more than one row over 8x the tokens
COSTS = BatchCosts.from_seconds(
    {1: 1.0, 2: 1.3, 4: 1.4, 6: 1.5, 17: 2.0}, {1: 1.6, 2: 2.2, 4: 3.0, 6: 3.8, 17: 8.0}, full_rows=8
)


def test_a_rounds_cost_runs_between_one_row_and_a_full_batch():
    assert COSTS.steps(1, 1) == 1.0 and COSTS.steps(8, 6) == 3.8 and COSTS.steps(1, 3) == 1.35
    assert abs(COSTS.steps(4, 2) - (1.3 + (2.2 - 1.3) * 3 / 7)) < 1e-12
    assert COSTS.steps(8, 12) > COSTS.steps(8, 6)  # between measured widths, and monotone


def test_one_long_draft_is_cut_when_seven_rows_would_be_padded_to_it():
    """A confident five-token draft pays alone, is cut among seven rows that draft nothing (their pass would be
    padded to six positions each), and is kept when all eight rows are as confident."""
    sure, plain = [[0.95] * 5], []
    depth, rate, uncut_rate = plan_shared_pass([sure], COSTS)
    assert depth == 5 and rate == uncut_rate
    depth, rate, uncut_rate = plan_shared_pass([sure] + [plain] * 7, COSTS)
    assert depth == 0 and rate == 8 / COSTS.steps(8, 1) and rate > uncut_rate
    assert plan_shared_pass([sure] * 8, COSTS)[0] == 5
    assert plan_shared_pass([[[0.3] * 5]] * 8, COSTS)[0] == 0  # unlikely drafts do not pay for a wide pass


def test_the_cut_keeps_the_depth_with_the_most_expected_tokens_per_step():
    """Against every depth worked out by hand: the expected tokens of each row over the pass's cost."""
    rows = [[[0.9, 0.8, 0.5, 0.2]], [[0.6, 0.6], [0.3]], []]
    reach = [[0.9, 0.72, 0.36, 0.072], [0.6, 0.36], [0.3]]
    rates = []
    for depth in range(5):
        tokens = 3 + sum(reach[0][:depth]) + sum(reach[1][:depth]) + sum(reach[2][:depth])
        slots = max(min(depth, 4), min(depth, 2) + min(depth, 1))
        rates.append(tokens / COSTS.steps(3, 1 + slots))
    depth, rate, uncut_rate = plan_shared_pass(rows, COSTS)
    assert rates[depth] == max(rates) and abs(rate - max(rates)) < 1e-12 and abs(uncut_rate - rates[4]) < 1e-12


def test_greedy_rows_with_cut_drafts_emit_what_they_emit_alone(tiny_target):
    """A ragged greedy batch under steep costs: drafts are cut in most rounds, every row's tokens are its own."""
    spec = SpeculativeConfig(num_draft_tokens=4, max_new_tokens=12)
    greedy = SamplingConfig()

    def decode(prompts: list[list[int]], costs: BatchCosts | None) -> tuple[dict[int, list[int]], int]:
        decoder = BatchDecoder(tiny_target, NgramDrafter(3, 1), NO_EOS, costs=costs)
        for key, prompt in enumerate(prompts):
            decoder.add(key, prompt, greedy, spec)
        tokens: dict[int, list[int]] = {key: [] for key in range(len(prompts))}
        cuts = 0
        while decoder.rows:
            for key, round_ in decoder.step():
                tokens[key] += round_.emitted_token_ids
                cuts += round_.cut is not None
        return tokens, cuts

    batched, cuts = decode(PROMPTS, COSTS)
    assert cuts >= 4, "the costs never cut a draft"
    for key, prompt in enumerate(PROMPTS):
        assert batched[key] == decode([prompt], None)[0][0], f"row {key}"


@pytest.mark.slow
@pytest.mark.parametrize("num_runs", [600, pytest.param(1500, marks=pytest.mark.thorough)])
def test_sampled_rows_whose_drafts_are_cut_by_their_past_follow_the_target(tiny_target, tiny_draft, num_runs):
    """Many seeds of a row sharing its passes with a row that drafts nothing, under costs that keep two sampled draft
    tokens while the row's acceptance is 1/2 or more and cut them to one below: the cut follows the row's own
    rejections, and its first three tokens still follow the exact target-only marginals (guards: both happen).
    600 seeds (p > 0.6 at every position) fail a cut draft verified with the q of its last drafted position instead
    of its first (p = 4e-10 at the second token); 1,500 seeds add power in `make test-all`."""
    num_tokens = 3
    sampling = SamplingConfig(temperature=1.0)
    exact = exact_marginals(tiny_target, PROMPT, sampling, num_tokens)  # [3, V]
    costs = BatchCosts.from_seconds({1: 1.0, 2: 1.0, 3: 1.0}, {1: 1.0, 2: 1.1, 3: 1.18}, full_rows=2)
    spec = SpeculativeConfig(num_draft_tokens=2, max_new_tokens=num_tokens + 2, draft_temperature=0.7)
    counts = torch.zeros(num_tokens, TINY_VOCAB, dtype=torch.float64)
    kept = cut = 0
    for seed in range(num_runs):
        decoder = BatchDecoder(tiny_target, ModelDrafter(tiny_draft, None, TINY_VOCAB), NO_EOS, costs=costs)
        decoder.add("row", PROMPT[0].tolist(), sampling, spec, generator=torch.Generator().manual_seed(seed))
        decoder.add("other", PROMPTS[1], SamplingConfig(), spec, drafting=False)
        emitted: list[int] = []
        while "row" in decoder.rows:
            for key, round_ in decoder.step():
                if key == "row":
                    emitted += round_.emitted_token_ids
                    kept += len(round_.draft_token_ids) == 2
                    cut += round_.cut is not None and round_.cut.num_tokens == 1
        for position, token in enumerate(emitted[:num_tokens]):
            counts[position, token] += 1
    assert kept >= num_runs and cut > num_runs // 5, (kept, cut)
    tv_bound = 0.08 * (1500 / num_runs) ** 0.5  # TV's sampling noise falls as 1/sqrt(N): 0.08 at 1,500 seeds
    for position in range(num_tokens):
        assert chi_square_pvalue(counts[position], exact[position]) > 1e-4, f"position {position}"
        assert tv_distance(counts[position], exact[position]) < tv_bound, f"position {position}"


def test_the_summary_says_what_cutting_did_to_a_run(tiny_target):
    decoder = BatchDecoder(tiny_target, NgramDrafter(3, 1), NO_EOS, costs=COSTS)
    for key, prompt in enumerate(PROMPTS):
        decoder.add(key, prompt, SamplingConfig(temperature=0.8), SpeculativeConfig(max_new_tokens=8))
    rounds = []
    while decoder.rows:
        rounds += [round_ for key, round_ in decoder.step() if key == 0]
    note = cut_note(rounds, greedy=False)
    assert note is not None and "shared its pass with up to 4 rows" in note and "another draw" in note
    assert cut_note([r for r in rounds if r.cut is None], greedy=False) is None


def test_shared_round_costs_are_measured_once_per_model_with_one_row_and_a_full_batch(tiny_target):
    costs = batch_costs(tiny_target, 4)
    assert costs.full_rows == 4 and costs.widths == SHARED_WIDTHS and costs.one_row[0] == 1.0
    for table in (costs.one_row, costs.full):
        assert list(table) == sorted(table), table
    assert batch_costs(tiny_target, 4) is costs and shared_costs(tiny_target) is costs
