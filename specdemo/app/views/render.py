"""Pure: rounds -> token spans with their outcome and numbers, rendered as escaped HTML or coloured terminal text."""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from specdemo.core.race import LaneFigures
from specdemo.core.rounds import CoupledChoice, Round
from specdemo.core.stats import run_stats

Kind = Literal["accepted", "rejected", "resampled", "bonus"]
Decode = Callable[
    [list[int]], str
]  # token ids -> text, e.g. functools.partial(tokenizer.decode, skip_special_tokens=False)

CONTEXT_TOKENS = 8  # a token's text is decoded after this many earlier tokens, so leading spaces survive


SOURCES = {"copy": "the suffix drafter's copy", "head": "the recurrent head"}  # a hybrid's candidates


@dataclass(frozen=True)
class TokenSpan:
    """One token as the reader sees it: its text, what happened to it, and the numbers that decided it (under the
    coupled rule, the noise G and log p + G in place of u and p/q)."""

    text: str
    kind: Kind
    round_index: int
    token_id: int
    target_prob: float | None  # p of this token at its position
    draft_prob: float | None  # q of this token (draft tokens only)
    acceptance_prob: float | None  # min(1, p/q) (draft tokens of a standard round only)
    uniform: float | None  # the draw u it was tested with; None for drafts discarded after an earlier rejection
    plan: str = ""  # what a cost-aware drafter chose for the round, e.g. "drafted 3: expected 2.4 tokens for 1.7 steps"
    source: str = ""  # which drafter proposed a draft token, where several did: "copy" or "head"
    position: int | None = None  # the round's tested position that decided it (Round.views), None if never tested
    # The coupled rule's numbers (all None for a standard round and for an untested draft): a drafted x is accepted
    # when it is y, the target's choice, the token with the largest log p + G under its position's noise G.
    noise: float | None = None  # G of this token at its position
    score: float | None = None  # log p + G of this token
    choice_id: int | None = None  # y at a draft token's position (the token itself where it was accepted)
    choice_text: str = ""
    choice_score: float | None = None  # log p + G of y


def token_text(decode: Decode, context_ids: Sequence[int], token_id: int) -> str:
    """The text a token adds after its context (decoding a lone token loses the spaces some tokenizers merge)."""
    context = list(context_ids[-CONTEXT_TOKENS:])
    return decode([*context, token_id])[len(decode(context)) :]


def round_spans(round_: Round, decode: Decode, emitted: list[int]) -> list[TokenSpan]:
    """One round's tokens in the order they were proposed or emitted; appends its emitted ids to `emitted`."""
    spans: list[TokenSpan] = []
    refused: list[int] = []  # rejected drafts of this round, decoded after each other where they were proposed
    coupled = bool(round_.coupled)
    for position, token in enumerate(round_.draft_token_ids):
        accepted = position < round_.num_accepted
        tested = position <= round_.num_accepted
        choice = round_.coupled[position] if coupled and tested else None
        spans.append(
            TokenSpan(
                text=token_text(decode, emitted + refused, token),
                kind="accepted" if accepted else "rejected",
                round_index=round_.index,
                token_id=token,
                target_prob=round_.target_probs[position],
                draft_prob=round_.draft_probs[position],
                acceptance_prob=None if coupled else round_.acceptance_probs[position],
                uniform=round_.uniforms[position] if tested and not coupled else None,
                plan=plan_text(round_),
                source=round_.candidates[round_.path].source if round_.candidates else "",
                position=position if tested else None,
                **(
                    _coupled_test(choice, choice.draft_noise, choice.draft_score, decode, emitted)
                    if choice is not None
                    else {}
                ),
            )
        )
        (emitted if accepted else refused).append(token)
    next_span = _next_span(round_, decode, emitted)
    if next_span is not None:
        spans.append(next_span)
        emitted.append(next_span.token_id)
    return spans


def _coupled_test(
    choice: CoupledChoice, noise: float | None, score: float | None, decode: Decode, context_ids: Sequence[int]
) -> dict:
    """A coupled round's drafted token at a tested position: its noise and log p + G, and the target's choice y there
    (decoded after `context_ids`), which it had to be."""
    return {
        "noise": noise,
        "score": score,
        "choice_id": choice.target_id,
        "choice_text": token_text(decode, context_ids, choice.target_id),
        "choice_score": choice.target_score,
    }


