"""Where a coupled run's text parts from the target alone's, and why the page says it did: a near-tie of the top two
log p + G, a token one run's pass keeps and the other's cuts at top-k or top-p, or neither (worth reporting)."""

# T = context length, V = vocab_size

from __future__ import annotations

from dataclasses import replace

import torch

from specdemo.app.serving.divergence import divergence_of, replayed_logits
from specdemo.app.views.same_text import CutoffCrossing, Divergence, greedy_check
from specdemo.config import SamplingConfig
from specdemo.core.cutoff import CutoffPlace
from specdemo.core.rounds import Round
from specdemo.core.stats import emitted_ids
from tests.helpers import make_round, tiny_model

CHECK = "Same-text check (coupled rule, seed 5): the two texts **differ** from generated token 7 on"
WHERE = (
    f"{CHECK} (' word' speculative, ' other' target alone), where the target's top two scores log p + G are 0.416 "
    "apart (31.0% against 2.0%)"
)
BFLOAT16 = Divergence(7, " word", " other", 0.416, (0.31, 0.02), "bfloat16", 1.3, "top-k 50")  # allows 0.5 / 1.3
TOP_K_EDGE = CutoffCrossing(
    " word",
    "top-k",
    50,
    CutoffPlace(15.9375, 50, True, 15.9375, True),  # tied with the 50th logit: kept
    CutoffPlace(15.875, 53, False, 15.9375, False),  # one bfloat16 step lower: 53rd, cut
    1,
    17,
)


def test_a_token_at_the_top_k_edge_explains_a_gap_too_wide_for_a_near_tie():
    """The top two 0.416 apart, beyond bfloat16's allowance at T = 1.3 (0.385): no near-tie, yet the speculative run's
    token crossed top-k between the runs' passes, and the page says so rather than "worth reporting"."""
    assert greedy_check(False, replace(BFLOAT16, crossings=(TOP_K_EDGE,)), coupled_seed=5) == (
        f"{WHERE}: the texts differ at a top-k edge: in the target alone's one-token pass "
        "' word' has logit 15.94, rank 50 (the 50th logit is 15.94), so top-k 50 keeps it; in the speculative run's "
        "17-token pass it has logit 15.88, rank 53 (the 50th logit is 15.94), so top-k 50 cuts it: "
        "p = 0 there. In bfloat16 the two runs' passes (one token at a time; a round's drafts at once) round "
        "differently, and a token at the cut-off can fall on either side (docs/how-it-works.md)."
    )


def test_a_token_at_the_top_p_edge_is_told_by_the_mass_above_it():
    crossing = CutoffCrossing(
        " other",
        "top-p",
        0.9,
        CutoffPlace(3.1, 12, False, mass_above=0.90004),
        CutoffPlace(3.2, 12, True, mass_above=0.89991),
        1,
        5,
    )
    check = greedy_check(False, replace(BFLOAT16, cutoffs="top-p 0.9", crossings=(crossing,)), coupled_seed=5)
    assert check == (
        f"{WHERE}: the texts differ at a top-p edge: in the target alone's one-token pass ' other' has rank 12 with "
        "90.004% of p above it, so top-p 0.9 cuts it: p = 0 there; in the speculative run's 5-token pass "
        "it has rank 12 with 89.991% of p above it, so top-p 0.9 keeps it. In bfloat16 the two runs' passes (one token "
        "at a time; a round's drafts at once) round differently, and a token at the cut-off can fall on either side "
        "(docs/how-it-works.md)."
    )


def test_a_near_tie_and_an_unexplained_gap_are_told_apart_from_a_crossing():
    near = replace(BFLOAT16, top2_logit_gap=0.375)  # within bfloat16's 0.5 / 1.3, no token crossed top-k
    assert greedy_check(False, near, coupled_seed=5) == (
        f"{WHERE.replace('0.416', '0.375')}: in bfloat16, a K+1-token verification pass and one-token steps round "
        "differently, and at such a near-tie that can flip the largest log p + G."
    )
    assert greedy_check(False, BFLOAT16, coupled_seed=5) == (
        f"{WHERE}: too wide a gap for rounding to flip, and neither token crosses top-k 50 "
        "between the two runs' passes, so this is worth reporting, with the trace."
    )
    greedy = Divergence(7, " word", " other", 2.5, (0.31, 0.02), "bfloat16")  # no cut-off applies to an argmax
    assert greedy_check(False, greedy).endswith(
        "too wide a gap for rounding to flip, so this is worth reporting, with the trace."
    )


# --- end to end: a tiny model whose verification pass rounds one logit lower than its one-token pass ------------------

PROMPT = [0, 5, 9, 12, 7]
TOP_K = 5
FIRST = 3  # the generated token where the runs part


def decode(ids: list[int]) -> str:
    return "".join(f" t{i}" for i in ids)


def runs_parting_at_the_kth_token(model) -> tuple[list[Round], list[Round], int, int, float]:
    """A target-alone run whose 4th token is the target's k-th best there (top-k keeps it, just), and a speculative run
    that emitted its best instead, in a round that drafted three tokens after one token of its own; the k-th token,
    the best, and the amount that lowers the k-th below the (k+1)-th."""
    generated = [5, 9, 12]
    with torch.inference_mode():
        logits = model(torch.tensor([[*PROMPT, *generated]])).logits[0, -1]  # [V] after the shared prefix
    values, ids = logits.float().topk(TOP_K + 2)  # [k+2] each
    edge, best = int(ids[TOP_K - 1]), int(ids[0])
    below = float(values[TOP_K - 1] - values[TOP_K]) + float(values[TOP_K] - values[TOP_K + 1]) / 2  # to 6th place
    target_ids = [*generated, edge]
    baseline = [replace(make_round(i, [], 0, "bonus", 0.1), next_token_id=t) for i, t in enumerate(target_ids)]
    speculative = [
        replace(make_round(0, [], 0, "bonus", 0.1), next_token_id=generated[0]),
        replace(make_round(1, [*generated[1:], 3], 2, "resampled", 0.1), next_token_id=best),  # reads 1 + 3 tokens
    ]
    return speculative, baseline, edge, best, below


