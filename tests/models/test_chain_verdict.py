"""The GPU's round program decides what the eager rule decides: the same logits through the program's rule (the input
buffer a group's round reads, models/fixed_pass.round_rule, then core/chain_round.chain_verdict) and through
core/eager_round.decide_rows give each row the same verdict, field by field, for standard and coupled rows, greedy and
sampled, side by side in one group. Pure: logits made up, no model."""

# R = PASS_ROWS chain rows, n = PASS_COLUMNS, K = a row's drafted tokens, V = vocab_size

from __future__ import annotations

import math
from dataclasses import fields
from types import SimpleNamespace

import torch

from specdemo.config import SamplingConfig
from specdemo.core.chain_round import chain_verdict, packed_columns
from specdemo.core.eager_round import decide_rows
from specdemo.core.fixed_rule import DRAWS_PER_ROUND
from specdemo.core.rules import rule_for
from specdemo.core.verdicts import RoundAsk, RowVerdict
from specdemo.models.fixed_pass import PASS_COLUMNS, round_rule, staging_for, write_row

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
    packed, _, _ = round_rule(True, True, True, staging.inputs.to(device), logits, seen, given, None)
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