def _next_span(round_: Round, decode: Decode, context_ids: Sequence[int]) -> TokenSpan | None:
    """The round's resampled or bonus token after `context_ids`; None when an accepted EOS ended the run. Under the
    coupled rule it is the target's choice there, with its noise and log p + G."""
    if round_.next_token_id is None or round_.next_kind is None:
        return None
    choice = round_.coupled[round_.num_accepted] if round_.coupled else None
    return TokenSpan(
        text=token_text(decode, context_ids, round_.next_token_id),
        kind=round_.next_kind,
        round_index=round_.index,
        token_id=round_.next_token_id,
        target_prob=round_.next_token_prob,
        draft_prob=None,
        acceptance_prob=None,
        uniform=None,
        plan=plan_text(round_),
        position=round_.num_accepted,
        noise=choice.target_noise if choice is not None else None,
        score=choice.target_score if choice is not None else None,
    )


def plan_text(round_: Round) -> str:
    """How much the round drafted and why: a cost-aware drafter's plan, and a cut for a shared pass."""
    return "; ".join(choice.describe() for choice in (round_.plan, round_.cut) if choice)


def token_spans(rounds: Sequence[Round], decode: Decode) -> list[TokenSpan]:
    """Every accepted, rejected, resampled and bonus token of a run."""
    emitted: list[int] = []
    return [span for round_ in rounds for span in round_spans(round_, decode, emitted)]


ANSI_STYLES: dict[Kind, str] = {
    "accepted": "\x1b[32m",  # green
    "rejected": "\x1b[9;31m",  # red, struck through
    "resampled": "\x1b[33m",  # yellow
    "bonus": "\x1b[36m",  # cyan
}
ANSI_RESET = "\x1b[0m"


def ansi_text(spans: Sequence[TokenSpan]) -> str:
    """The run for a terminal: each token in its outcome's colour, with a legend line first."""
    legend = " ".join(f"{ANSI_STYLES[kind]}{kind}{ANSI_RESET}" for kind in ANSI_STYLES)
    body = "".join(f"{ANSI_STYLES[span.kind]}{span.text}{ANSI_RESET}" for span in spans)
    return f"{legend}\n{body}"


def _tooltip(span: TokenSpan) -> str:
    """The numbers behind a token, for its native hover tooltip."""
    parts = [f"{span.kind}, round {span.round_index + 1}", f"token id {span.token_id}"]
    if span.plan:
        parts.insert(1, span.plan)
    if span.source:
        parts.insert(1, f"proposed by {SOURCES.get(span.source, span.source)}")
    if span.target_prob is not None:
        parts.append(f"target p = {span.target_prob:.4f}")
    if span.draft_prob is not None:
        parts.append(f"draft q = {span.draft_prob:.4f}")
    if span.acceptance_prob is not None:
        parts.append(f"accept with min(1, p/q) = {span.acceptance_prob:.4f}")
    if span.uniform is not None:
        parts.append(f"uniform draw u = {span.uniform:.4f}")
    elif span.noise is not None:
        parts.append(_coupled_tooltip(span))
    elif span.kind == "rejected":
        parts.append("not tested: an earlier draft of this round was rejected")
    return " · ".join(parts)


def _coupled_tooltip(span: TokenSpan) -> str:
    """How the coupled rule decided a token: its noise G and log p + G, against the target's choice's."""
    own = f"log p + G = {span.score:.4f}, its noise G = {span.noise:.4f}"
    if span.kind == "rejected":
        return (
            f"not the target's choice: {own}; the target's choice here is {span.choice_text!r} "
            f"(log p + G = {span.choice_score:.4f}), emitted in its place"
        )
    if span.kind == "accepted":
        return f"matched the target's choice: {own}, the largest here"
    return f"the target's choice: {own}, the largest here (a sample from p)"


