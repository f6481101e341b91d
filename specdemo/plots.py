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
    "shared": "rgb(200,90,160)",
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
    """Milliseconds per round, stacked by phase: drafting, target verification, everything else; rounds whose pass
    was shared with other runs are marked with their number of rows."""
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
    shared = [round_ for round_ in rounds if round_.num_rows > 1]
    if shared:
        figure.add_trace(
            go.Scatter(
                x=[round_.index + 1 for round_ in shared],
                y=[1e3 * round_.wall_seconds for round_ in shared],
                text=[f"×{round_.num_rows}" for round_ in shared],
                mode="markers+text",
                textposition="top center",
                marker={"symbol": "triangle-down", "color": COLOURS["shared"]},
                name="shared pass (×rows)",
                hovertemplate="round %{x}: pass shared by %{text} rows<extra></extra>",
            )
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


def _candidate_methods(sweep: dict) -> list[tuple[int, str]]:
    """(W, method name) of the sweep's speculative methods."""
    return [(int(name.split("W=")[1].split()[0]), name) for name in sweep["methods"] if "W=" in name]


def batch_sweep_figure(sweep: dict, this_batch: tuple[int, float] | None = None) -> go.Figure:
    """Aggregate tokens/s against batch size B, per method, from a measured sweep (bench --batch-sizes); with
    `this_batch`, the (B, tokens/s) of the batch just run."""
    sizes = [row["batch_size"] for row in sweep["rows"]]
    figure = go.Figure(
        [
            go.Scatter(
                x=sizes,
                y=[row[name]["tokens_per_second"] for row in sweep["rows"]],
                name=name.replace(" (ours)", ""),
                mode="lines+markers",
            )
            for name in sweep["methods"]
        ]
    )
    if this_batch is not None:
        figure.add_trace(
            go.Scatter(
                x=[this_batch[0]],
                y=[this_batch[1]],
                name="this batch",
                mode="markers",
                marker={"symbol": "star", "size": 14, "color": COLOURS["shared"]},
            )
        )
    figure.update_xaxes(type="log", tickvals=sizes)
    return _layout(figure, "Measured: aggregate tokens/s by batch size", xaxis="batch size B", yaxis="tokens/s")


def candidates_sweep_figure(sweep: dict) -> go.Figure:
    """Tokens per target pass against the number of candidates W, one line per batch size, from a measured sweep."""
    methods = _candidate_methods(sweep)
    figure = go.Figure(
        [
            go.Scatter(
                x=[w for w, _ in methods],
                y=[row[name]["tokens_per_pass"] for _, name in methods],
                name=f"B = {row['batch_size']}",
                mode="lines+markers",
            )
            for row in sweep["rows"]
        ]
    )
    figure.update_xaxes(tickvals=[w for w, _ in methods])
    figure.update_yaxes(rangemode="tozero")  # differences read at their true size
    return _layout(figure, "Measured: tokens per target pass by W", xaxis="candidates W", yaxis="tokens per pass")
