"""Pure: one plain sentence per round, for stepping through a run in front of an audience: what was proposed, what the
target accepted and why, where it refused and what it drew instead (under the coupled rule, the target's choice and the
noise that made it)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from specdemo.app.views.render import Decode, token_text
from specdemo.core.rounds import CoupledChoice, Round

NUMBER_WORDS = ("no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")


def _count(n: int, noun: str) -> str:
    word = NUMBER_WORDS[n] if n < len(NUMBER_WORDS) else str(n)
    return f"{word} {noun}{'s' if n != 1 else ''}"


def _listing(items: Sequence[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _why_accepted(acceptance_prob: float, uniform: float) -> str:
    return "p ≥ q" if acceptance_prob >= 1.0 else f"u = {uniform:.2f} < p/q = {acceptance_prob:.2f}"


def round_sentence(round_: Round, decode: Decode, context_ids: Sequence[int], greedy: bool = False) -> str:
    """What happened in `round_`, decoded after `context_ids` (the prompt's tail and the tokens emitted before it), e.g.
    "The draft proposed 5 tokens. The target accepted ' the' and ' cat' (p ≥ q), rejected ' sat' (p/q = 0.21 <
    u = 0.64), and drew ' ran' from what the draft under-weighted, max(0, p − q)." p and q are the target's and the
    draft's probabilities of a drafted token; a token is accepted when u < min(1, p/q). A `greedy` run's tests compare
    each draft with the target's argmax; a coupled round (`Round.coupled`) compares each with the target's choice,
    the token with the largest log p + G under the position's noise G."""
    context = list(context_ids)
    drafted = round_.draft_token_ids
    texts = []
    for token in drafted:
        texts.append(repr(token_text(decode, context, token)))
        context.append(token)
    if round_.coupled:
        return _coupled_sentence(round_, decode, list(context_ids), texts)
    accepted = [
        f"{texts[i]} ({'its argmax' if greedy else _why_accepted(round_.acceptance_probs[i], round_.uniforms[i])})"
        for i in range(round_.num_accepted)
    ]
    next_text = None
    if round_.next_token_id is not None:
        next_text = repr(token_text(decode, [*context_ids, *drafted[: round_.num_accepted]], round_.next_token_id))
    if not drafted:
        return _plain_step(round_, next_text, greedy)
    proposed = _proposed(round_)
    parts = []
    if accepted:
        parts.append(f"accepted {_listing(accepted)}")
    if round_.num_accepted < len(drafted):
        i = round_.num_accepted
        p, ratio, u = round_.target_probs[i], round_.acceptance_probs[i], round_.uniforms[i]
        why = "p = 0: the target would never pick it" if p == 0 else f"p/q = {ratio:.2f} < u = {u:.2f}"
        parts.append(f"rejected {texts[i]} ({'not its argmax' if greedy else why})")
        untested = len(drafted) - i - 1
        if next_text:
            parts.append(
                f"took its argmax {next_text} instead"
                if greedy
                else f"drew {next_text} from what the draft under-weighted, max(0, p − q)"
            )
        return f"{proposed} The target {_listing(parts)}.{_untested(untested)}"
    if next_text is None:
        return f"{proposed} The target {_listing(parts)}, and the run ended at the end-of-text token."
    everything = "all of them" if len(drafted) > 1 else "it"
    return (
        f"{proposed} The target accepted {everything}: {_listing(accepted)}, and the same pass gave the bonus token "
        f"{next_text}{', its argmax' if greedy else ' from its own p'}."
    )


def _untested(untested: int) -> str:
    """' The two drafts after it were never tested.' ('' when none were left)."""
    if not untested:
        return ""
    return f" The {_count(untested, 'draft')} after it {'was' if untested == 1 else 'were'} never tested."


def _number(value: float) -> str:
    """A score for prose: two decimals and a true minus sign; log 0 is −∞."""
    return "−∞" if value == -math.inf else f"{value:.2f}".replace("-", "−")


