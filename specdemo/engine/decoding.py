"""The decoding engine: rounds of draft, verify and accept for a batch of rows that join, finish and leave on their
own, and target-only decoding as the same loop with nothing drafted. Each round yields one Round per row."""

# B = rows, T = sequence length, W = num_candidates, K = num_draft_tokens (a row's longest candidate), V = vocab_size

from __future__ import annotations

import time
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, replace

import torch
from transformers import PreTrainedModel

from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.core.fixed_rule import DRAWS_PER_ROUND, seed_from
from specdemo.core.planning import BatchCosts, Cut, plan_shared_pass
from specdemo.core.rounds import NOTHING_DRAFTED, Round
from specdemo.core.rules import COUPLED, STANDARD, Rule, rule_for
from specdemo.core.verdicts import DeviceIds, Overflowed, RoundAsk, RowVerdict, eos_cut
from specdemo.drafters.base import Draft, Drafter, DraftRequest, NoDrafter, hidden_layers
from specdemo.engine.cost_watch import watch
from specdemo.models.fixed_shape import SEED_BITS
from specdemo.models.graphs import free_cached_memory
from specdemo.models.loading import device_memory
from specdemo.models.passes import verifier_for


def stream_seed(generator: torch.Generator) -> int:
    """A row's seed for its counter-based draws (the standard rule's uniforms, the coupled rule's noise), drawn from
    its generator: a row added with sampling.seed and no generator of its own has the seed this gives for a generator
    seeded with sampling.seed on the target's device."""
    return seed_from(generator) % 2**SEED_BITS


@dataclass
class _Row:
    """One prompt being decoded, with its own settings and random stream."""

    sequence_ids: list[int]
    capacity: int  # the most tokens it will hold: its prompt and max_new_tokens
    sampling: SamplingConfig
    speculative: SpeculativeConfig
    generator: torch.Generator
    drafting: bool  # False: the target alone, one token per round
    num_generated: int = 0
    num_rounds: int = 0
    drafts_tested: int = 0  # drafted tokens tested on the accepted candidate's path, over the row's rounds
    drafts_accepted: int = 0
    hidden_state: torch.Tensor | None = None  # [F] at the last accepted position, for a drafter that reads it
    seed: int = 0  # the rule's draws come from this counter-based stream (core/fixed_rule.py), seeded by `generator`
    draws: int = 0  # draws of that stream used so far: DRAWS_PER_ROUND a round

    def draft_request(self, key: Hashable) -> DraftRequest:
        # Never propose more than can be emitted: K accepted + 1 next token <= tokens still allowed.
        num_draft = min(self.speculative.num_draft_tokens, self.speculative.max_new_tokens - self.num_generated - 1)
        num_draft = num_draft if self.drafting else 0
        draft_sampling = self.speculative.draft_sampling(self.sampling)
        return DraftRequest(
            key,
            self.sequence_ids,
            num_draft,
            self.speculative.num_candidates,
            draft_sampling,
            self.generator,
            self.hidden_state,
            self.seed,
        )

    def chances(self, draft: Draft) -> list[list[float]]:
        """[W][K] the chance that each drafted token is accepted given its prefix: the drafter's own estimate, or the
        row's acceptance so far (Laplace's rule), the first tokens' chances scaled to add up to at most 1."""
        if draft.chances is not None:
            return draft.chances
        rate = (self.drafts_accepted + 1) / (self.drafts_tested + 2)
        first = min(1.0, 1.0 / max(1, len(draft.token_ids)) / rate)
        return [[rate * first] + [rate] * (len(candidate) - 1) for candidate in draft.token_ids]


def _trimmed(draft: Draft, lengths: list[int]) -> Draft:
    """The draft with candidate w cut to its first lengths[w] tokens, the candidates left empty dropped."""
    kept = [w for w, (c, n) in enumerate(zip(draft.token_ids, lengths, strict=True)) if c[:n]]
    token_ids = [draft.token_ids[w][: lengths[w]] for w in kept]
    depth = max(map(len, token_ids), default=0)
    probs = None if draft.probs is None or not token_ids else draft.probs[kept, :depth]
    chances = None if draft.chances is None else [draft.chances[w][: lengths[w]] for w in kept]
    sources = [draft.sources[w] for w in kept] if draft.sources else draft.sources
    return replace(draft, token_ids=token_ids, probs=probs, chances=chances, sources=sources)


def _cut(draft: Draft, num_tokens: int) -> Draft:
    """The draft with every candidate cut to num_tokens (for a pass shared with other rows)."""
    return _trimmed(draft, [num_tokens] * len(draft.token_ids))


