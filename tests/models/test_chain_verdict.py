"""The GPU's round program decides what the eager rule decides: the same logits through the program's rule (the input
buffer a group's round reads, models/fixed_pass.round_rule, then core/chain_round.chain_verdict) and through
core/eager_round.decide_rows give each row the same verdict, field by field, for standard and coupled rows, greedy and
sampled, side by side in one group. Pure: logits made up, no model."""

# R = PASS_ROWS chain rows, n = PASS_COLUMNS, K = a row's drafted tokens, V = vocab_size

from __future__ import annotations

import math
from dataclasses import fields, replace
from types import SimpleNamespace

import numpy as np
import torch

from specdemo.config import SamplingConfig
from specdemo.core.chain_round import chain_verdict, packed_columns
from specdemo.core.eager_round import decide_rows
from specdemo.core.fixed_rule import DRAWS_PER_ROUND
from specdemo.core.rules import rule_for
from specdemo.core.verdicts import RoundAsk, RowVerdict
from specdemo.models.fixed_pass import PASS_COLUMNS, round_rule, staging_for, write_row, write_tree

VOCAB = 40
PEAKED = 6.0  # added to a drafted token's logit at the positions the test wants it likely


def ask(
    sampling: SamplingConfig,
    trunk: list[int],
    draft: list[int] | None,
    seed: int,
    draft_probs: torch.Tensor | None = None,  # [1, K, V]
) -> RoundAsk:
    return RoundAsk(
        trunk_ids=trunk,
        candidates=[] if draft is None else [draft],
        capacity=64,
        sampling=sampling,
        rule=rule_for(sampling),
        seed=seed,
        draws=DRAWS_PER_ROUND * seed,  # some rounds in
        round_index=seed,
        draft_probs=draft_probs,
        views=True,
        sources=("copy",) if draft else (),
        eos_token_ids=frozenset({39}),
    )


def sampled_draft(generator: torch.Generator, length: int) -> tuple[list[int], torch.Tensor]:
    """A sampling drafter's candidate and its q: [1, K, V]."""
    probs = torch.softmax(torch.randn(1, length, VOCAB, generator=generator, dtype=torch.float64), -1).float()
    tokens = torch.multinomial(probs[0], 1, generator=generator)[:, 0].tolist()
    return tokens, probs


def rows() -> list[RoundAsk]:
    """One group: greedy and sampled rows under both rules, with a penalty, top-k and top-p, a sampling drafter's q,
    nothing drafted, a draft that ends in an EOS, a sixteen-token draft."""
    generator = torch.Generator().manual_seed(0)
    trunk = [3, 17, 5, 22, 9, 30]
    tokens, probs = sampled_draft(generator, 5)
    coupled = dict(rule="coupled")
    return [
        ask(SamplingConfig(), trunk, [4, 8, 15], 1),
        ask(SamplingConfig(temperature=0.8, top_p=0.9, repetition_penalty=1.2, seed=7), trunk, [4, 8, 15, 16], 2),
        ask(SamplingConfig(temperature=0.8, top_p=0.9, repetition_penalty=1.2, seed=7, **coupled), trunk, [4, 8, 9], 3),
        ask(SamplingConfig(temperature=1.0, top_k=6, **coupled), trunk[:4], None, 4),
        ask(SamplingConfig(temperature=1.0, **coupled), trunk, tokens, 5, probs),
        ask(SamplingConfig(temperature=0.7, **coupled), trunk[:2], [11, 39], 6),
        ask(SamplingConfig(temperature=0.5, **coupled), trunk, list(range(10, 26)), 7),
        ask(SamplingConfig(temperature=1.0), trunk, tokens[:3], 8, probs[:, :3]),
    ]


def logits_for(asks: list[RoundAsk]) -> torch.Tensor:  # [R, n, V] float32
    """Random logits, with each drafted token made likely at its first positions, so rows accept some and then stop."""
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(len(asks), PASS_COLUMNS, VOCAB, generator=generator)
    for r, row in enumerate(asks):
        for j, token in enumerate(row.candidates[0] if row.candidates else []):
            logits[r, j, token] += PEAKED if j < 3 else 0.0
    return logits