def lower_in_wide_passes(model, token_id: int, amount: float):
    """A verification pass that rounds `token_id`'s logit `amount` lower than a one-token step does: the bfloat16
    effect, planted in a float64 model whose two pass shapes otherwise agree to ~1e-15."""

    def hook(module, args, kwargs, output):
        if kwargs["input_ids"].shape[1] > 1:  # [1, n] tokens fed: more than one, a prompt or a verification pass
            output.logits[..., token_id] -= amount
        return output

    return model.register_forward_hook(hook, with_kwargs=True)


def test_divergence_finds_the_token_the_verification_pass_cut_at_top_k():
    model = tiny_model(1)
    speculative, baseline, edge, best, below = runs_parting_at_the_kth_token(model)
    sampling = SamplingConfig(temperature=1.0, top_k=TOP_K, seed=5, rule="coupled")
    handle = lower_in_wide_passes(model, edge, below)
    try:
        found = divergence_of(model, PROMPT, speculative, baseline, sampling, decode)
    finally:
        handle.remove()
    assert (found.position, found.speculative_text, found.target_text) == (4, f" t{best}", f" t{edge}")
    assert found.cutoffs == "top-k 5" and len(found.crossings) == 1, found.crossings
    [crossing] = found.crossings
    assert (crossing.token_text, crossing.cutoff, crossing.limit) == (f" t{edge}", "top-k", TOP_K)
    assert (crossing.one_token_width, crossing.wide_width) == (1, 4)  # a one-token step; the round's token + 3 drafts
    one, wide = crossing.one_token, crossing.wide
    assert (one.rank, one.inside_top_k, one.kept) == (TOP_K, True, True)
    assert (wide.rank, wide.inside_top_k, wide.kept) == (TOP_K + 1, False, False)
    assert abs((one.logit - wide.logit) - below) < 1e-5  # float32 scores of a float64 model
    assert "the texts differ at a top-k edge: in the target alone's one-token pass" in greedy_check(False, found, 5)

    unhooked = divergence_of(model, PROMPT, speculative, baseline, sampling, decode)  # both shapes agree: no crossing
    assert unhooked.crossings == () and unhooked.top2_logit_gap == found.top2_logit_gap
    assert "neither token crosses top-k 5 between the two runs' passes" in greedy_check(False, unhooked, 5)


def test_the_passes_are_replayed_so_the_cache_holds_what_the_rounds_left_there():
    """The speculative run's keys and values for its accepted drafts came from its 4-token verification pass; a token
    it emits later, in a one-token step, reads them. Planted: that pass's first layer is off by 1e-3. The replay sees
    it at the later token; a prefix read in one pass (or the target alone's steps) would not."""
    model = tiny_model(1)
    _, baseline, _, best, _ = runs_parting_at_the_kth_token(model)
    generated = emitted_ids(baseline)[:FIRST]
    speculative = [  # a round accepts one of three drafts and resamples the next; a plain step then differs
        replace(make_round(0, [], 0, "bonus", 0.1), next_token_id=generated[0]),
        replace(make_round(1, [generated[1], 3, 4], 1, "resampled", 0.1), next_token_id=generated[2]),
        replace(make_round(2, [], 0, "bonus", 0.1), next_token_id=best),
    ]
    assert emitted_ids(speculative)[:FIRST] == generated

    def off_in_verification(module, args, output):
        if args[0].shape[1] == 4:  # [1, n, H]: the round's pass, its token and three drafts
            output += 1e-3
        return output

    alone, alone_width = replayed_logits(model, PROMPT, baseline, FIRST)  # [V]
    handle = model.model.layers[0].register_forward_hook(off_in_verification)
    try:
        replayed, width = replayed_logits(model, PROMPT, speculative, FIRST)  # [V]
    finally:
        handle.remove()
    assert (alone_width, width) == (1, 1)  # both emitted it in a one-token step
    assert (replayed - alone).abs().max() > 1e-6  # what the verification pass left in the cache
    assert torch.allclose(replayed_logits(model, PROMPT, speculative, FIRST)[0], alone, atol=1e-12)  # not planted


def test_a_near_tie_the_two_passes_order_oppositely_is_told_with_both_leads():
    """The replay shows each run's pass choosing its own run's token: the page names both leads and both pass widths,
    whatever the allowance (planted: leads ignored, and 0.416 reads as worth reporting)."""
    swapped = replace(BFLOAT16, leads=(0.0176, 0.0123, 1, 13))
    assert greedy_check(False, swapped, coupled_seed=5) == (
        f"{CHECK}, at a near-tie that the two runs' passes round to opposite orders: in the target alone's one-token "
        "pass ' other' leads ' word' by 0.0176 in scores log p + G, and in the speculative run's 13-token pass "
        "' word' leads by 0.0123. In bfloat16 passes of other widths round a token's keys and values differently, "
        "so such a near-tie can go either way (docs/how-it-works.md)."
    )
    same_order = replace(BFLOAT16, leads=(0.3, -0.3, 1, 13))  # the replay did not part: no swap seen
    assert "worth reporting" in greedy_check(False, same_order, coupled_seed=5)