def _target_choice(choice: CoupledChoice) -> str:
    return f"log p + G = {_number(choice.target_score)}, its noise G = {_number(choice.target_noise)}"


def _matched(accepted: Sequence[str]) -> str:
    """'' the', which matched the target's choice' or '' the' and ' cat', each of which matched the target's choice'."""
    return f"{_listing(accepted)}, {'which' if len(accepted) == 1 else 'each of which'} matched the target's choice"


def _coupled_sentence(round_: Round, decode: Decode, context_ids: list[int], texts: list[str]) -> str:
    """A coupled round: each draft token is accepted while it is the target's choice y = argmax(log p + G); at the first
    that is not, y is emitted instead (after a fully accepted draft, y at the next position is the bonus)."""
    drafted, accepted = round_.draft_token_ids, texts[: round_.num_accepted]
    choice = round_.coupled[round_.num_accepted]
    chosen = repr(token_text(decode, [*context_ids, *drafted[: round_.num_accepted]], choice.target_id))
    if not drafted:
        took = f": its choice {chosen} ({_target_choice(choice)})" if round_.next_token_id is not None else ""
        return f"{_nothing_drafted(round_)} The target took one plain step{took or ', and the run ended'}."
    proposed = _proposed(round_)
    if round_.num_accepted < len(drafted):
        assert choice.draft_score is not None, f"a rejected draft has its score: {choice}"
        before = f" The target accepted {_matched(accepted)}." if accepted else ""
        where = "at the next position" if accepted else "at the first position"
        return (
            f"{proposed}{before} The target's choice {where} is {chosen} ({_target_choice(choice)}); the draft "
            f"proposed {texts[round_.num_accepted]} (log p + G = {_number(choice.draft_score)}), so the draft stops "
            f"here and the target's choice is emitted.{_untested(len(drafted) - round_.num_accepted - 1)}"
        )
    if round_.next_token_id is None:
        return f"{proposed} The target accepted {_matched(accepted)}, and the run ended at the end-of-text token."
    everything = "all of them" if len(drafted) > 1 else "it"
    return (
        f"{proposed} The target accepted {everything}: {_matched(accepted)}; the same pass gave the bonus token "
        f"{chosen} ({_target_choice(choice)}), the target's choice at the next position."
    )


def _nothing_drafted(round_: Round) -> str:
    """Why a round drafted nothing: the drafter had nothing, or expected drafting to lose."""
    offered = round_.plan.available_tokens if round_.plan is not None else 0
    if offered:
        return (
            f"The drafter had {_count(offered, 'token')} to offer but expected drafting to lose here, so nothing was "
            "drafted."
        )
    return "Nothing was drafted: the drafter had nothing to propose."


def _plain_step(round_: Round, next_text: str | None, greedy: bool) -> str:
    """A round that drafted nothing: why, and the target's one step."""
    drew = f": its argmax {next_text}" if greedy else f" and drew {next_text} from its own p"
    took = drew if next_text else ", and the run ended"
    return f"{_nothing_drafted(round_)} The target took one plain step{took}."


def _proposed(round_: Round) -> str:
    """The round's first sentence: how many tokens the draft proposed, and with W > 1 which candidate was followed."""
    drafted, width = round_.draft_token_ids, len(round_.candidates)
    if width > 1:
        return (
            f"The drafter proposed {_count(width, 'candidate')}; the target followed candidate {round_.path + 1}, "
            f"which proposed {_count(len(drafted), 'token')}."
        )
    return f"The draft proposed {_count(len(drafted), 'token')}."


def round_sentences(rounds: Sequence[Round], decode: Decode, prompt_ids: Sequence[int]) -> list[str]:
    """Every round's sentence, each decoded after what came before it."""
    sentences, context = [], list(prompt_ids)
    for round_ in rounds:
        sentences.append(round_sentence(round_, decode, context))
        context.extend(round_.emitted_token_ids)
    return sentences
