"""Pure: a run as a replay record (plain JSON, kept in the downloaded trace) that the page steps through round by round
with no model: each round's tokens, its sentence, and at each tested position the target's p, the draft's q and the
residual over their top tokens, decoded (under the coupled rule, the target's choice and the draft's with the noise
that decided them, in place of the residual and u); and the inspector's figure of one position."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import asdict

import plotly.graph_objects as go

from specdemo.app.views.narrate import round_sentence
from specdemo.app.views.plots import COLOURS, plain_figure
from specdemo.app.views.render import Decode, TokenSpan, html_spans, log_score, round_spans, token_text
from specdemo.core.rounds import CandidateTrace, Round

# Bumped when the record's shape changes; a trace of another format is refused in one sentence. A key that older
# records lack (a view's "coupled", a span's noise) is read with a default instead, so those still load.
REPLAY_FORMAT = 1


def _view_record(round_: Round, position: int, decode: Decode, context: list[int]) -> dict:
    """Position `position` of the round's path: its PositionView with each token's text, and how it was decided; with
    W > 1, each candidate tested there in the rule's order, and what it was tested against."""
    view = round_.views[position]
    drafted = round_.draft_token_ids[position] if position < len(round_.draft_token_ids) else None
    drawn = round_.next_token_id if position == round_.num_accepted else None
    record = asdict(view)
    record["labels"] = [token_text(decode, context, token) for token in view.token_ids]
    record["drafted"] = None if drafted is None else token_text(decode, context, drafted)
    record["drafted_index"] = view.token_ids.index(drafted) if drafted in view.token_ids else None
    record["drawn"] = None if drawn is None else token_text(decode, context, drawn)
    record["drawn_index"] = view.token_ids.index(drawn) if drawn in view.token_ids else None
    coupled = bool(round_.coupled)
    record["ratio"] = round_.acceptance_probs[position] if drafted is not None and not coupled else None
    record["u"] = round_.uniforms[position] if drafted is not None and not coupled else None
    record["accepted"] = position < round_.num_accepted
    record["next_kind"] = round_.next_kind if drawn is not None else None
    record["step"] = "test" if drafted is not None else ("bonus" if round_.draft_token_ids else "plain")
    record["tests"] = [
        _candidate_record(candidate, position, coupled)
        | {"candidate": number, "token": token_text(decode, context, candidate.token_ids[position])}
        for number, candidate in enumerate(round_.candidates, start=1)
        if len(round_.candidates) > 1 and position < len(candidate.tested) and candidate.tested[position]
    ]
    record["coupled"] = None
    if coupled:
        choice = round_.coupled[position]
        record["residual"], record["residual_rest"] = [], 0.0  # the next token is y, drawn from p by the noise
        record["coupled"] = asdict(choice) | {
            "target": token_text(decode, context, choice.target_id),
            "draft": None if choice.draft_id is None else token_text(decode, context, choice.draft_id),  # where the
            # path ended and a longer candidate was tested there, that candidate's token
            "target_index": view.token_ids.index(choice.target_id) if choice.target_id in view.token_ids else None,
        }
    return record


def _candidate_record(candidate: CandidateTrace, position: int, coupled: bool) -> dict:
    """One candidate's test at `position`: its p, q, min(1, p/q) and u; under the `coupled` rule its noise G and
    log p + G, accepted when it is the target's choice."""
    if coupled:
        noise = candidate.noise[position]
        score = log_score(candidate.target_probs[position], noise)
        return {"noise": noise, "score": score, "accepted": candidate.accepted[position]}
    return {
        "p": candidate.target_probs[position],  # what was left of p at its test: p, then each residual in turn
        "q": candidate.draft_probs[position],
        "ratio": candidate.acceptance_probs[position],
        "u": candidate.uniforms[position],
        "accepted": candidate.accepted[position],
    }