def program_verdicts(asks: list[RoundAsk], logits: torch.Tensor) -> list:
    """The round program's rule on `logits` from the input buffer its rows write, each row's verdict read back."""
    device = logits.device
    staging = staging_for(SimpleNamespace(slots=256), packed_columns(PASS_COLUMNS), torch.device("cpu"))
    staging.write[:] = staging.blank
    for r, row in enumerate(asks):
        write_row(staging.write[r], row)
    seen = torch.zeros(len(asks), VOCAB, dtype=torch.bool, device=device)  # [R, V]
    given = torch.zeros(len(asks), PASS_COLUMNS - 1, VOCAB, device=device)  # [R, K, V]
    for r, row in enumerate(asks):
        seen[r, row.trunk_ids] = True
        if row.draft_probs is not None:
            given[r, : len(row.candidates[0])] = row.draft_probs[0].to(device)
    packed, _, _ = round_rule(True, True, True, 1, staging.inputs.to(device), logits, seen, given, None)
    return [chain_verdict(row_packed, row) for row_packed, row in zip(packed.cpu().numpy(), asks, strict=True)]


def verdicts(device: torch.device) -> tuple[list[RoundAsk], list, list]:
    """The group's asks, and each row's verdict from the program and from decide_rows, on `device`."""
    asks = rows()
    logits = logits_for(asks).to(device)
    verified = [logits[r : r + 1, : len(row.candidates[0]) + 1 if row.candidates else 1] for r, row in enumerate(asks)]
    return asks, program_verdicts(asks, logits), decide_rows(asks, verified)


def assert_same(program: object, eager: object, where: str) -> None:
    """Equal, field by field: ints, bools, ids and None exactly, floats within 1e-6 relative (kernels of other
    shapes sum in other orders)."""
    if isinstance(eager, float):
        assert isinstance(program, float) and math.isclose(program, eager, rel_tol=1e-6, abs_tol=1e-9), (
            where,
            program,
            eager,
        )
    elif isinstance(eager, list | tuple):
        assert isinstance(program, list | tuple) and len(program) == len(eager), (where, program, eager)
        for i, (mine, theirs) in enumerate(zip(program, eager, strict=True)):
            assert_same(mine, theirs, f"{where}[{i}]")
    elif hasattr(eager, "__dataclass_fields__"):
        assert type(program) is type(eager), (where, program, eager)
        for field in fields(eager):
            assert_same(getattr(program, field.name), getattr(eager, field.name), f"{where}.{field.name}")
    else:
        assert program == eager, (where, program, eager)


def test_the_round_programs_verdict_is_the_eager_rules() -> None:
    """Eight rows in one group, standard and coupled, greedy and sampled: each row's verdict from the program equals
    decide_rows' on the same logits, its candidate's trace, path, accepted count, next token, views and coupled
    choices; the coupled rows emit the Gumbel-max token and some accept several tokens. Planted: the coupled rows'
    noise read one position early (models/fixed_pass._coupled_rows without the + 1); the views' residual left as
    norm(max(0, p - q)) for coupled rows (chain_round._view_entries)."""
    asks, program, eager = verdicts(torch.device("cpu"))
    assert all(isinstance(verdict, RowVerdict) for verdict in eager), eager
    for r, (mine, theirs) in enumerate(zip(program, eager, strict=True)):
        assert_same(mine, theirs, f"row {r}")
    coupled = [verdict for verdict, row in zip(eager, asks, strict=True) if row.sampling.is_coupled]
    assert all(verdict.choices for verdict in coupled)
    assert max(verdict.num_accepted for verdict in coupled) >= 2
    assert {verdict.num_accepted for verdict in eager} != {0}


def tree_ask(
    sampling: SamplingConfig,
    trunk: list[int],
    candidates: list[list[int]],
    seed: int,
    draft_probs: torch.Tensor | None = None,  # [W, K, V]
) -> RoundAsk:
    """A row of several candidates, each from a beam of its own."""
    return replace(
        ask(sampling, trunk, candidates[0], seed),
        candidates=candidates,
        draft_probs=draft_probs,
        sources=tuple(f"beam {w}" for w in range(len(candidates))),
    )


