"""Pure: the run's summary in Markdown, the speedup explained with measured parts only, and the notes on shared
passes and cut drafts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specdemo.app.views.same_text import Divergence, greedy_check
from specdemo.core.rounds import CoupledChoice, Round
from specdemo.core.stats import Comparison, RunStats


def _row(label: str, stats: RunStats) -> str:
    return (
        f"| {label} | {stats.num_generated} | {stats.wall_seconds:.2f} | {stats.tokens_per_second:.1f} | "
        f"{stats.num_target_forwards} |"
    )


LARGE_PREDICTION_ERROR = 0.10  # beyond this the summary says why Leviathan's prediction missed


def alpha_line(spec: RunStats) -> str:
    """α (tested drafts), vLLM's acceptance rate (all drafts), α by position, and the rounds that proposed nothing."""
    by_position = " · ".join(f"{alpha:.2f}" for alpha in spec.alpha_by_position) or "none tested"
    if spec.tested_by_position:
        by_position += f" (tested {' · '.join(str(n) for n in spec.tested_by_position)} times)"
    return (
        f"**α = {spec.alpha:.2f}**: {spec.num_accepted} of {spec.num_tested} tested drafts accepted "
        f"(acceptance rate, accepted ÷ all {spec.num_drafted} drafted: {spec.acceptance_rate:.2f}) · α by draft "
        f"position: {by_position} · {spec.mean_tokens_per_round:.2f} tokens per target pass · "
        f"{spec.no_proposal_share:.0%} of rounds proposed nothing · {spec.overhead_fraction:.1%} of the time outside "
        "model passes"
    )


def why_prediction_missed(spec: RunStats, comparison: Comparison) -> str:
    """One sentence on why the independence model is off, read from the per-position α curve."""
    alphas = [a for a, n in zip(spec.alpha_by_position, spec.tested_by_position, strict=True) if n]
    direction = "under" if comparison.prediction_error < 0 else "over"
    if len(alphas) >= 2 and alphas[-1] - alphas[0] > 0.1:
        return (
            f"acceptance is not independent: α rises from {alphas[0]:.2f} at position 1 to {alphas[-1]:.2f} at "
            f"position {len(alphas)}, because a draft that starts matching (a copied passage) tends to go on, so "
            f"the model {direction}-predicts."
        )
    if len(alphas) >= 2 and alphas[0] - alphas[-1] > 0.1:
        return (
            f"α falls from {alphas[0]:.2f} at position 1 to {alphas[-1]:.2f} at position {len(alphas)}: later "
            f"drafts stray further from the target, so the model {direction}-predicts."
        )
    return (
        f"α varies from round to round (passages the drafter gets right, others it does not), and one average α "
        f"hides that, so the model {direction}-predicts."
    )


def explanation(spec: RunStats, c: Comparison, num_draft_tokens: int) -> list[str]:
    """The speedup as measured parts, Leviathan's prediction beside it, and the best number of drafts."""
    rounds = dict(c.verify_rounds_by_k)
    costs = (
        ", ".join(f"v({k}) = {v:.2f} ({rounds[k]} round{'s' * (rounds[k] != 1)})" for k, v in c.verify_cost_by_k)
        or "no drafts were verified"
    )
    lines = [
        (
            f"**Speedup {c.speedup:.2f}×** = {c.tokens_per_pass:.2f} tokens per target pass ÷ {c.round_cost:.2f} "
            f"target steps per round (draft {c.draft_cost:.2f} + verify {c.verify_cost:.2f} + other "
            f"{c.other_cost:.2f}; a target step is the target alone's time per token). A pass over k drafts costs "
            f"v(k) one-token steps: {costs}."
        ),
        "",
        (
            f"**Leviathan's prediction**, each draft accepted independently with α = {spec.alpha:.2f}, for the "
            f"proposal lengths that occurred: {c.predicted_tokens_per_pass:.2f} tokens per pass, so "
            f"{c.predicted_speedup:.2f}× ({c.prediction_error:+.0%} against the measurement)."
        ),
    ]
    if abs(c.prediction_error) > LARGE_PREDICTION_ERROR:
        lines[-1] += " It misses because " + why_prediction_missed(spec, c)
    lines += [
        "",
        (
            f"**Best γ** for the measured α curve and costs: {c.best_num_draft_tokens} (about {c.best_speedup:.2f}×; "
            f"this run used {num_draft_tokens})."
        ),
    ]
    return lines


