"""Pure: rounds -> Plotly figures (acceptance, latency by phase, acceptance by position and tokens per round,
throughput over time), small and transparent so they stream cheaply and read in light and dark themes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import accumulate

import plotly.graph_objects as go

from specdemo.core.race import LaneFigures
from specdemo.core.rounds import Round
from specdemo.core.stats import num_tested, position_counts, run_stats

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
LANE_COLOURS = {  # a race's lanes, each its own hue; the target alone grey and dashed, as "target alone" elsewhere
    "target": COLOURS["baseline"],
    "ngram": COLOURS["accepted"],
    "suffix": COLOURS["resampled"],
    "recurrent": COLOURS["draft"],
    "hybrid": COLOURS["bonus"],
    "draft": COLOURS["shared"],
}


def plain_figure(traces: list[dict], title: str, layout: dict | None = None, **axes: str) -> go.Figure:
    """A figure from plain trace and layout dicts, unvalidated: Plotly's validators cost ~10 ms a figure, and four
    figures a run, rebuilt as it streams beside seven other runs, took the engine's CPU under load."""
    spec = {
        "template": {},  # ~1 KB per figure instead of ~7 KB, and no background to clash with the theme
        "title": {"text": title, "font": {"size": 14}, "x": 0.02, "y": 0.97},
        "paper_bgcolor": "rgba(0,0,0,0)",
        "plot_bgcolor": "rgba(0,0,0,0)",
        "font": {"color": "rgb(128,128,128)"},
        "margin": {"l": 50, "r": 10, "t": 50, "b": 45},
        "height": 270,
        "legend": {"orientation": "h", "yanchor": "bottom", "y": 1.02, "xanchor": "right", "x": 1},
        "barmode": "stack",
    }
    for axis, label in axes.items():
        spec[axis] = {"title": {"text": label}}
    for key, value in (layout or {}).items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    return go.Figure({"data": traces, "layout": spec}, _validate=False)


def acceptance_figure(rounds: Sequence[Round]) -> go.Figure:
    """α of each round (accepted / tested), and cumulative over the run (rounds that drafted nothing are skipped)."""
    drafted = [round_ for round_ in rounds if round_.draft_token_ids]
    numbers = [round_.index + 1 for round_ in drafted]
    per_round = [round_.num_accepted / num_tested(round_) for round_ in drafted]
    accepted = list(accumulate(round_.num_accepted for round_ in drafted))
    tested = list(accumulate(num_tested(round_) for round_ in drafted))
    traces = [
        {
            "type": "bar",
            "x": numbers,
            "y": per_round,
            "name": "this round",
            "marker": {"color": COLOURS["accepted"]},
            "opacity": 0.5,
        },
        {
            "type": "scatter",
            "x": numbers,
            "y": [a / t for a, t in zip(accepted, tested, strict=True)],
            "name": "cumulative",
            "mode": "lines",
            "line": {"color": COLOURS["accepted"], "width": 2},
        },
    ]
    return plain_figure(
        traces, "Acceptance α per round", {"yaxis": {"range": [0, 1.05]}}, xaxis="round", yaxis="α = accepted / tested"
    )