def tree_rows() -> tuple[list[RoundAsk], list[list[int]]]:
    """One group of rows with several candidates beside a row of one, and each row's chain rows (interleaved): a
    greedy row of two candidates, the shorter first, whose longer sibling is rejected past the shorter's end; a
    sampled row of three candidates of different lengths with a sampling drafter's q; a sampled row of two
    deterministic candidates, the shorter first, with top-p and a penalty, both rejected at depth 1; a greedy row of
    one."""
    generator = torch.Generator().manual_seed(2)
    trunk = [3, 17, 5, 22, 9, 30]
    drafts = [sampled_draft(generator, length) for length in (2, 4, 3)]
    probs = torch.zeros(3, 4, VOCAB)  # [W, K, V]
    for w, (_, q) in enumerate(drafts):
        probs[w, : q.shape[1]] = q[0]
    penalised = SamplingConfig(temperature=0.8, top_p=0.9, repetition_penalty=1.2, seed=7)
    asks = [
        tree_ask(SamplingConfig(), trunk, [[4, 8], [4, 8, 15, 16]], 1),
        tree_ask(SamplingConfig(temperature=1.0), trunk, [tokens for tokens, _ in drafts], 2, probs),
        tree_ask(penalised, trunk[:4], [[6, 12], [6, 14, 13]], 3),
        ask(SamplingConfig(), trunk, [11, 2], 4),
    ]
    return asks, [[0, 5], [1, 2, 6], [7, 3], [4]]


def shared_prefix(a: list[int], b: list[int]) -> int:
    """Positions 0..shared_prefix of two candidates are the same node of their row's tree."""
    return next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def shared_nodes(logits: torch.Tensor, asks: list[RoundAsk], chains: list[list[int]]) -> None:  # [R, n, V]
    """Each candidate's logits made its earlier siblings' at the positions whose prefix they share (as a pass gives
    them)."""
    for row, rows in zip(asks, chains, strict=True):
        for w, tokens in enumerate(row.candidates):
            for other, r in zip(row.candidates[:w], rows, strict=False):
                shared = shared_prefix(tokens, other) + 1
                logits[rows[w], :shared] = logits[r, :shared]


def tree_logits(asks: list[RoundAsk], chains: list[list[int]]) -> torch.Tensor:  # [R, n, V] float32
    """Random logits, the same at the positions whose prefix two candidates share (as a pass gives them), each
    candidate's tokens made likely at its first two positions; the greedy row's longer candidate rejected at depth 2,
    the beams' first candidate at depth 0, and both of the third row's candidates at depth 1."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(sum(map(len, chains)), PASS_COLUMNS, VOCAB, generator=generator)
    shared_nodes(logits, asks, chains)
    for row, rows in zip(asks, chains, strict=True):
        for tokens in row.candidates:
            for j, token in enumerate(tokens[:2]):
                for other, r in zip(row.candidates, rows, strict=True):
                    logits[r, j, token] += PEAKED if shared_prefix(tokens, other) >= j else 0.0
    logits[chains[0][1], 2, asks[0].candidates[1][2]] = -PEAKED
    logits[chains[1], 0, asks[1].candidates[0][0]] = -PEAKED
    for r in chains[2]:  # 14 kept likely enough that the residual after it differs from the one after 12 alone
        logits[r, 1, 12], logits[r, 1, 14] = -PEAKED, 1.5
    return logits


def tree_program_verdicts(asks: list[RoundAsk], chains: list[list[int]], logits: torch.Tensor) -> list:
    """The round program of rows with several candidates on `logits` (one chain row each, as many as there are), from
    the input buffer its rows write, each row's verdict read back at its first chain row."""
    width = max(len(row.candidates) for row in asks)
    blank = staging_for(SimpleNamespace(slots=256), packed_columns(PASS_COLUMNS, width), torch.device("cpu")).blank
    inputs = np.tile(blank, (len(logits), 1))  # [R, INPUT_COLUMNS]
    seen = torch.zeros(len(logits), VOCAB, dtype=torch.bool)  # [R, V]
    given = torch.zeros(len(logits), PASS_COLUMNS - 1, VOCAB)  # [R, K, V]
    for row, rows in zip(asks, chains, strict=True):
        write_tree(inputs, rows, row)
        seen[rows[0], row.trunk_ids] = True
        for w, (tokens, r) in enumerate(zip(row.candidates, rows, strict=True)):
            if row.draft_probs is not None:
                given[r, : len(tokens)] = row.draft_probs[w, : len(tokens)]
    coupled = any(row.sampling.is_coupled for row in asks)
    packed, _, _ = round_rule(True, True, coupled, width, torch.from_numpy(inputs), logits, seen, given, None)
    return [chain_verdict(packed[rows[0]].numpy(), row, width) for row, rows in zip(asks, chains, strict=True)]