def replay_record(rounds: Sequence[Round], decode: Decode, prompt_ids: Sequence[int], greedy: bool = False) -> dict:
    """Everything the step view and the inspector show of a run, decoded once (`greedy`: a temperature-0 run, whose
    tests compare argmaxes); a coupled round's views each keep their `Round.coupled` entry under "coupled" (None for
    a standard round's, and absent from a record written before the coupled rule)."""
    emitted: list[int] = []
    context = list(prompt_ids)
    records = []
    for round_ in rounds:
        sentence = round_sentence(round_, decode, context, greedy)
        views = [
            _view_record(round_, position, decode, [*context, *round_.draft_token_ids[:position]])
            for position in range(len(round_.views))
        ]
        spans = [asdict(span) for span in round_spans(round_, decode, emitted)]
        records.append({"sentence": sentence, "spans": spans, "views": views})
        context.extend(round_.emitted_token_ids)
    return {"format": REPLAY_FORMAT, "greedy": greedy, "rounds": records}


def check_replay(record: object) -> dict:
    """A replay record read from a trace file, or a ValueError in one sentence saying what is wrong with it."""
    if not isinstance(record, dict) or "rounds" not in record:
        raise ValueError("This file has no rounds to replay: upload a trace downloaded from specdemo after a run.")
    if record.get("format") != REPLAY_FORMAT:
        raise ValueError(
            f"This trace was written by another version of specdemo (replay format {record.get('format')!r}, this one "
            f"reads {REPLAY_FORMAT}): run it again here and download a new trace."
        )
    rounds = record["rounds"]
    if not isinstance(rounds, list) or not rounds:
        raise ValueError("This trace has no rounds to replay: the run decoded nothing.")
    try:
        for round_ in rounds:
            [TokenSpan(**span) for span in round_["spans"]]
            assert isinstance(round_["sentence"], str) and isinstance(round_["views"], list)
    except (TypeError, KeyError, AssertionError) as error:
        raise ValueError(f"This trace's rounds are damaged ({error.__class__.__name__}): download it again.") from error
    return record


def step_html(record: dict, upto: int) -> str:
    """The tokens of rounds 1 .. `upto`, the last of them outlined; each token can be clicked for the inspector."""
    pieces = []
    for number, round_ in enumerate(record["rounds"][:upto], start=1):
        spans = html_spans([TokenSpan(**span) for span in round_["spans"]], clickable=True)
        pieces.append(f'<span class="step-current">{spans}</span>' if number == upto else spans)
    return "".join(pieces)


def step_sentence(record: dict, upto: int) -> str:
    """'Round 3 of 12. <its sentence>' ('of 3 so far' while a run decoded round by round goes on), or how to begin."""
    total = len(record["rounds"])
    if upto <= 0:
        return f"The run has {total} rounds: press **Next round** (or the N key) to step through them."
    of = f"{total} so far (Next round decodes the next)" if record.get("live") else total
    return f"**Round {upto} of {of}.** {html.escape(record['rounds'][upto - 1]['sentence'], quote=False)}"


def _acceptance_line(view: dict) -> list[dict]:
    """The test of the drafted token on [0, 1]: accepted when u falls under min(1, p/q)."""
    ratio, u = view["ratio"], view["u"]
    return [
        {
            "type": "bar",
            "orientation": "h",
            "x": [ratio],
            "y": ["test"],
            "name": f"accept if u < min(1, p/q) = {ratio:.2f}",
            "marker": {"color": COLOURS["accepted"], "opacity": 0.45},
            "xaxis": "x2",
            "yaxis": "y2",
            "width": 0.6,
        },
        {
            "type": "scatter",
            "mode": "markers+text",
            "x": [u],
            "y": ["test"],
            "name": f"u = {u:.2f}",
            "text": [f"u = {u:.2f}"],
            "textposition": "top center",
            "marker": {"symbol": "line-ns-open", "size": 22, "line": {"width": 3}, "color": "rgb(128,128,128)"},
            "xaxis": "x2",
            "yaxis": "y2",
        },
    ]


