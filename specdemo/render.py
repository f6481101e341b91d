"""Pure: rounds -> token spans with their outcome and numbers, and their coloured terminal rendering."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from specdemo.decoding import Round

Kind = Literal["accepted", "rejected", "resampled", "bonus"]
Decode = Callable[
    [list[int]], str
]  # token ids -> text, e.g. functools.partial(tokenizer.decode, skip_special_tokens=False)

CONTEXT_TOKENS = 8  # a token's text is decoded after this many earlier tokens, so leading spaces survive


@dataclass(frozen=True)
class TokenSpan:
    """One token as the reader sees it: its text, what happened to it, and the numbers that decided it."""

    text: str
    kind: Kind
    round_index: int
    token_id: int
    target_prob: float | None  # p of this token at its position
    draft_prob: float | None  # q of this token (draft tokens only)
    acceptance_prob: float | None  # min(1, p/q) (draft tokens only)
    uniform: float | None  # the draw u it was tested with; None for drafts discarded after an earlier rejection


def token_text(decode: Decode, context_ids: Sequence[int], token_id: int) -> str:
    """The text a token adds after its context (decoding a lone token loses the spaces some tokenizers merge)."""
    context = list(context_ids[-CONTEXT_TOKENS:])
    return decode([*context, token_id])[len(decode(context)) :]


def token_spans(rounds: Sequence[Round], decode: Decode) -> list[TokenSpan]:
    """Every accepted, rejected, resampled and bonus token, in the order they were proposed or emitted."""
    emitted: list[int] = []
    spans: list[TokenSpan] = []
    for round_ in rounds:
        refused: list[int] = []  # rejected drafts of this round, decoded after each other where they were proposed
        for position, token in enumerate(round_.draft_token_ids):
            accepted = position < round_.num_accepted
            tested = position <= round_.num_accepted and position < len(round_.uniforms)
            context = emitted + refused
            spans.append(
                TokenSpan(
                    text=token_text(decode, context, token),
                    kind="accepted" if accepted else "rejected",
                    round_index=round_.index,
                    token_id=token,
                    target_prob=round_.target_probs[position],
                    draft_prob=round_.draft_probs[position],
                    acceptance_prob=round_.acceptance_probs[position],
                    uniform=round_.uniforms[position] if tested else None,
                )
            )
            (emitted if accepted else refused).append(token)
        if round_.next_token_id is not None and round_.next_kind is not None:
            spans.append(
                TokenSpan(
                    text=token_text(decode, emitted, round_.next_token_id),
                    kind=round_.next_kind,
                    round_index=round_.index,
                    token_id=round_.next_token_id,
                    target_prob=round_.next_token_prob,
                    draft_prob=None,
                    acceptance_prob=None,
                    uniform=None,
                )
            )
            emitted.append(round_.next_token_id)
    return spans


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