def html_spans(spans: Sequence[TokenSpan], round_marks: bool = True, clickable: bool = False) -> str:
    """Token spans as HTML, each text escaped, with a marker where every round but the first begins (with
    round_marks); a clickable token names its round and position (data-r, data-p) for the inspector.

    No wrapping element, so a growing run is a growing string (Gradio then streams only the new part).
    """
    pieces: list[str] = []
    current_round = None
    for span in spans:
        if round_marks and span.round_index != current_round and span.round_index > 0:
            title = html.escape(f"round {span.round_index + 1}" + (f": {span.plan}" if span.plan else ""), quote=True)
            pieces.append(f'<span class="round-sep" title="{title}"></span>')
        current_round = span.round_index
        text = html.escape(span.text, quote=True)
        where = ""
        if clickable and span.position is not None:
            where = f' data-r="{span.round_index}" data-p="{span.position}"'
        pieces.append(
            f'<span class="tok tok-{span.kind}"{where} title="{html.escape(_tooltip(span), quote=True)}">{text}</span>'
        )
    return "".join(pieces)


def alone_html(label: str, text: str, num_tokens: int, running: bool) -> str:
    """A comparison run's text (the target or the draft model alone) under the speculative run's tokens: open and
    growing while it decodes, folded once it is done (the summary says whether the texts agree)."""
    state = f"decoding, {num_tokens} tokens so far" if running else f"{num_tokens} tokens"
    return (
        f'<details class="alone"{" open" if running else ""}><summary>The {html.escape(label)}: {state}</summary>'
        f'<div class="alone-text">{html.escape(text, quote=True)}</div></details>'
    )


LEGEND_HTML = " ".join(
    f'<span class="tok tok-{kind}" title="{meaning}">{kind}</span>'
    for kind, meaning in (
        ("accepted", "a draft token the target accepted (green, a solid underline)"),
        ("rejected", "a draft token the target refused (red, struck through, where it was proposed)"),
        (
            "resampled",
            "the target's own token after a rejection: from norm(max(0, p - q)), or under the coupled rule the "
            "target's choice, the largest log p + G (amber, dotted underline)",
        ),
        ("bonus", "the extra target token after all drafts were accepted (blue, a double underline)"),
    )
)

# Translucent backgrounds and inherited text colour: readable in the light and the dark theme. Each outcome has a
# second cue besides colour, for colour-blind readers, projectors and greyscale: accepted a solid underline, rejected a
# strike-through, resampled a dotted underline, bonus a double one (tests/app/test_contrast.py checks WCAG AA).
TOKEN_CSS = """
.tokens { white-space: pre-wrap; line-height: 1.9; font-family: ui-monospace, SFMono-Regular, Menlo, monospace;
          font-size: 0.95em; overflow-wrap: anywhere; }
.tok { color: inherit; border-radius: 3px; padding: 1px 0; background-clip: padding-box; }
.tok-accepted { background-color: rgba(34, 160, 80, .30); border-bottom: 2px solid rgb(34, 160, 80); }
.tok-rejected { background-color: rgba(220, 50, 50, .28); text-decoration: line-through 2px rgb(220, 50, 50); }
.tok-resampled { background-color: rgba(235, 160, 20, .38); border-bottom: 2px dotted rgb(200, 120, 0); }
.tok-bonus { background-color: rgba(50, 120, 230, .32); border-bottom: 4px double rgb(50, 120, 230); }
.alone { margin-top: 0.8em; color: rgb(128, 128, 128); }
.alone summary { cursor: pointer; font-family: sans-serif; font-size: 0.9em; }
.round-sep { display: inline-block; width: 0; height: 1.2em; margin: 0 2px; vertical-align: middle;
             border-left: 1px dashed rgba(128, 128, 128, .7); }
"""


MAX_CANDIDATE_ROUNDS = 40  # the candidates view shows the latest rounds; the trace keeps them all


@dataclass
class _Node:
    """A draft token in a round's tree of candidates: candidates that share a prefix share its nodes."""

    span: TokenSpan
    candidates: list[int]  # the candidates through this node (0-based)
    children: dict[int, _Node]