def tree_eager_verdicts(asks: list[RoundAsk], chains: list[list[int]], logits: torch.Tensor) -> list:
    """decide_rows on the same logits, each row's as a pass arranges them: [W, K+1, V], zeros past a candidate's end."""
    arranged = []
    for row, rows in zip(asks, chains, strict=True):
        depth = max(map(len, row.candidates))
        found = torch.zeros(len(rows), depth + 1, VOCAB)
        for w, (tokens, r) in enumerate(zip(row.candidates, rows, strict=True)):
            found[w, : len(tokens) + 1] = logits[r, : len(tokens) + 1]
        arranged.append(found)
    return decide_rows(asks, arranged)


def program_equals_eager(asks: list, chains: list, logits) -> list[RowVerdict]:
    """The rows' verdicts from the program equal the eager rule's, field by field: the eager ones."""
    program, eager = tree_program_verdicts(asks, chains, logits), tree_eager_verdicts(asks, chains, logits)
    assert all(isinstance(verdict, RowVerdict) for verdict in eager), eager
    for r, (mine, theirs) in enumerate(zip(program, eager, strict=True)):
        assert_same(mine, theirs, f"row {r}")
    return eager


def test_the_round_programs_verdict_on_rows_of_several_candidates_is_the_eager_rules() -> None:
    """Rows of two and three candidates, greedy and sampled, of different lengths, beside a row of one in one group:
    each row's verdict from the program (decide_trees, read back by chain_verdict) equals decide_rows' on the same
    logits, every candidate's trace, the path, the accepted count, the next token and its p, and the views along the
    path with the residual after the candidates tried where it stopped. The greedy row stops where its shorter first
    candidate ended and its longer one was rejected; the beams' path is a later candidate. Planted: each row's draws
    laid out at the program's W instead of its own (chain_round._tree_uniforms); the views' residual after the path's
    candidate alone (chain_round._tree_residual)."""
    asks, chains = tree_rows()
    eager = program_equals_eager(asks, chains, tree_logits(asks, chains))
    greedy, beams, both = eager[0], eager[1], eager[2]
    assert (greedy.path, greedy.num_accepted) == (0, 2) and greedy.candidates[1].tested == [False, False, True, False]
    assert [c.tested for c in both.candidates] == [[True, True], [False, True, False]] and both.num_accepted == 1
    assert both.views[-1].residual  # the residual after both candidates tried where the path stopped
    assert beams.path > 0 and beams.candidates[0].tested[0] and not beams.candidates[0].accepted[0]


