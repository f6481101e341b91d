"""Pure: rounds -> Plotly figures (acceptance, latency by phase, acceptance by position and tokens per round,
throughput over time), small and transparent so they stream cheaply and read in light and dark themes."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from specdemo.decoding import Round
from specdemo.stats import num_tested, position_counts, run_stats

COLOURS = {
    "accepted": "rgb(34,160,80)",
    "rejected": "rgb(220,50,50)",
    "resampled": "rgb(235,160,20)",
    "bonus": "rgb(50,120,230)",
    "draft": "rgb(150,110,200)",
    "verify": "rgb(50,120,230)",
    "other": "rgb(150,150,150)",
    "baseline": "rgb(128,128,128)",
}


def _layout(figure: go.Figure, title: str, **axes: str) -> go.Figure:
    figure.update_layout(
        template="none",  # ~1 KB per figure instead of ~7 KB, and no background to clash with the theme
        title={"text": title, "font": {"size": 14}, "x": 0.02, "y": 0.97},
        paper_bgcolor="rgba(0,0,0,0)",
        plot_bgcolor="rgba(0,0,0,0)",
        font={"color": "rgb(128,128,128)"},
        margin={"l": 50, "r": 10, "t": 50, "b": 45},
        height=270,
        legend={"orientation": "h", "yanchor": "bottom", "y": 1.02, "xanchor": "right", "x": 1},
        barmode="stack",
    )
    for axis, label in axes.items():
        figure.update_layout({axis: {"title": {"text": label}}})
    return figure


def acceptance_figure(rounds: Sequence[Round]) -> go.Figure:
    """α of each round (accepted / tested), and cumulative over the run (rounds that drafted nothing are skipped)."""
    drafted = [round_ for round_ in rounds if round_.draft_token_ids]
    numbers = [round_.index + 1 for round_ in drafted]
    per_round = [round_.num_accepted / num_tested(round_) for round_ in drafted]
    accepted = list(accumulate(round_.num_accepted for round_ in drafted))
    tested = list(accumulate(num_tested(round_) for round_ in drafted))
    figure = go.Figure(
        [
            go.Bar(x=numbers, y=per_round, name="this round", marker_color=COLOURS["accepted"], opacity=0.5),
            go.Scatter(
                x=numbers,
                y=[a / t for a, t in zip(accepted, tested, strict=True)],
                name="cumulative",
                mode="lines",
                line={"color": COLOURS["accepted"], "width": 2},
            ),
        ]
    )
    figure.update_yaxes(range=[0, 1.05])
    return _layout(figure, "Acceptance α per round", xaxis="round", yaxis="α = accepted / tested")


def latency_figure(rounds: Sequence[Round]) -> go.Figure:
    """Milliseconds per round, stacked by phase: drafting, target verification, everything else."""
    numbers = [round_.index + 1 for round_ in rounds]
    figure = go.Figure(
        [
            go.Bar(
                x=numbers,
                y=[1e3 * getattr(round_, f"{phase}_seconds") for round_ in rounds],
                name=phase,
                marker_color=COLOURS[phase],
            )
            for phase in ("draft", "verify", "other")
        ]
    )
    return _layout(figure, "Latency per round by phase", xaxis="round", yaxis="ms")


def positions_figure(rounds: Sequence[Round], num_draft_tokens: int) -> go.Figure:
    """Left: α at each draft position (accepted there / tested there) beside the run's single α, which Leviathan's
    independence model assumes at every position. Right: tokens emitted per round."""
    tested, accepted = position_counts(rounds)
    alpha = run_stats(rounds).alpha
    emitted = [len(round_.emitted_token_ids) for round_ in rounds]
    figure = make_subplots(  # two-line titles: each half of a half-width chart is ~130 px wide
        rows=1, cols=2, subplot_titles=("α by draft position<br>(dashed: the run's α)", "Tokens per<br>round")
    )
    figure.add_trace(
        go.Bar(
            x=list(range(1, len(tested) + 1)),
            y=[a / t if t else 0 for a, t in zip(accepted, tested, strict=True)],
            name="α at this position",
            marker_color=COLOURS["accepted"],
        ),
        row=1,
        col=1,
    )
    figure.add_trace(
        go.Scatter(
            x=[0.5, len(tested) + 0.5],
            y=[alpha, alpha],
            name="one α for all (independence)",
            mode="lines",
            line={"color": COLOURS["baseline"], "dash": "dash"},
        ),
        row=1,
        col=1,
    )
    figure.add_trace(
        go.Histogram(
            x=emitted,
            xbins={"start": 0.5, "end": num_draft_tokens + 1.5, "size": 1},
            name="rounds",
            marker_color=COLOURS["bonus"],
        ),
        row=1,
        col=2,
    )
    figure.update_yaxes(range=[0, 1.05], row=1, col=1)
    figure.update_xaxes(title_text="draft position", row=1, col=1)
    figure.update_xaxes(title_text="tokens", row=1, col=2)
    figure.update_annotations(font_size=12)
    figure.update_layout(showlegend=False)
    return _layout(figure, "")


def throughput_figure(rounds: Sequence[Round], baseline: Sequence[Round] = ()) -> go.Figure:
    """Tokens generated against engine time, for the speculative run and (once run) the target alone."""
    figure = go.Figure()
    for name, run, colour in (
        ("speculative", rounds, COLOURS["bonus"]),
        ("target alone", baseline, COLOURS["baseline"]),
    ):
        if run:
            seconds = list(accumulate(round_.wall_seconds for round_ in run))
            tokens = list(accumulate(len(round_.emitted_token_ids) for round_ in run))
            figure.add_trace(go.Scatter(x=seconds, y=tokens, name=name, mode="lines", line={"color": colour}))
    return _layout(figure, "Tokens over time", xaxis="seconds", yaxis="tokens generated")