def _candidate_tree(round_: Round, decode: Decode, emitted: list[int]) -> dict[int, _Node]:
    """The round's candidates as a prefix tree. A shared token shows the test it met: the first candidate that tested
    it (the rule tries a token once; a later candidate with the same token waits on that test). Under the coupled rule
    a candidate's `noise` holds the G that decided each of its tokens' tests."""
    roots: dict[int, _Node] = {}
    coupled = bool(round_.coupled)
    for w, candidate in enumerate(round_.candidates):
        level, context = roots, list(emitted)
        for j, token in enumerate(candidate.token_ids):
            tested = candidate.tested[j]
            draw = candidate.noise[j] if coupled else candidate.uniforms[j]  # what decided the test
            span = TokenSpan(
                text=token_text(decode, context, token),
                kind="accepted" if candidate.accepted[j] else "rejected",
                round_index=round_.index,
                token_id=token,
                target_prob=candidate.target_probs[j],
                draft_prob=candidate.draft_probs[j],
                acceptance_prob=None if coupled else candidate.acceptance_probs[j],
                uniform=draw if tested and not coupled else None,
                plan=plan_text(round_),
                source=candidate.source,
                **(
                    _coupled_test(round_.coupled[j], draw, log_score(candidate.target_probs[j], draw), decode, context)
                    if coupled and tested
                    else {}
                ),
            )
            node = level.setdefault(token, _Node(span, [], {}))
            if not _was_tested(node.span) and _was_tested(span):
                node.span = span
            node.candidates.append(w)
            level, context = node.children, [*context, token]
    return roots


def log_score(target_prob: float, noise: float) -> float:
    """log p + G, the coupled rule's score of a token (−inf where p = 0: the target never picks it)."""
    return (math.log(target_prob) if target_prob > 0 else -math.inf) + noise


def _was_tested(span: TokenSpan) -> bool:
    return span.uniform is not None or span.noise is not None


def _branches_html(level: dict[int, _Node], path: int | None) -> str:
    """Sibling branches, the accepted path's first; each runs on until the tree branches again or ends."""
    items = []
    for node in sorted(level.values(), key=lambda node: path not in node.candidates):
        chain = [node]
        while (
            len(chain[-1].children) == 1 and chain[-1].candidates == next(iter(chain[-1].children.values())).candidates
        ):
            chain.append(next(iter(chain[-1].children.values())))
        last = chain[-1]
        on_path = path in node.candidates
        tokens = html_spans([n.span for n in chain], round_marks=False)
        if last.children:
            ends = [w for w in last.candidates if not any(w in child.candidates for child in last.children.values())]
            inner = _branches_html(last.children, path)
            ends_html = f"<ul>{_leaf_html('', ends, path)}</ul>" if ends else ""
            items.append(
                f'<li class="cand-branch{" cand-path" if on_path else ""}">{tokens}<ul>{inner}</ul>{ends_html}</li>'
            )
        else:
            items.append(_leaf_html(tokens, last.candidates, path))
    return "".join(items)


def _leaf_html(tokens: str, candidates: list[int], path: int | None) -> str:
    """Where candidates end: their numbers, and the accepted path marked."""
    numbers = [str(w + 1) for w in candidates]
    on_path = path in candidates
    plural = "s" if len(candidates) > 1 else ""
    mark = f"▶ accepted path {', '.join(numbers)}" if on_path else f"candidate{plural} {', '.join(numbers)}"
    return (
        f'<li class="cand{" cand-path" if on_path else ""}" data-candidates="{" ".join(numbers)}">{tokens}'
        f'<span class="cand-mark">{mark}</span></li>'
    )


def candidates_html(rounds: Sequence[Round], decode: Decode) -> str:
    """Each round's W candidates as a tree: a prefix they share is drawn once, branches indent under it, the accepted
    path comes first and is marked, a rejected or untested token is struck through, and every token carries its p, q,
    min(1, p/q) and u on hover (under the coupled rule, its noise G and log p + G). The latest rounds only."""
    emitted: list[int] = []
    blocks: list[str] = []
    first_shown = max(0, len(rounds) - MAX_CANDIDATE_ROUNDS)
    for number, round_ in enumerate(rounds):
        if number >= first_shown and round_.candidates:
            path = round_.path if round_.num_accepted > 0 else None
            tree = _branches_html(_candidate_tree(round_, decode, emitted), path)
            shared = f", shared by {round_.num_rows} rows" if round_.num_rows > 1 else ""
            next_span = _next_span(round_, decode, emitted + round_.draft_token_ids[: round_.num_accepted])
            then = f", then {next_span.kind} {html_spans([next_span], round_marks=False)}" if next_span else ""
            blocks.append(
                f'<div class="cand-round"><div class="cand-head">round {round_.index + 1}: '
                f'{round_.num_accepted} accepted{then}{shared}</div><ul class="cand-tree">{tree}</ul></div>'
            )
        emitted.extend(round_.emitted_token_ids)
    if not blocks:
        return '<p class="cand-empty">No round has drafted yet.</p>'
    skipped = f"<p>Rounds 1 to {first_shown} are in the trace.</p>" if first_shown else ""
    return skipped + "".join(blocks)