def _cut_at_eos(draft: Draft, eos_token_ids: frozenset[int]) -> Draft:
    """Drafts after an EOS could never be emitted, so they are neither verified nor counted; ids still on the device
    are cut where they are read (RoundAsk.on_host, or the round program)."""
    if isinstance(draft.token_ids, DeviceIds):
        return draft
    return _trimmed(draft, [eos_cut(candidate, eos_token_ids) for candidate in draft.token_ids])


class OutOfDeviceMemory(ValueError):
    """The device ran out of memory for a run: one sentence with the memory free and the way forward."""

    def __init__(self, device: torch.device) -> None:
        free, total = device_memory(device)
        where = "the GPU" if device.type == "cuda" else f"the {device.type} device"
        super().__init__(
            f"This run needed more memory than {where} had ({free / 2**30:.1f} of {total / 2**30:.1f} GiB free): "
            "lower max-new-tokens, the batch size or num-candidates, shorten the prompt, or pick a smaller pair."
        )


class DrafterFailed(ValueError):
    """A drafter failed on one row: one sentence naming the failure, and the row's run ends there."""

    def __init__(self, error: Exception) -> None:
        super().__init__(
            "The drafter failed on this prompt, so its run stops with the tokens decoded so far while other runs go "
            "on: try another drafter or other settings, and if it happens again report it with these settings and "
            f"the drafter's error ({type(error).__name__}: {str(error)[:200]})."
        )


# The way forward from a format whose numbers overflowed: one with more range (bfloat16 has float32's), or more bits
WAYS_FORWARD = {
    "float16": "choose float32 or bfloat16 in Number format (--dtype), or another pair",
    "bfloat16": "choose float32 in Number format (--dtype), or another pair",
}


class NonFiniteLogits(ValueError):
    """A model's numbers overflowed its format on one row: one sentence naming the format and the way forward, and
    the row's run ends there (every token it emitted before came from finite p and q)."""

    def __init__(self, whose: str, dtype: torch.dtype, token: int) -> None:  # whose: "target's logits", ...
        self.whose, self.format, self.token = whose, str(dtype).removeprefix("torch."), token
        super().__init__(self.sentence())

    def sentence(self, pair: str | None = None) -> str:
        """The sentence, naming the pair where the caller knows it ("With <pair>, the target's logits ...")."""
        way = WAYS_FORWARD.get(self.format, "choose another pair")
        said = f"the {self.whose} overflowed to inf or NaN in {self.format} at generated token {self.token}: {way}."
        return f"With {pair}, {said}" if pair else said[0].upper() + said[1:]


def _overflow(row: _Row, target: int | None, draft: int | None, dtype: torch.dtype) -> NonFiniteLogits | None:
    """The row's error when its round read inf or NaN in the target's logits (column `target`) or in q (drafted
    column `draft`): named for the earlier, at the generated token whose p or q it was."""
    if target is None and draft is None:
        return None
    target_first = draft is None or (target is not None and target <= draft)
    whose = "target's logits" if target_first else "drafter's probabilities"
    position = min(p for p in (target, draft) if p is not None)
    return NonFiniteLogits(whose, dtype, row.num_generated + position + 1)