def latency_figure(rounds: Sequence[Round], baseline: Sequence[Round] = ()) -> go.Figure:
    """Milliseconds per round, stacked by phase: drafting, target verification, everything else; rounds whose pass
    was shared with other runs are marked with their number of rows; the target alone's steps (one token each) as a
    line, once it runs."""
    numbers = [round_.index + 1 for round_ in rounds]
    traces = [
        {
            "type": "bar",
            "x": numbers,
            "y": [1e3 * getattr(round_, f"{phase}_seconds") for round_ in rounds],
            "name": phase,
            "marker": {"color": COLOURS[phase]},
        }
        for phase in ("draft", "verify", "other")
    ]
    shared = [round_ for round_ in rounds if round_.num_rows > 1]
    if shared:
        traces.append(
            {
                "type": "scatter",
                "x": [round_.index + 1 for round_ in shared],
                "y": [1e3 * round_.wall_seconds for round_ in shared],
                "text": [f"×{round_.num_rows}" for round_ in shared],
                "mode": "markers+text",
                "textposition": "top center",
                "marker": {"symbol": "triangle-down", "color": COLOURS["shared"]},
                "name": "shared pass (×rows)",
                "hovertemplate": "round %{x}: pass shared by %{text} rows<extra></extra>",
            }
        )
    if baseline:
        traces.append(
            {
                "type": "scatter",
                "x": [round_.index + 1 for round_ in baseline],
                "y": [1e3 * round_.wall_seconds for round_ in baseline],
                "name": "target alone",
                "mode": "lines",
                "line": {"color": COLOURS["baseline"], "width": 1.5},
            }
        )
    return plain_figure(traces, "Latency per round by phase", xaxis="round", yaxis="ms")


def positions_figure(rounds: Sequence[Round], num_draft_tokens: int) -> go.Figure:
    """Left: α at each draft position (accepted there / tested there) beside the run's single α, which Leviathan's
    independence model assumes at every position. Right: tokens emitted per round."""
    tested, accepted = position_counts(rounds)
    alpha = run_stats(rounds).alpha
    emitted = [len(round_.emitted_token_ids) for round_ in rounds]
    traces = [
        {
            "type": "bar",
            "x": list(range(1, len(tested) + 1)),
            "y": [a / t if t else 0 for a, t in zip(accepted, tested, strict=True)],
            "name": "α at this position",
            "marker": {"color": COLOURS["accepted"]},
        },
        {
            "type": "scatter",
            "x": [0.5, len(tested) + 0.5],
            "y": [alpha, alpha],
            "name": "one α for all (independence)",
            "mode": "lines",
            "line": {"color": COLOURS["baseline"], "dash": "dash"},
        },
        {
            "type": "histogram",
            "x": emitted,
            "xbins": {"start": 0.5, "end": num_draft_tokens + 1.5, "size": 1},
            "name": "rounds",
            "marker": {"color": COLOURS["bonus"]},
            "xaxis": "x2",
            "yaxis": "y2",
        },
    ]

    def title(text: str, middle: float) -> dict:  # two lines: each half of a half-width chart is ~130 px wide
        place = dict(x=middle, y=1.0, xref="paper", yref="paper", xanchor="center", yanchor="bottom")
        return dict(text=text, showarrow=False, font={"size": 12}, **place)

    layout = {
        "xaxis": {"domain": [0, 0.45], "title": {"text": "draft position"}, "anchor": "y"},
        "yaxis": {"range": [0, 1.05], "anchor": "x"},
        "xaxis2": {"domain": [0.55, 1], "title": {"text": "tokens"}, "anchor": "y2"},
        "yaxis2": {"anchor": "x2"},
        "annotations": [
            title("α by draft position<br>(dashed: the run's α)", 0.225),
            title("Tokens per<br>round", 0.775),
        ],
        "showlegend": False,
    }
    return plain_figure(traces, "", layout)


def throughput_figure(rounds: Sequence[Round], baseline: Sequence[Round] = ()) -> go.Figure:
    """Tokens generated against engine time, for the speculative run and (once run) the target alone."""
    traces = [
        {
            "type": "scatter",
            "x": list(accumulate(round_.wall_seconds for round_ in run)),
            "y": list(accumulate(len(round_.emitted_token_ids) for round_ in run)),
            "name": name,
            "mode": "lines",
            "line": {"color": colour},
        }
        for name, run, colour in (
            ("speculative", rounds, COLOURS["bonus"]),
            ("target alone", baseline, COLOURS["baseline"]),
        )
        if run
    ]
    return plain_figure(traces, "Tokens over time", xaxis="seconds", yaxis="tokens generated")