CANDIDATES_CSS = """
.cand-round { margin: 4px 0 8px; font-family: ui-monospace, SFMono-Regular, Menlo, monospace; font-size: 0.9em; }
.cand-head { opacity: .75; }
.cand-tree, .cand-tree ul { list-style: none; margin: 0; padding-left: 1.2em; }
.cand-tree li { white-space: pre-wrap; overflow-wrap: anywhere; }
.cand-tree ul { border-left: 1px solid rgba(128, 128, 128, .6); margin-left: 0.4em; }
.cand-path { font-weight: 600; }
.cand-path > .tok:first-child { box-shadow: -3px 0 0 rgba(34, 160, 80, .8); }
.cand-mark { margin-left: 0.8em; opacity: .7; font-weight: normal; font-size: 0.9em; }
"""


def lanes_html(prompts: Sequence[str], rounds: Sequence[Sequence[Round]], decode: Decode) -> str:
    """The batch view: one lane per prompt, its tokens in colour and its acceptance so far."""
    lanes = []
    for number, (prompt, lane_rounds) in enumerate(zip(prompts, rounds, strict=True), start=1):
        stats = run_stats(lane_rounds) if lane_rounds else None
        figures = (
            f"α {stats.alpha:.2f} · {stats.num_generated} tokens · {stats.mean_tokens_per_round:.2f} tokens/pass"
            if stats
            else "waiting"
        )
        title = html.escape(prompt if len(prompt) <= 80 else prompt[:79] + "…", quote=False)
        tokens = html_spans(token_spans(lane_rounds, decode))
        lanes.append(
            f'<div class="lane"><div class="lane-head"><b>{number}</b> {title} <span class="lane-figures">'
            f'{figures}</span></div><div class="tokens">{tokens}</div></div>'
        )
    return "".join(lanes)


LANES_CSS = """
.lane { border: 1px solid rgba(128, 128, 128, .35); border-radius: 6px; padding: 6px 8px; margin: 6px 0; }
.lane-head { font-size: 0.9em; margin-bottom: 4px; }
.lane-figures { float: right; opacity: .75; }
"""


def race_html(
    lanes: Sequence[LaneFigures], rounds: Sequence[Sequence[Round]], done: Sequence[bool], decode: Decode, goal: int
) -> str:
    """The race view: one lane per drafter (the target alone first), its tokens in colour, a bar of its tokens against
    `goal` (max new tokens), its target passes and its estimated seconds alone so far; a failed lane's sentence."""
    pieces = []
    for lane, lane_rounds, finished in zip(lanes, rounds, done, strict=True):
        tokens = len(lane.token_ids)
        state = "stopped" if lane.error else "finished" if finished else "racing"
        figures = (
            f"{tokens} / {goal} tokens · {lane.passes} target passes · ≈{lane.estimated_seconds:.2f} s alone · {state}"
        )
        width = 100.0 if finished and not lane.error else min(100.0, 100.0 * tokens / max(goal, 1))
        error = f'<div class="race-error">{html.escape(lane.error, quote=False)}</div>' if lane.error else ""
        pieces.append(
            f'<div class="lane race-lane race-{state}"><div class="lane-head"><b>{html.escape(lane.name)}</b> '
            f'<span class="lane-figures">{figures}</span></div>'
            f'<div class="race-bar" title="{tokens} of {goal} tokens"><div class="race-fill" style="width: '
            f'{width:.1f}%"></div></div><div class="tokens">{html_spans(token_spans(lane_rounds, decode))}</div>'
            f"{error}</div>"
        )
    return "".join(pieces)


RACE_CSS = """
.race-bar { height: 6px; border-radius: 3px; background-color: rgba(128, 128, 128, .2); margin: 2px 0 6px; }
.race-fill { height: 100%; border-radius: 3px; background-color: rgb(50, 120, 230); }
.race-stopped .race-fill { background-color: rgb(220, 50, 50); }
.race-error { margin-top: 4px; font-size: 0.9em; color: rgb(220, 50, 50); }
"""
THEME_CSS = TOKEN_CSS + CANDIDATES_CSS + LANES_CSS + RACE_CSS  # every token view's style: a run, candidates, lanes