class BatchDecoder:
    """Decodes a batch of rows with one drafter and one target pass per round for all of them.

    Rows join with add() before any round (continuous batching: a row added between rounds joins at the next one),
    leave when they finish (EOS or max_new_tokens) or with remove(). Each row has its own settings and generator, so
    its tokens are those it would get decoded alone."""

    def __init__(
        self,
        target: PreTrainedModel,
        drafter: Drafter,
        eos_token_ids: frozenset[int],
        costs: BatchCosts | None = None,  # this device's round costs: drafts are cut when a shared pass pays for it
        rule: Rule
        | None = None,  # replaces the engine's own rule of its name (core/rules.py): the audit's planted bugs
    ) -> None:
        self.verifier = verifier_for(target, hidden_layers(drafter))
        self.costs = costs
        self.drafter = drafter
        self.rules: dict[str, Rule] = {r.name: r for r in (STANDARD, COUPLED, *([rule] if rule else []))}
        self.eos_token_ids = eos_token_ids
        self.rows: dict[Hashable, _Row] = {}

    def add(
        self,
        key: Hashable,
        prompt_ids: Sequence[int],
        sampling: SamplingConfig,
        speculative: SpeculativeConfig,
        generator: torch.Generator | None = None,  # default: seeded from sampling.seed
        drafting: bool = True,  # False: the row decodes with the target alone, beside rows that draft
    ) -> None:
        assert key not in self.rows and len(prompt_ids) > 0, f"row {key!r}: a new key and a non-empty prompt"
        generator = generator or torch.Generator(device=self.verifier.device).manual_seed(sampling.seed)
        capacity = len(prompt_ids) + speculative.max_new_tokens
        row = self.rows[key] = _Row(list(prompt_ids), capacity, sampling, speculative, generator, drafting)
        row.seed = stream_seed(generator)

    def remove(self, key: Hashable) -> None:
        """The row leaves at once; the others are untouched."""
        self.rows.pop(key, None)
        self.verifier.drop(key)
        self.drafter.forget(key)

    def step(self) -> list[tuple[Hashable, Round | Exception]]:
        """One round for every row: draft, one target pass, the multi-candidate rule; finished rows leave.

        A row whose own settings fail (its probabilities, its trace) or whose draft fails leaves with its exception
        as its outcome and the other rows go on; a failure of the target's shared pass is raised, for every row. When
        the device runs out of memory, every row takes its round once more with the model's idle groups let go, each
        generator put back where the round began; if it runs out again, the rows that joined this round leave with a
        sentence and the others go on (_out_of_memory)."""
        states = {key: row.generator.get_state() for key, row in self.rows.items()}  # draws a failed round takes
        try:
            return self._step()
        except torch.OutOfMemoryError:
            pass  # the error's traceback holds the failed pass's tensors: out of this block, they go before the retry
        return self._out_of_memory(states)

    def _out_of_memory(self, states: dict[Hashable, torch.Tensor]) -> list[tuple[Hashable, Round | Exception]]:
        """Every row takes its round once more, on fresh caches with the model's idle groups let go. If the device runs
        out of memory again, the rows that joined this round leave with a sentence and the others take their round;
        if they run out of memory once more, or no row joined, every row leaves with the sentence. Before each try,
        every row's generator is put back where the round began (`states`)."""
        self._start_afresh(states)
        try:
            return self._step()
        except torch.OutOfMemoryError:
            pass  # out of this block the error's traceback, which holds the failed pass's tensors, goes before they do
        self._start_afresh(states)
        error = OutOfDeviceMemory(self.verifier.device)
        joined = [key for key, row in self.rows.items() if row.num_rounds == 0]
        failed = self._leave(joined if 0 < len(joined) < len(self.rows) else list(self.rows), error)
        if self.rows:
            try:
                return failed + self._step()
            except torch.OutOfMemoryError:
                pass  # as above
            self._start_afresh(states)
            failed += self._leave(list(self.rows), error)
        return failed

    def _start_afresh(self, states: dict[Hashable, torch.Tensor]) -> None:
        """New caches (each row reads its sequence again at its next pass), and the memory of the old ones let go, with
        the model's idle groups (FixedShapeModel.close); each row's generator as `states` holds it."""
        for key, row in self.rows.items():
            row.generator.set_state(states[key])
        self.verifier.close()
        self.verifier = verifier_for(self.verifier.model, self.verifier.hidden_layers)
        for key in self.rows:
            self.drafter.forget(key)
        free_cached_memory(self.verifier.device)

    def _leave(self, keys: list[Hashable], error: Exception) -> list[tuple[Hashable, Round | Exception]]:
        for key in keys:
            self.remove(key)
        return [(key, error) for key in keys]

    def _step(self) -> list[tuple[Hashable, Round | Exception]]:
        started = time.perf_counter()
        keys, rows = list(self.rows), list(self.rows.values())
        requests = [row.draft_request(key) for key, row in zip(keys, rows, strict=True)]
        proposed, failed = self._propose([r for r in requests if r.num_draft_tokens > 0])
        for key in failed:
            self.remove(key)
        keys, rows = list(self.rows), list(self.rows.values())  # the rows whose drafts did not fail
        if not rows:
            return list(failed.items())
        drafts = [_cut_at_eos(proposed.get(key, Draft([], None)), self.eos_token_ids) for key in keys]
        drafts, cuts = self._cut_for_sharing(rows, drafts)
        drafted = time.perf_counter()
        forward_before = self.verifier.forward_seconds
        decided = self.verifier.decide({key: self._ask(row, d) for key, row, d in zip(keys, rows, drafts, strict=True)})
        verified = time.perf_counter()
        timings = dict(
            draft_seconds=drafted - started,
            verify_seconds=verified - drafted - self.verifier.last_rule_seconds,
            forward_seconds=max((d.forward_seconds for d in drafts), default=0.0)
            + self.verifier.forward_seconds
            - forward_before,
            num_rows=len(rows),
        )
        outcomes: list[tuple[Hashable, Round]] = []
        for key, row, draft, cut in zip(keys, rows, drafts, cuts, strict=True):
            try:  # a row's own failure (its settings, its numbers) is its alone: it leaves, the others go on
                outcomes.append((key, self._round(key, row, draft, cut, decided[key], timings)))
            except Exception as error:
                failed[key] = error
                self.remove(key)
        other_seconds = time.perf_counter() - verified + self.verifier.last_rule_seconds
        planned = [o for _, o in outcomes if o.plan is not None]
        if len(rows) == 1 and planned:  # what the plan expected of a one-row round against what it took
            watch(self.verifier.model).observe(planned[0].plan, planned[0].verify_seconds + other_seconds)
        return [(key, replace(round_, other_seconds=other_seconds)) for key, round_ in outcomes] + list(failed.items())

    def _ask(self, row: _Row, draft: Draft) -> RoundAsk:
        """What the verifier decides for the row this round."""
        return RoundAsk(
            trunk_ids=row.sequence_ids,
            candidates=draft.token_ids,
            capacity=row.capacity,
            sampling=row.sampling,
            rule=self.rules[rule_for(row.sampling).name],
            seed=row.seed,
            draws=row.draws,
            round_index=row.num_rounds,
            draft_probs=draft.probs,
            views=row.drafting,  # target-only rows read no inspector entries
            sources=tuple(draft.sources or ()),
            eos_token_ids=self.eos_token_ids,
        )

    def _round(
        self,
        key: Hashable,
        row: _Row,
        draft: Draft,
        cut: Cut | None,
        decided: RowVerdict | Overflowed | Exception,
        timings: dict[str, float | int],  # the round's seconds (other_seconds set by the caller) and rows
    ) -> Round:
        """The row's Round from its verdict, however it was decided; the row grows by its emitted tokens and leaves
        when it is done. Raises the row's own failure: its settings' exception, or NonFiniteLogits."""
        if isinstance(decided, Exception):
            raise decided
        if isinstance(decided, Overflowed):
            raise _overflow(row, decided.target_column, decided.draft_column, self.verifier.model.dtype)
        chosen = decided.candidates[decided.path] if decided.candidates else NOTHING_DRAFTED
        accepted = decided.num_accepted
        emitted = [*chosen.token_ids[:accepted], decided.next_token_id]
        emitted = emitted[: eos_cut(emitted, self.eos_token_ids)]
        has_next = len(emitted) > accepted  # False after an accepted EOS: no bonus token follows it
        # Resampled: some candidate was tested where the path stopped (and rejected); else the bonus after its end.
        stopped = any(accepted < len(c.tested) and c.tested[accepted] for c in decided.candidates)
        round_ = Round(
            index=row.num_rounds,
            draft_token_ids=chosen.token_ids,
            target_probs=chosen.target_probs,
            draft_probs=chosen.draft_probs,
            acceptance_probs=chosen.acceptance_probs,
            uniforms=chosen.uniforms,
            num_accepted=accepted,
            next_token_id=decided.next_token_id if has_next else None,
            next_kind=("resampled" if stopped else "bonus") if has_next else None,
            next_token_prob=decided.next_token_prob if has_next else None,
            num_input_tokens=decided.num_input_tokens,
            other_seconds=0.0,
            candidates=decided.candidates,
            path=decided.path,
            plan=draft.plan,
            cut=cut,
            views=decided.views,
            coupled=decided.choices,
            noise=chosen.noise,
            **timings,
        )
        row.hidden_state = decided.hidden_state
        row.drafts_tested += sum(chosen.tested)
        row.drafts_accepted += accepted
        row.sequence_ids.extend(emitted)
        row.num_generated += len(emitted)
        row.num_rounds += 1
        row.draws += DRAWS_PER_ROUND
        if row.num_generated >= row.speculative.max_new_tokens or emitted[-1] in self.eos_token_ids:
            self.remove(key)
        return round_

    def _propose(self, requests: list[DraftRequest]) -> tuple[dict[Hashable, Draft], dict[Hashable, Exception]]:
        """Every asking row's draft from one call; if it fails, each row's alone, its generator put back and its
        drafter state forgotten first, so a row's failure stays in that row and the others draft what they would
        have (a device out of memory is everyone's, and raised)."""
        if not requests:
            return {}, {}
        states = [r.generator.get_state() for r in requests]  # the draws a failed call may have taken
        try:
            return dict(zip((r.key for r in requests), self.drafter.propose(requests), strict=True)), {}
        except torch.OutOfMemoryError:
            raise
        except Exception:  # whose it was is found below, row by row
            pass
        drafts: dict[Hashable, Draft] = {}
        failed: dict[Hashable, Exception] = {}
        for request, state in zip(requests, states, strict=True):
            request.generator.set_state(state)
            self.drafter.forget(request.key)
            try:
                [drafts[request.key]] = self.drafter.propose([request])
            except torch.OutOfMemoryError:
                raise
            except Exception as error:
                failed[request.key] = DrafterFailed(error)
        return drafts, failed

    def _cut_for_sharing(self, rows: list[_Row], drafts: list[Draft]) -> tuple[list[Draft], list[Cut | None]]:
        """With the device's pass costs and more than one row: every row's candidates cut to the depth with the most
        expected tokens per step for the batch (rows are padded to the widest, so a long draft is every row's cost).
        The cut depends on the rows' past only, so each row's tokens still follow its target exactly; a sampled
        row's tokens are then another draw than alone (the draws' layout follows the draft), greedy ones the same."""
        if self.costs is None or len(rows) < 2:
            return drafts, [None] * len(drafts)
        on_host = [replace(d, token_ids=list(d.token_ids)) if isinstance(d.token_ids, DeviceIds) else d for d in drafts]
        drafts = [_cut_at_eos(d, self.eos_token_ids) for d in on_host]  # the cut reads every row's tokens
        depth, rate, uncut_rate = plan_shared_pass(
            [row.chances(d) for row, d in zip(rows, drafts, strict=True)], self.costs
        )
        cuts: list[Cut | None] = []
        for draft in drafts:
            available = max(map(len, draft.token_ids), default=0)
            cuts.append(Cut(depth, available, len(rows), rate, uncut_rate) if available > depth else None)
        return [_cut(d, depth) if cut else d for d, cut in zip(drafts, cuts, strict=True)], cuts


