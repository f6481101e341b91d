"""Figures from hand-built rounds: the numbers drawn are the numbers measured."""

from __future__ import annotations

import pytest

from specdemo.app.views.plots import (
    acceptance_figure,
    latency_figure,
    positions_figure,
    race_figure,
    throughput_figure,
)
from specdemo.core.race import LaneFigures
from tests.helpers import make_round

ROUNDS = [
    make_round(0, [], 0, "bonus", 0.4),  # the prefill round drafted nothing
    make_round(1, [1, 2, 3, 4], 4, "bonus", 0.1),  # accepts 4
    make_round(2, [1, 2, 3, 4], 1, "resampled", 0.1),  # accepts 1, rejects at position 2
    make_round(3, [1, 2], 0, "resampled", 0.2),  # rejects at position 1
]


def test_acceptance_per_round_and_cumulative():
    per_round, cumulative = acceptance_figure(ROUNDS).data
    assert list(per_round.x) == [2, 3, 4]  # the round that drafted nothing has no rate
    assert list(per_round.y) == [1.0, 0.5, 0.0]  # α: accepted / tested; round 3 never tested its last two drafts
    assert list(cumulative.y) == pytest.approx([1.0, 5 / 6, 5 / 7])


def test_latency_stacks_the_three_phases_in_milliseconds():
    draft, verify, other = latency_figure(ROUNDS).data
    assert (draft.name, verify.name, other.name) == ("draft", "verify", "other")
    assert list(verify.y) == pytest.approx([200.0, 50.0, 50.0, 100.0])


def test_acceptance_by_position_counts_only_positions_that_were_tested():
    by_position, independence, per_round = positions_figure(ROUNDS, num_draft_tokens=4).data
    # position 1: tested 3 times, accepted twice; position 2: tested twice, accepted once; 3 and 4: once, once
    assert list(by_position.y) == pytest.approx([2 / 3, 1 / 2, 1.0, 1.0])
    assert list(independence.y) == pytest.approx([5 / 7, 5 / 7])  # the run's one α, Leviathan's assumption
    assert list(per_round.x) == [1, 5, 2, 1]


def test_throughput_adds_the_baseline_once_it_exists():
    assert len(throughput_figure(ROUNDS).data) == 1
    speculative, baseline = throughput_figure(ROUNDS, ROUNDS[:2]).data
    assert list(speculative.y) == [1, 6, 8, 9]
    assert baseline.name == "target alone"


def test_the_finish_chart_draws_one_line_per_lane_against_passes_and_against_seconds():
    """Each lane from (0, 0) through its figures after each pass: tokens against passes on the left, against its
    estimated seconds alone (passes priced plus drafting) on the right; the legend names each lane once. Planted: the
    right chart drawn against the priced passes alone (no drafting) fails it."""
    history = {
        "target": [LaneFigures("target", [7], 1, 0.1, 0.0), LaneFigures("target", [7, 8], 2, 0.2, 0.0)],
        "suffix": [LaneFigures("suffix", [7, 8, 9], 1, 0.12, 0.01)],  # accepts 2, then a bonus
    }
    figure = race_figure(history)
    by_passes = [trace for trace in figure.data if trace.xaxis in (None, "x")]
    by_seconds = [trace for trace in figure.data if trace.xaxis == "x2"]
    assert [trace.name for trace in by_passes] == [trace.name for trace in by_seconds] == ["target", "suffix"]
    target, suffix = by_passes
    assert list(target.x) == [0, 1, 2] and list(target.y) == [0, 1, 2]
    assert list(suffix.x) == [0, 1] and list(suffix.y) == [0, 3]
    assert list(by_seconds[1].x) == pytest.approx([0.0, 0.13])  # its pass priced plus its drafting
    assert [trace.showlegend for trace in by_seconds] == [False, False]