def _scores_bars(choice: dict) -> list[dict]:
    """The coupled rule's decision at a position: log p + G of the target's choice y (the largest there) and of the
    drafted x, which is accepted when it is y."""
    rows = [(f"target's choice {choice['target']!r}", choice["target_score"], choice["target_noise"], "verify")]
    if choice["draft_id"] is not None and choice["draft_id"] != choice["target_id"]:
        rows.append((f"drafted {choice['draft']!r}", choice["draft_score"], choice["draft_noise"], "draft"))
    return [
        {
            "type": "bar",
            "orientation": "h",
            "x": [score if math.isfinite(score) else None],  # log 0: no bar
            "y": [name],
            "name": f"{name}: log p + G = {score:.2f} (G = {noise:.2f})",
            "marker": {"color": COLOURS[colour], "opacity": 0.6},
            "xaxis": "x2",
            "yaxis": "y2",
            "width": 0.6,
        }
        for name, score, noise, colour in rows
    ]


def _marked_labels(view: dict) -> list[str]:
    """The position's token labels with the drafted and the drawn token marked (under the coupled rule, the target's
    choice y and the drafted x)."""
    labels = [repr(label)[1:-1] or "∅" for label in view["labels"]] + ["(all others)"]
    choice = view.get("coupled")
    if choice and choice["target_index"] == view["drafted_index"]:
        marks = [(view["drafted_index"], "drafted x = the target's choice y")]
    elif choice:
        marks = [(view["drafted_index"], "drafted x"), (choice["target_index"], "the target's choice y")]
    else:
        marks = [(view["drafted_index"], "drafted"), (view["drawn_index"], "drawn")]
    for index, mark in marks:
        if index is not None:
            labels[index] = f"{labels[index]} ({mark})"
    return labels


def inspector_figure(view: dict, title: str, greedy: bool = False) -> go.Figure:
    """Paired bars of p and q over the position's top tokens (the rest lumped), the residual where the next token came
    from it, the drafted and the drawn token marked, and the drafted token's test as u against min(1, p/q) (none for a
    greedy run: its p and q are one-hot at the argmaxes, and no u decides). Under the coupled rule: no residual, and
    log p + G of the target's choice y and of the drafted x in place of u."""
    labels = _marked_labels(view)
    bars = [
        ("target p", view["target"] + [view["target_rest"]], COLOURS["verify"]),
        ("draft q", view["draft"] + [view["draft_rest"]], COLOURS["draft"]),
    ]
    if view["residual"]:
        bars.append(("residual norm(max(0, p − q))", view["residual"] + [view["residual_rest"]], COLOURS["resampled"]))
    traces = [
        {"type": "bar", "x": labels, "y": values, "name": name, "marker": {"color": colour}}
        for name, values, colour in bars
    ]
    layout = {
        "barmode": "group",
        "height": 380,
        "yaxis": {"domain": [0.32, 1.0], "range": [0, 1], "title": {"text": "probability"}},
        "xaxis": {"tickangle": -30, "automargin": True},
        "legend": {"orientation": "h", "y": -0.5, "x": 0, "xanchor": "left", "yanchor": "top"},
        "margin": {"l": 50, "r": 10, "t": 40, "b": 10},
    }
    if view.get("ratio") is not None and view.get("u") is not None and not greedy:
        traces += _acceptance_line(view)
        layout["xaxis2"] = {
            "domain": [0, 1],
            "range": [0, 1],
            "anchor": "y2",
            "title": {"text": "u against min(1, p/q)"},
        }
        layout["yaxis2"] = {"domain": [0.0, 0.1], "anchor": "x2", "showticklabels": False}
        layout["yaxis"]["domain"] = [0.42, 1.0]
    elif view.get("coupled"):
        traces += _scores_bars(view["coupled"])
        layout["xaxis2"] = {"anchor": "y2", "title": {"text": "log p + G: the largest is the target's choice"}}
        layout["yaxis2"] = {"domain": [0.0, 0.14], "anchor": "x2", "showticklabels": False}
        layout["yaxis"]["domain"] = [0.46, 1.0]
    return plain_figure(traces, title, layout)