def run_charts(rounds: Sequence[Round], num_draft_tokens: int, baseline: Sequence[Round] | None = None) -> tuple:
    """The One prompt tab's four charts of a run (the throughput one against the target alone, when it ran)."""
    return (
        acceptance_figure(rounds),
        latency_figure(rounds, baseline or []),
        positions_figure(rounds, num_draft_tokens),
        throughput_figure(rounds, baseline or []),
    )


def waiting(figure: go.Figure) -> go.Figure:
    """An empty chart drawn at page load, before any run: its title and a line saying what fills it, no axes. Drawn
    then, plotly loads and lays out the charts before a timed run, not during one."""
    figure.update_xaxes(visible=False).update_yaxes(visible=False)
    return figure.add_annotation(
        text="fills as the rounds arrive", showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper"
    )


def _candidate_methods(sweep: dict) -> list[tuple[int, str]]:
    """(W, method name) of the sweep's speculative methods."""
    return [(int(name.split("W=")[1].split()[0]), name) for name in sweep["methods"] if "W=" in name]


def batch_sweep_figure(sweep: dict, this_batch: tuple[int, float] | None = None) -> go.Figure:
    """Aggregate tokens/s against batch size B, per method, from a measured sweep (bench --batch-sizes); with
    `this_batch`, the (B, tokens/s) of the batch just run."""
    sizes = [row["batch_size"] for row in sweep["rows"]]
    traces = [
        {
            "type": "scatter",
            "x": sizes,
            "y": [row[name]["tokens_per_second"] for row in sweep["rows"]],
            "name": name.replace(" (ours)", ""),
            "mode": "lines+markers",
        }
        for name in sweep["methods"]
    ]
    if this_batch is not None:
        traces.append(
            {
                "type": "scatter",
                "x": [this_batch[0]],
                "y": [this_batch[1]],
                "name": "this batch",
                "mode": "markers",
                "marker": {"symbol": "star", "size": 14, "color": COLOURS["shared"]},
            }
        )
    return plain_figure(
        traces,
        "Measured: aggregate tokens/s by batch size",
        {  # seven lines and more: the legend goes under the chart, not over it
            "xaxis": {"type": "log", "tickvals": sizes},
            "height": 420,
            "margin": {"b": 150},
            "legend": {"yanchor": "top", "y": -0.25, "xanchor": "left", "x": 0},
        },
        xaxis="batch size B",
        yaxis="tokens/s",
    )


def candidates_sweep_figure(sweep: dict) -> go.Figure:
    """Tokens per target pass against the number of candidates W, one line per batch size, from a measured sweep."""
    methods = _candidate_methods(sweep)
    traces = [
        {
            "type": "scatter",
            "x": [w for w, _ in methods],
            "y": [row[name]["tokens_per_pass"] for _, name in methods],
            "name": f"B = {row['batch_size']}",
            "mode": "lines+markers",
        }
        for row in sweep["rows"]
    ]
    layout = {
        "xaxis": {"tickvals": [w for w, _ in methods]},
        "yaxis": {"rangemode": "tozero"},  # differences read at their true size
    }
    return plain_figure(
        traces, "Measured: tokens per target pass by W", layout, xaxis="candidates W", yaxis="tokens per pass"
    )


AUDIT_POSITIONS_SHOWN = 3  # positions drawn at first; the others are one click away in the legend


def toy_audit_figure(counts: Sequence[Sequence[int]], target: Sequence[float], passes: bool) -> go.Figure:
    """The share of each token emitted at each position (bars) over the target p (marks): lossless bars meet p."""
    tokens = list(range(len(target)))
    traces = [
        {
            "type": "bar",
            "x": tokens,
            "y": [c / max(sum(row), 1) for c in row],
            "name": f"position {position + 1} ({sum(row):,})",
            "visible": True if position < AUDIT_POSITIONS_SHOWN else "legendonly",
            "opacity": 0.75,
        }
        for position, row in enumerate(counts)
        if sum(row)
    ]
    traces.append(
        {
            "type": "scatter",
            "x": tokens,
            "y": list(target),
            "name": "target p",
            "mode": "markers",
            "marker": {"symbol": "line-ew-open", "size": 18, "line": {"width": 3, "color": COLOURS["baseline"]}},
        }
    )
    verdict = "follows p" if passes else "does not follow p"
    layout = {"barmode": "group", "xaxis": {"dtick": 1}}
    return plain_figure(traces, f"Emitted tokens by position: {verdict}", layout, xaxis="token", yaxis="share")