@dataclass(frozen=True)
class CoupledChances:
    """The coupled rule's theory beside its measurement, over the tested drafted positions of a run's paths."""

    num_tested: int  # drafted positions the target's token was compared with
    num_matched: int  # those where a candidate was the target's token (the path's, accepted)
    coupled_low: float  # the mean chance the coupled rule predicts from each position's p and q that one of the
    coupled_high: float  # candidates tested there matches, bounded
    standard: float  # the mean chance the standard rule accepts one candidate drafted from q there: 1 - TV(p, q)
    most_alive: int = 1  # the most candidates tested at one position; above 1 the chances are per position, not draft


def coupled_chances(rounds: Sequence[Round]) -> CoupledChances | None:
    """Theory and measurement from the rounds' coupled choices (None without a tested drafted position: a standard
    run, a greedy one, or one that drafted nothing)."""
    tested: list[CoupledChoice] = [c for r in rounds for c in r.coupled if c.draft_id is not None]
    if not tested:
        return None

    chances = [(c.coupled_chance, c.coupled_chance_high, c.standard_chance) for c in tested]
    assert all(None not in row for row in chances), f"a drafted position without its chances: {chances}"
    low, high, standard = (sum(column) / len(tested) for column in zip(*chances, strict=True))  # type: ignore[arg-type]
    matched = sum(c.draft_id == c.target_id for c in tested)  # the path's token is y where any candidate's was
    return CoupledChances(len(tested), matched, low, high, standard, max(c.num_alive for c in tested))


def chances_line(chances: CoupledChances) -> str:
    """The match chance the coupled rule predicts from the run's own p and q, the standard rule's 1 − TV beside it,
    and the share of drafts that matched; with several candidates at a position, the chance and the share that one of
    them matched."""
    c = chances
    low, high, standard = f"{c.coupled_low:.0%}", f"{c.coupled_high:.0%}", f"{c.standard:.0%}"
    predicted = low if low == high else f"{low} to {high}"  # one number where the bounds meet (a fixed draft)
    if c.most_alive > 1:
        return (
            f"**Theory beside measurement**: from this run's own p and q at its {c.num_tested} tested positions, the "
            f"coupled rule predicts that at least one of the candidates tested at a position (those still on the path, "
            f"up to {c.most_alive}) matches the target's token {predicted} of the time; measured: one matched at "
            f"{c.num_matched} of {c.num_tested} positions ({c.num_matched / c.num_tested:.0%}). The standard rule "
            f"would accept one candidate drafted from q {standard} of the time (1 − TV, per candidate)."
        )
    agree = "; the two agree where the drafter proposes fixed tokens" if predicted == standard else ""
    return (
        f"**Theory beside measurement**: from this run's own p and q at its {c.num_tested} tested drafts, the coupled "
        f"rule predicts a draft matches the target's token {predicted} of the time (the standard rule would accept "
        f"{standard}, 1 − TV{agree}); measured: {c.num_matched} of {c.num_tested} matched "
        f"({c.num_matched / c.num_tested:.0%})."
    )


def plan_line(planned: float, comparison: Comparison | None) -> str:
    """What a cost-aware drafter expected of the run, against what was measured when the target alone ran too."""
    line = (
        "**Cost-aware drafting**: each round drafted only as much as this machine's measured pass costs say pays, "
        f"and nothing when drafting was expected to lose (hover a token for its round's choice). The plans expected "
        f"{planned:.2f}× the target alone, the prompt's pass counted as measured (both runs read it)"
    )
    if comparison is None:
        return line + "."
    return line + f"; measured {comparison.speedup:.2f}× (the plans {planned / comparison.speedup - 1:+.0%})."


HEADLINE_CSS = """
.headline { display: flex; flex-wrap: wrap; gap: 0.5em 2.5em; margin: 0.3em 0; }
.headline .big { font-size: 2.4em; font-weight: 700; line-height: 1.1; }
.headline .cap { font-size: 0.9em; opacity: .75; }
"""


def headline_html(spec: RunStats | None, comparison: Comparison | None, why_no_speedup: str = "") -> str:
    """The three numbers a run leads with: the speedup over the target alone (once it ran; else why not), tokens per
    target pass, and α. The summary beneath explains them."""
    if spec is None:
        return ""
    if comparison is not None:
        speed, speed_caption = f"{comparison.speedup:.2f}×", "speedup over the target alone"
    else:
        speed, speed_caption = "…" if not why_no_speedup else "—", why_no_speedup or "speedup: after the target alone"
    numbers = (
        (speed, speed_caption),
        (f"{spec.mean_tokens_per_round:.2f}", "tokens per target pass"),
        (f"{spec.alpha:.2f}", "α: share of tested drafts accepted"),
    )
    cells = "".join(f'<div><div class="big">{big}</div><div class="cap">{cap}</div></div>' for big, cap in numbers)
    return f'<div class="headline">{cells}</div>'