def view_title(view: dict, round_number: int, position: int, greedy: bool = False) -> str:
    """What the inspector shows, in words: the position and how its token was decided; with W > 1, each candidate
    tested there and against what."""
    where = f"Round {round_number}, draft position {position + 1}"
    if view.get("coupled"):
        return _coupled_title(view, round_number, where)
    source = "argmax" if greedy else "p"
    if view["step"] == "plain":
        return f"Round {round_number}: nothing drafted; the target drew {view['drawn']!r} from its {source}"
    if view["step"] == "bonus":
        return f"{where}: every draft accepted; the bonus {view['drawn']!r} is the target's {source}" + (
            "" if greedy else " drawn"
        )
    verdict = "accepted" if view["accepted"] else "rejected"
    if greedy:
        argmax = view["labels"][max(range(len(view["target"])), key=view["target"].__getitem__)]
        same = "is" if view["accepted"] else "is not"
        title = f"{where}: greedy, so {view['drafted']!r} is {verdict}: it {same} the target's argmax {argmax!r}"
        return title + ("" if view["accepted"] else ", which is emitted instead")
    test = f"u = {view['u']:.2f} {'<' if view['accepted'] else '≥'} min(1, p/q) = {view['ratio']:.2f}"
    title = f"{where}: {view['drafted']!r} {verdict} ({test})"
    if view["drawn"] is not None and not view["accepted"]:
        title += f"; {view['drawn']!r} drawn from the residual"
    tests = view.get("tests") or []
    if len(tests) > 1 or (tests and tests[0]["candidate"] != 1):
        title += ". Tested here, in turn: " + "; ".join(_candidate_test(test, i) for i, test in enumerate(tests))
    return title


def _coupled_title(view: dict, round_number: int, where: str) -> str:
    """A coupled position in words: the target's choice y with its log p + G and noise G, the drafted x with its, and
    what a match had to expect there under each rule."""
    choice = view["coupled"]
    target = (
        f"{choice['target']!r} (log p + G = {choice['target_score']:.2f}, its noise G = {choice['target_noise']:.2f})"
    )
    if view["step"] == "plain":
        return f"Round {round_number}: nothing drafted; the target's choice is {target}"
    if view["step"] == "bonus":
        return f"{where}: every draft accepted; the bonus is the target's choice {target}"
    if view["accepted"]:
        title = f"{where}: {view['drafted']!r} accepted: it is the target's choice {target}, the largest log p + G here"
    else:
        title = (
            f"{where}: {view['drafted']!r} rejected: the target's choice is {target}; the draft's has log p + G = "
            f"{choice['draft_score']:.2f} (its noise G = {choice['draft_noise']:.2f}), so the target's choice is "
            "emitted instead"
        )
    low, high = choice["coupled_chance"], choice["coupled_chance_high"]
    chance = f"{low:.2f}" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f} to {high:.2f}"
    standard = choice["standard_chance"]
    alive = choice.get("num_alive", 1)  # absent from records written before it: one candidate
    if alive > 1:
        title += (
            f". That one of the {alive} candidates tested here would match had chance {chance} (the standard rule "
            f"would accept one candidate with 1 − TV = {standard:.2f})"
        )
    else:
        title += f". A match here had chance {chance} (the standard rule would accept with 1 − TV = {standard:.2f})"
    tests = view.get("tests") or []
    if len(tests) > 1 or (tests and tests[0]["candidate"] != 1):
        title += ". Tested here, in turn: " + "; ".join(_coupled_test(test) for test in tests)
    return title


def _coupled_test(test: dict) -> str:
    """ "candidate 2 ' b': log p + G = -1.20, not the target's choice"."""
    verdict = "the target's choice, accepted" if test["accepted"] else "not the target's choice"
    return f"candidate {test['candidate']} {test['token']!r}: log p + G = {test['score']:.2f}, {verdict}"


def _candidate_test(test: dict, order: int) -> str:
    """ "candidate 2 ' b' against the residual after 1 rejected candidate: residual = 0.30, q = 0.50, u = 0.41 < 0.60,
    accepted"."""
    against = "p" if order == 0 else f"the residual after {order} rejected candidate{'s' * (order > 1)}"
    left = "p" if order == 0 else "residual"
    sign = "<" if test["accepted"] else "≥"
    verdict = "accepted" if test["accepted"] else "rejected"
    return (
        f"candidate {test['candidate']} {test['token']!r} against {against}: {left} = {test['p']:.3g}, "
        f"q = {test['q']:.3g}, u = {test['u']:.2f} {sign} {test['ratio']:.3g}, {verdict}"
    )