def toy_tv_figure(curve: Sequence[tuple[int, float, float]]) -> go.Figure:
    """TV at the first position against N, log-log, over the band that sampling noise alone reaches."""
    sizes = [n for n, _, _ in curve]
    traces = [
        {
            "type": "scatter",
            "x": sizes,
            "y": [band for _, _, band in curve],
            "name": "sampling noise alone (99.9%)",
            "mode": "lines",
            "fill": "tozeroy",
            "line": {"color": COLOURS["baseline"], "dash": "dot"},
        },
        {
            "type": "scatter",
            "x": sizes,
            "y": [max(tv, 1e-6) for _, tv, _ in curve],
            "name": "TV at position 1",
            "mode": "lines+markers",
            "line": {"color": COLOURS["rejected"]},
        },
    ]
    layout = {"xaxis": {"type": "log"}, "yaxis": {"type": "log"}}
    return plain_figure(traces, "TV against N: noise shrinks as 1/√N, a bias does not", layout, xaxis="N", yaxis="TV")


def model_audit_figure(labels: Sequence[str], speculative: Sequence[int], target_only: Sequence[int]) -> go.Figure:
    """The most frequent first-token sequences: their share among speculative and among target-only samples."""
    total_s, total_t = max(sum(speculative), 1), max(sum(target_only), 1)
    traces = [
        {
            "type": "bar",
            "x": list(labels),
            "y": [c / total for c in counts],
            "name": name,
            "marker": {"color": colour},
        }
        for name, counts, total, colour in (
            ("speculative", speculative, total_s, COLOURS["bonus"]),
            ("target alone", target_only, total_t, COLOURS["baseline"]),
        )
    ]
    layout = {"barmode": "group", "height": 340, "xaxis": {"tickangle": -40}}
    return plain_figure(traces, "First tokens: speculative against the target alone", layout, yaxis="share")


def race_figure(history: Mapping[str, Sequence[LaneFigures]]) -> go.Figure:
    """A race's finish chart, one line per lane from its figures after each target pass: tokens against target passes
    (left: the shared clock) and against the lane's estimated seconds alone (right: its own cost)."""
    traces = []
    for name, figures in history.items():
        style = {
            "mode": "lines",
            "line": {
                "color": LANE_COLOURS.get(name, COLOURS["other"]),
                "dash": "dash" if name == "target" else "solid",
            },
            "legendgroup": name,
        }
        tokens = [0, *(len(lane.token_ids) for lane in figures)]
        traces.append(
            {"type": "scatter", "x": [0, *(lane.passes for lane in figures)], "y": tokens, "name": name, **style}
        )
        seconds = [0.0, *(lane.estimated_seconds for lane in figures)]
        alone = {"xaxis": "x2", "yaxis": "y2", "showlegend": False}
        traces.append({"type": "scatter", "x": seconds, "y": tokens, "name": name, **style, **alone})
    layout = {
        "xaxis": {
            "domain": [0, 0.46],
            "title": {"text": "target passes (shared)"},
            "anchor": "y",
            "rangemode": "tozero",
        },
        "yaxis": {"title": {"text": "tokens"}, "anchor": "x", "rangemode": "tozero"},
        "xaxis2": {"domain": [0.54, 1], "title": {"text": "estimated seconds, each lane alone"}, "anchor": "y2"},
        "yaxis2": {"anchor": "x2", "rangemode": "tozero"},
        "height": 340,
        "margin": {"t": 70},
    }
    return plain_figure(traces, "The finish: tokens against passes, and against each lane's own time", layout)