FOLD_TITLE = "The numbers behind them: each run's tokens, time and passes, α by position, the speedup's parts"


def summary_markdown(
    spec: RunStats,
    num_draft_tokens: int,
    baseline: RunStats | None = None,
    comparison: Comparison | None = None,
    draft_alone: RunStats | None = None,
    greedy: bool = False,
    number_format: str | None = None,
    divergence: Divergence | None = None,
    coupled_seed: int | None = None,
    chances: CoupledChances | None = None,
) -> str:
    """What a run's summary says under its three big numbers: for greedy runs, and sampled runs under the coupled rule
    (`coupled_seed`: their seed), whether the texts are identical (else where they part: `divergence`), and why
    speculation lost when it did; folded beneath, one click away, the run in numbers, the coupled rule's predicted
    match chance beside the measured one (`chances`), its number format (e.g. "float32 (auto: this CPU has no native
    bfloat16)") and, with a baseline, the speedup explained with the prediction beside it."""
    lines = [
        "| run | tokens | seconds | tokens/s | model passes |",
        "|---|---|---|---|---|",
        _row("speculative", spec),
    ]
    if baseline is not None:
        lines.append(_row("target alone", baseline))
    if draft_alone is not None:
        lines.append(_row("draft alone", draft_alone))
    lines += ["", alpha_line(spec)]
    if chances is not None:
        lines += ["", chances_line(chances)]
    if spec.planned_speedup is not None:
        lines += ["", plan_line(spec.planned_speedup, comparison)]
    if number_format:
        lines += ["", f"Number format: {number_format}."]
    if comparison is None:
        return folded([], lines)
    c = comparison
    lines += ["", *explanation(spec, c, num_draft_tokens)]
    checked = greedy or coupled_seed is not None  # the text must be the target alone's, token for token
    lead = [greedy_check(c.identical, divergence, coupled_seed)] if checked else []
    if c.speedup < 1.0:
        slowest = max((v for _, v in c.verify_cost_by_k), default=1.0)
        lead.append(
            "Speculation was slower here: "
            f"{c.tokens_per_pass:.2f} tokens per pass did not pay for {c.round_cost:.2f} steps per round"
            + (f" (α = {spec.alpha:.2f} is low)" if spec.alpha < 0.5 else "")
            + f"; on this device a verification pass costs up to {slowest:.2f}× a one-token step."
        )
    return folded(lead, lines)


def folded(lead: list[str], details: list[str]) -> str:
    """`lead`'s paragraphs, then `details` folded under one line (HTML details, which the page's Markdown keeps)."""
    fold = f'<details class="numbers"><summary>{FOLD_TITLE}</summary>\n\n' + "\n".join(details) + "\n\n</details>"
    return "\n\n".join([*lead, fold])


def sharing_note(speculative: Sequence[Round], baseline: Sequence[Round]) -> str | None:
    """Why no speedup is shown when either run shared its passes with other runs (None when both ran alone)."""
    shared = [r.num_rows for r in speculative if r.num_rows > 1]
    shared_baseline = [r.num_rows for r in baseline if r.num_rows > 1]
    if not shared and not shared_baseline:
        return None
    return (
        f"**No speedup shown:** {len(shared)} of {len(speculative)} speculative rounds and {len(shared_baseline)} "
        f"of {len(baseline)} target-alone rounds shared their model pass with other runs (up to "
        f"{max(shared + shared_baseline)} rows), so their times include other people's work and do not compare. "
        "Tokens per pass and α are your run's own; run again when the app is quiet for a fair speedup."
    )


def cut_note(rounds: Sequence[Round], greedy: bool, coupled: bool = False) -> str | None:
    """What cutting drafts for shared passes did to the run (None when no round was cut); `coupled`: a sampled run
    under the coupled rule, whose tokens are the same as alone."""
    cut = [r for r in rounds if r.cut]
    if not cut:
        return None
    same = (
        "a greedy run's are the same as alone"
        if greedy
        else "under the coupled rule, a sampled run's are the same as alone"
        if coupled
        else "a sampled run's are another draw of the same distribution than its seed gives alone"
    )
    return (
        f"**Drafts cut for shared passes:** in {len(cut)} of {len(rounds)} rounds your run shared its pass with up to "
        f"{max(r.cut.num_rows for r in cut)} rows and drafted less than it could, because every row of a pass is "
        f"padded to the widest (hover a token for its round's cut). The tokens still follow the target exactly; {same}."
    )