def coupled_tree_rows() -> tuple[list[RoundAsk], list[list[int]]]:
    """One group of coupled rows with fixed-token candidates beside a standard row of two and coupled rows of one (a
    fixed draft, a sampling drafter's q), and each row's chain rows (interleaved): three candidates, two sharing a
    prefix, the later one matching y to its end; two with top-k and a penalty, the shorter first, the longer tested
    past its end; two, the first ending in an EOS it accepts; two that match nothing."""
    generator = torch.Generator().manual_seed(4)
    trunk = [3, 17, 5, 22, 9, 30]
    tokens, probs = sampled_draft(generator, 3)
    coupled = SamplingConfig(temperature=1.0, rule="coupled")
    penalised = SamplingConfig(temperature=0.8, top_k=6, repetition_penalty=1.2, rule="coupled")
    asks = [
        tree_ask(coupled, trunk, [[4, 8, 15, 16], [4, 8, 23], [7, 1]], 1),
        tree_ask(penalised, trunk, [[6, 12], [6, 12, 14]], 2),
        tree_ask(coupled, trunk[:4], [[11, 39], [2, 9, 10]], 3),
        tree_ask(coupled, trunk, [[13, 2], [18]], 4),
        tree_ask(SamplingConfig(temperature=1.0), trunk, [[20, 21], [20, 25, 26]], 5),
        ask(coupled, trunk, [27, 28, 29], 6),
        ask(coupled, trunk[:5], tokens, 7, probs),
    ]
    return asks, [[0, 7, 12], [1, 8], [2, 9], [3, 10], [4, 11], [5], [6]]


def coupled_tree_logits(asks: list[RoundAsk], chains: list[list[int]]) -> torch.Tensor:  # [R, n, V] float32
    """Random logits, the same at the positions whose prefix two candidates share, with the tokens the rows should
    match far the likeliest (y is then theirs whatever the noise) and the ones they should miss far the least."""
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(sum(map(len, chains)), PASS_COLUMNS, VOCAB, generator=generator)
    shared_nodes(logits, asks, chains)

    def lift(row: int, prefix: list[int], token: int, value: float) -> None:  # at the node after prefix
        for tokens, r in zip(asks[row].candidates, chains[row], strict=True):
            if len(tokens) >= len(prefix) and tokens[: len(prefix)] == prefix:
                logits[r, len(prefix), token] += value

    for row, prefix, token, value in [
        (0, [], 4, 20.0), (0, [4], 8, 20.0), (0, [4, 8], 23, 20.0),
        (1, [], 6, 20.0), (1, [6], 12, 20.0), (1, [6, 12], 14, -20.0),
        (2, [], 11, 20.0), (2, [11], 39, 20.0),
        (3, [], 13, -20.0), (3, [], 18, -20.0),
        (5, [], 27, 20.0),
    ]:  # fmt: skip
        lift(row, prefix, token, value)
    return logits


def test_the_round_programs_coupled_verdict_on_rows_of_several_candidates_is_the_eager_rules() -> None:
    """Coupled rows of two and three fixed-token candidates beside a standard row of two and coupled rows of one, in
    one program: each row's verdict from the program (decide_trees with the rows' noise, read back by chain_verdict)
    equals decide_rows' on the same logits, every candidate's trace with its noise, the path, the next token, the views
    (the residual p itself) and the coupled choices along the path: x the first candidate alive, how many are, and
    p(F) over their distinct tokens. Planted: the first alive candidate taken regardless of the path
    (chain_round._tree_choices without the path's own); the coupled rows' noise of the chain row before
    (decide_trees' verify_coupled on coupled.noise.roll(1, 0)); each alive token counted once per candidate
    (_tree_choices' counted = alive); the views' residual after the candidates tried, for coupled rows too
    (decide_trees without masking tried); each fails."""
    asks, chains = coupled_tree_rows()
    eager = program_equals_eager(asks, chains, coupled_tree_logits(asks, chains))
    deep, longer, eos, none = eager[:4]
    assert (deep.path, deep.num_accepted) == (1, 3)
    assert [c.num_alive for c in deep.choices[:3]] == [3, 2, 2] and deep.choices[3].draft_id is None
    assert (longer.path, longer.num_accepted, longer.choices[2].draft_id, longer.choices[2].num_alive) == (0, 2, 14, 1)
    assert (eos.num_accepted, eos.candidates[0].token_ids[-1]) == (2, 39)
    assert none.num_accepted == 0 and none.choices[0].num_alive == 2 and none.views[0].residual
    assert eager[6].choices[0].coupled_chance != eager[6].choices[0].coupled_chance_high  # the sampled q's bounds