def batch_generate(
    target: PreTrainedModel,
    drafter: Drafter,
    prompts: Sequence[Sequence[int]],
    samplings: Sequence[SamplingConfig],
    speculative: SpeculativeConfig,
    eos_token_ids: frozenset[int],
    batch_size: int,
    costs: BatchCosts | None = None,  # this device's round costs: drafts are cut when a shared pass pays for it
) -> Iterator[tuple[int, Round]]:
    """Decode every prompt, at most batch_size at a time; a finished row's place goes to the next prompt at the next
    round. Yields (prompt index, Round) in the order the rounds happen."""
    decoder = BatchDecoder(target, drafter, eos_token_ids, costs=costs)
    waiting = list(range(len(prompts)))
    while waiting or decoder.rows:
        while waiting and len(decoder.rows) < batch_size:
            index = waiting.pop(0)
            decoder.add(index, prompts[index], samplings[index], speculative)
        for index, outcome in decoder.step():
            yield index, _raised(outcome)


def _raised(outcome: Round | Exception) -> Round:
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


def speculative_generate(
    target: PreTrainedModel,
    drafter: Drafter,
    prompt_ids: torch.Tensor,  # [1, T] int64
    sampling: SamplingConfig,
    speculative: SpeculativeConfig,
    eos_token_ids: frozenset[int],
    generator: torch.Generator | None = None,  # default: seeded from sampling.seed
) -> Iterator[Round]:
    """One prompt: yield rounds until max_new_tokens are emitted or an EOS is; the tokens follow the target."""
    assert prompt_ids.ndim == 2 and prompt_ids.shape[0] == 1 and prompt_ids.shape[1] > 0, (
        f"prompt_ids must be [1, T] with T > 0, got {tuple(prompt_ids.shape)}"
    )
    decoder = BatchDecoder(target, drafter, eos_token_ids)
    decoder.add(0, prompt_ids[0].tolist(), sampling, speculative, generator)
    while decoder.rows:
        for _, outcome in decoder.step():
            yield _raised(outcome)


def autoregressive_generate(
    target: PreTrainedModel,
    prompt_ids: torch.Tensor,  # [1, T] int64
    sampling: SamplingConfig,
    max_new_tokens: int,
    eos_token_ids: frozenset[int],
    generator: torch.Generator | None = None,
) -> Iterator[Round]:
    """Target-only decoding, the baseline: the same loop with nothing drafted, one token per round."""
    speculative = SpeculativeConfig(max_new_tokens=max_new_tokens)
    yield from speculative_generate(target, NoDrafter(), prompt_ids, sampling, speculative, eos_token_ids, generator)
