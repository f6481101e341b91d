"""The decoding engine: rounds of draft, verify and accept for a batch of rows that join, finish and leave on their
own, and target-only decoding as the same loop with nothing drafted. Each round yields one Round per row."""

# B = rows, T = sequence length, W = num_candidates, K = num_draft_tokens (a row's longest candidate), V = vocab_size

from __future__ import annotations

import time
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch
from transformers import LogitsProcessorList, PreTrainedModel

from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.core.chain_round import read_chain, read_views
from specdemo.core.coupled import Noise, NoiseAsk, position_noise
from specdemo.core.fixed_rule import DRAWS_PER_ROUND, row_round_uniforms, seed_from
from specdemo.core.inspection import PositionView, path_views
from specdemo.core.match_chance import path_choices
from specdemo.core.planning import BatchCosts, Cut, plan_shared_pass
from specdemo.core.rounds import NOTHING_DRAFTED, CandidateTrace, NextKind, Round
from specdemo.core.rule_inputs import RuleInputs, pad_rows
from specdemo.core.sampling import build_warpers, greedy_token_ids, logits_to_probs
from specdemo.core.verify import CandidateVerdict, Verify, first_nonfinite, verify_rows
from specdemo.drafters.base import Draft, Drafter, DraftRequest, NoDrafter, hidden_layers
from specdemo.engine.cost_watch import watch
from specdemo.models.fixed_shape import SEED_BITS, ChainRequest, FixedShapeModel
from specdemo.models.graphs import free_cached_memory
from specdemo.models.loading import device_memory
from specdemo.models.passes import verifier_for
from specdemo.models.tree_cache import RowRequest


def stream_seed(generator: torch.Generator) -> int:
    """A row's seed for its counter-based draws (the standard rule's uniforms, the coupled rule's noise), drawn from
    its generator: a row added with sampling.seed and no generator of its own has the seed this gives for a generator
    seeded with sampling.seed on the target's device."""
    return seed_from(generator) % 2**SEED_BITS


def _eos_cut(token_ids: list[int], eos_token_ids: frozenset[int]) -> int:
    """How many tokens to keep: up to and including the first EOS, since nothing after an EOS is emitted."""
    for position, token in enumerate(token_ids):
        if token in eos_token_ids:
            return position + 1
    return len(token_ids)


@dataclass
class _Row:
    """One prompt being decoded, with its own settings and random stream."""

    sequence_ids: list[int]
    capacity: int  # the most tokens it will hold: its prompt and max_new_tokens
    sampling: SamplingConfig
    speculative: SpeculativeConfig
    generator: torch.Generator
    drafting: bool  # False: the target alone, one token per round
    warpers: LogitsProcessorList = field(init=False)
    num_generated: int = 0
    num_rounds: int = 0
    drafts_tested: int = 0  # drafted tokens tested on the accepted candidate's path, over the row's rounds
    drafts_accepted: int = 0
    hidden_state: torch.Tensor | None = None  # [L*H] at the last accepted position, for a drafter that reads it
    seed: int = 0  # the rule's draws come from this counter-based stream (core/fixed_rule.py), seeded by `generator`
    draws: int = 0  # draws of that stream used so far: DRAWS_PER_ROUND a round

    def __post_init__(self) -> None:
        self.warpers = build_warpers(self.sampling)

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


def _cut(draft: Draft, num_tokens: int) -> Draft:
    """The draft with every candidate cut to num_tokens (the empty ones dropped)."""
    token_ids = [candidate[:num_tokens] for candidate in draft.token_ids if candidate[:num_tokens]]
    depth = max(map(len, token_ids), default=0)
    probs = None if draft.probs is None or not token_ids else draft.probs[:, :depth]
    chances = None if draft.chances is None else [c[:num_tokens] for c in draft.chances[: len(token_ids)]]
    return replace(draft, token_ids=token_ids, probs=probs, chances=chances)


def _cut_at_eos(draft: Draft, eos_token_ids: frozenset[int]) -> Draft:
    """Drafts after an EOS could never be emitted, so they are neither verified nor counted."""
    token_ids = [candidate[: _eos_cut(candidate, eos_token_ids)] for candidate in draft.token_ids]
    depth = max(map(len, token_ids), default=0)
    probs = None if draft.probs is None else draft.probs[:, :depth]
    chances = None if draft.chances is None else [c[: len(t)] for c, t in zip(draft.chances, token_ids, strict=True)]
    return replace(draft, token_ids=token_ids, probs=probs, chances=chances)


def _greedy_vocabulary(
    candidates: torch.Tensor,  # [W, K] int64
    target_ids: torch.Tensor,  # [W, K+1] int64 the target's argmax along each candidate
) -> torch.Tensor:  # [V'] int64, sorted
    """The tokens the rule can touch in a greedy row: its drafts and the target's argmaxes. Greedy p is one-hot, so
    p, every residual norm(max(0, p - q)) and every draw live on p's argmax, and the rule on these V' tokens decides
    exactly what it decides on all V, for a fraction of the work (V' <= W(2K+1) against V = 49,152)."""
    return torch.unique(torch.cat([candidates.flatten(), target_ids.flatten()]))


def _rule_inputs(
    row: _Row,
    draft: Draft,
    target_logits: torch.Tensor,  # [W, K+1, V]
    compact: bool,  # the row is greedy and so is every row it is verified with: use its own small vocabulary
    noise: Noise,  # the coupled rule's noise, for a row that runs it
) -> RuleInputs:
    """One row's inputs to the multi-candidate rule: p with the row's own settings, its K*W + 1 draws from its own
    stream (or, under the coupled rule, its noise at the round's K+1 positions), and, when compact, the V' token ids
    that stand for V (the ids, q and p then index and span those)."""
    num_candidates, depth_plus_one, vocab_size = target_logits.shape
    device = target_logits.device
    candidates = torch.tensor(
        [c + [0] * (depth_plus_one - 1 - len(c)) for c in draft.token_ids] or [[]], dtype=torch.long, device=device
    ).reshape(num_candidates, depth_plus_one - 1)
    lengths = torch.tensor([len(c) for c in draft.token_ids] or [0], device=device)
    contexts = torch.cat([torch.tensor(row.sequence_ids, device=device).expand(num_candidates, -1), candidates], 1)
    vocab = torch.empty(0, dtype=torch.long, device=device)  # [V'] empty: the whole vocabulary
    if row.sampling.is_greedy:  # one-hot p without the softmax
        target_ids = greedy_token_ids(target_logits, contexts, row.sampling)  # [W, K+1]
        if compact:
            vocab = _greedy_vocabulary(candidates, target_ids)
            candidates, target_ids = torch.searchsorted(vocab, candidates), torch.searchsorted(vocab, target_ids)
            vocab_size = len(vocab)
        target_probs = torch.nn.functional.one_hot(target_ids, vocab_size).float()
    else:
        target_probs = logits_to_probs(target_logits, contexts, row.sampling, row.warpers)  # [W, K+1, V]
    if draft.probs is None:
        draft_probs = torch.nn.functional.one_hot(candidates, vocab_size).float()  # [W, K, V] deterministic
    else:
        draft_probs = draft.probs.to(device)
        draft_probs = draft_probs[..., vocab] if compact else draft_probs
    draws = row_round_uniforms(row.seed, row.draws, (depth_plus_one - 1) * len(draft.token_ids))  # [K*W + 1]
    uniforms = torch.from_numpy(draws).to(device)
    coupled_noise = None
    if row.sampling.is_coupled:
        first = tuple(draft.token_ids[0]) if draft.token_ids else ()
        ask = NoiseAsk(row.seed, len(row.sequence_ids), depth_plus_one, row.num_rounds, first, vocab_size, device)
        coupled_noise = noise(ask)  # [K+1, V]
    return RuleInputs(
        draft_token_ids=candidates,
        draft_lengths=lengths,
        draft_probs=draft_probs,
        target_probs=target_probs,
        uniforms=uniforms,
        vocab=vocab,
        noise=coupled_noise,
    )


def _trace(verdict: CandidateVerdict, b: int, draft: Draft) -> tuple[CandidateTrace, ...]:
    """Row b's candidates with the numbers of every test, as plain lists."""

    def column(table: torch.Tensor, w: int, length: int) -> list:
        return table[b, w, :length].tolist()

    return tuple(
        CandidateTrace(
            token_ids=tokens,
            target_probs=column(verdict.target_draft_probs, w, len(tokens)),
            draft_probs=column(verdict.draft_draft_probs, w, len(tokens)),
            acceptance_probs=column(verdict.acceptance_probs, w, len(tokens)),
            uniforms=column(verdict.uniforms, w, len(tokens)),
            tested=column(verdict.tested, w, len(tokens)),
            accepted=column(verdict.accepted, w, len(tokens)),
            source=draft.sources[w] if draft.sources else "",
        )
        for w, tokens in enumerate(draft.token_ids)
    )


def _views(
    row_inputs: RuleInputs,  # what the rule decided this row with
    candidates: tuple[CandidateTrace, ...],
    path: int,
    num_accepted: int,
    next_id: int | None,  # the emitted resampled or bonus token (whole vocabulary)
) -> tuple[PositionView, ...]:
    """The inspector's p, q and residual along the accepted path, from the tensors the rule itself decided with."""
    vocab = row_inputs.vocab  # [V'] or empty: the ids, p and q are in the rule's vocabulary (V' or all V)
    tried = [w for w, c in enumerate(candidates) if num_accepted < len(c.tested) and c.tested[num_accepted]]
    tried = tried if row_inputs.noise is None else []  # the coupled rule draws the next token from p itself
    next_local = next_id
    if next_id is not None and len(vocab):
        next_local = int(torch.searchsorted(vocab, torch.tensor([next_id], device=vocab.device)))
    drafted = row_inputs.draft_token_ids[path, : len(candidates[path].token_ids) if candidates else 0].tolist()
    compact = vocab if len(vocab) else None
    target_probs, draft_probs = row_inputs.target_probs[path], row_inputs.draft_probs  # [K+1, V], [W, K, V]
    return path_views(target_probs, draft_probs, path, drafted, num_accepted, tried, next_local, compact)


def _verdicts(inputs: list[RuleInputs], verify: Verify) -> list[tuple[CandidateVerdict, int]]:
    """Each row's verdict and its place in it: the rows of each rule padded and decided together."""
    by_rule: dict[bool, list[int]] = {}
    for i, row_inputs in enumerate(inputs):
        by_rule.setdefault(row_inputs.noise is not None, []).append(i)
    located: dict[int, tuple[CandidateVerdict, int]] = {}
    for members in by_rule.values():
        verdict = pad_rows([inputs[i] for i in members]).verdict(verify)  # padded to one W, K and V
        located.update((i, (verdict, place)) for place, i in enumerate(members))
    return [located[i] for i in range(len(inputs))]


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


def _nonfinite(
    target_logits: list[torch.Tensor],  # per row [W, K+1, V]
    drafts: list[Draft],
) -> list[tuple[int | None, int | None]]:
    """Per row, the first position the round verifies whose raw target logits hold inf or NaN, and the first drafted
    position whose q does (None where none): one copy read back for all rows."""
    found = []
    for logits, draft in zip(target_logits, drafts, strict=True):
        device = logits.device
        lengths = torch.tensor([len(c) for c in draft.token_ids] or [0], device=device)  # [W]
        scores = [(logits, torch.arange(logits.shape[1], device=device) <= lengths[:, None])]  # [W, K+1, V], [W, K+1]
        if draft.probs is not None and draft.token_ids:  # [W, K, V]: q at each drafted token
            probs = draft.probs[: len(draft.token_ids)].to(device)
            scores.append((probs, torch.arange(probs.shape[1], device=device) < lengths[:, None]))
        firsts = [first_nonfinite(table, verified).amin() for table, verified in scores]
        firsts = [torch.where(f < table.shape[1], f, -1) for f, (table, _) in zip(firsts, scores, strict=True)]
        found.append(torch.stack([*firsts, *[firsts[0].new_tensor(-1)] * (2 - len(firsts))]))
    return [(t if t >= 0 else None, q if q >= 0 else None) for t, q in torch.stack(found).tolist()]


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
        verify: Verify = verify_rows,  # the multi-candidate rule; the audit plants bugs here
        costs: BatchCosts | None = None,  # this device's round costs: drafts are cut when a shared pass pays for it
        noise: Noise = position_noise,  # the coupled rule's noise; the audit plants its noise bugs here
    ) -> None:
        self.verifier = verifier_for(target, hidden_layers(drafter))
        self.costs = costs
        self.drafter = drafter
        self.verify = verify
        self.noise = noise
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
        if isinstance(self.verifier, FixedShapeModel):
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
        if self._on_device(rows, drafts):
            return self._decided(keys, rows, drafts, cuts, drafted - started) + list(failed.items())
        forward_before = self.verifier.forward_seconds
        target_logits = self.verifier.logits(
            {
                key: RowRequest(row.sequence_ids, d.token_ids, "all", row.capacity)
                for key, row, d in zip(keys, rows, drafts, strict=True)
            }
        )  # per row [W, K+1, V]
        verified = time.perf_counter()
        inputs = []
        compact = all(row.sampling.is_greedy for row in rows)  # rows share the rule's vocabulary: V' or all V
        found = _nonfinite(target_logits, drafts)  # per row (target's column, q's column) or None
        for key, row, draft, logits, columns in zip(keys, rows, drafts, target_logits, found, strict=True):
            overflow = _overflow(row, *columns, self.verifier.model.dtype)
            if overflow is not None:  # inf or NaN: the rule would draw from nothing, so the row leaves
                failed[key] = overflow
                continue
            try:
                inputs.append(_rule_inputs(row, draft, logits, compact, self.noise))
            except Exception as error:  # this row's settings: it leaves, the others go on
                failed[key] = error
        kept = [i for i, key in enumerate(keys) if key not in failed]
        keys, rows, drafts, cuts = ([column[i] for i in kept] for column in (keys, rows, drafts, cuts))
        verdicts = _verdicts(inputs, self.verify)  # (the verdict, the row's place in it) per row
        timings = dict(
            draft_seconds=drafted - started,
            verify_seconds=verified - drafted,
            forward_seconds=max((d.forward_seconds for d in drafts), default=0.0)
            + self.verifier.forward_seconds
            - forward_before,
            num_rows=len(rows),
        )
        outcomes: list[tuple[Hashable, Round | Exception]] = []
        for b, (key, row, draft, cut) in enumerate(zip(keys, rows, drafts, cuts, strict=True)):
            try:
                verdict, place = verdicts[b]
                outcomes.append((key, self._finish_round(place, key, row, draft, cut, verdict, inputs[b], timings)))
            except Exception as error:
                failed[key] = error
        for key in failed:
            self.remove(key)
        other_seconds = time.perf_counter() - verified
        planned = [o for _, o in outcomes if isinstance(o, Round) and o.plan is not None]
        if len(rows) == 1 and planned:  # what the plan expected of a one-row round against what it took
            watch(self.verifier.model).observe(planned[0].plan, planned[0].verify_seconds + other_seconds)
        return [
            (key, replace(outcome, other_seconds=other_seconds) if isinstance(outcome, Round) else outcome)
            for key, outcome in outcomes
        ] + list(failed.items())

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

    def _on_device(self, rows: list[_Row], drafts: list[Draft]) -> bool:
        """Rounds decided whole on the device (FixedShapeModel.decide): fixed-shape passes, the engine's own rule, and
        one candidate a row. Several candidates, the coupled rule and an audit's planted rule take the logits and the
        eager rule."""
        return (
            isinstance(self.verifier, FixedShapeModel)
            and self.verify is verify_rows
            and all(len(d.token_ids) <= 1 for d in drafts)
            and not any(row.sampling.is_coupled for row in rows)
        )

    def _decided(
        self, keys: list[Hashable], rows: list[_Row], drafts: list[Draft], cuts: list[Cut | None], draft_seconds: float
    ) -> list[tuple[Hashable, Round | Exception]]:
        """The round of every row decided on the device, read back once; each row's Round built from its packed row."""
        assert isinstance(self.verifier, FixedShapeModel)
        started = time.perf_counter()
        decided = self.verifier.decide(
            {
                key: ChainRequest(
                    row.sequence_ids,
                    draft.token_ids[0] if draft.token_ids else [],
                    row.capacity,
                    row.sampling,
                    row.seed,
                    row.draws,
                    None if draft.probs is None else draft.probs[0],
                    views=row.drafting,  # target-only rows read no inspector entries
                )
                for key, row, draft in zip(keys, rows, drafts, strict=True)
            }
        )
        timings = dict(
            draft_seconds=draft_seconds,
            verify_seconds=time.perf_counter() - started,
            forward_seconds=max((d.forward_seconds for d in drafts), default=0.0) + self.verifier.last_forward_seconds,
            num_rows=len(rows),
        )
        finished = time.perf_counter()
        outcomes: list[tuple[Hashable, Round | Exception]] = []
        for key, row, draft, cut in zip(keys, rows, drafts, cuts, strict=True):
            packed, hidden = decided[key]
            try:
                outcomes.append((key, self._finish_chain(key, row, draft, cut, packed, hidden, timings)))
            except NonFiniteLogits as error:  # this row's numbers overflowed: it leaves, the others go on
                outcomes.append((key, error))
                self.remove(key)
        other_seconds = time.perf_counter() - finished
        planned = [o for _, o in outcomes if isinstance(o, Round) and o.plan is not None]
        if len(rows) == 1 and planned:  # what the plan expected of a one-row round against what it took
            watch(self.verifier.model).observe(planned[0].plan, planned[0].verify_seconds + other_seconds)
        return [
            (key, replace(outcome, other_seconds=other_seconds) if isinstance(outcome, Round) else outcome)
            for key, outcome in outcomes
        ]

    def _finish_chain(
        self,
        key: Hashable,
        row: _Row,
        draft: Draft,
        cut: Cut | None,
        packed: object,  # [P] float64 numpy: the row's packed round (core/chain_round.py)
        hidden: torch.Tensor | None,  # [L*H] where the next round's logits were read
        timings: dict[str, float | int],
    ) -> Round:
        """_finish_round for a round decided on the device; NonFiniteLogits where it read inf or NaN."""
        tokens = draft.token_ids[0] if draft.token_ids else []
        outcome = read_chain(packed, len(tokens))
        overflow = _overflow(row, outcome.target_nonfinite, outcome.draft_nonfinite, self.verifier.model.dtype)
        if overflow is not None:
            raise overflow
        accepted = outcome.num_accepted
        emitted = [*tokens[:accepted], outcome.next_token_id]
        emitted = emitted[: _eos_cut(emitted, self.eos_token_ids)]
        has_next = len(emitted) > accepted  # False after an accepted EOS: no bonus token follows it
        next_id = outcome.next_token_id if has_next else None
        tested = [j <= accepted for j in range(len(tokens))]
        chosen = CandidateTrace(
            token_ids=tokens,
            target_probs=outcome.target_probs,
            draft_probs=outcome.draft_probs,
            acceptance_probs=outcome.acceptance_probs,
            uniforms=outcome.uniforms,
            tested=tested,
            accepted=[j < accepted for j in range(len(tokens))],
            source=draft.sources[0] if draft.sources else "",
        )
        next_token = None
        if has_next:
            next_token = (
                outcome.next_token_id,
                "resampled" if accepted < len(tokens) else "bonus",
                outcome.next_token_prob,
            )
        views = read_views(packed, tokens, accepted, next_id) if row.drafting else ()
        num_input_tokens = self.verifier.last_input_lengths[key]
        trace = (chosen,) if tokens else ()
        round_ = _path_round(row, chosen, trace, 0, accepted, next_token, num_input_tokens, views, draft, cut, timings)
        row.hidden_state = hidden
        self._grow(key, row, emitted, sum(tested), accepted)
        return round_

    def _grow(self, key: Hashable, row: _Row, emitted: list[int], tested: int, accepted: int) -> None:
        """The row takes its emitted tokens, and leaves when it is done."""
        row.drafts_tested += tested
        row.drafts_accepted += accepted
        row.sequence_ids.extend(emitted)
        row.num_generated += len(emitted)
        row.num_rounds += 1
        row.draws += DRAWS_PER_ROUND
        if row.num_generated >= row.speculative.max_new_tokens or emitted[-1] in self.eos_token_ids:
            self.remove(key)

    def _cut_for_sharing(self, rows: list[_Row], drafts: list[Draft]) -> tuple[list[Draft], list[Cut | None]]:
        """With the device's pass costs and more than one row: every row's candidates cut to the depth with the most
        expected tokens per step for the batch (rows are padded to the widest, so a long draft is every row's cost).
        The cut depends on the rows' past only, so each row's tokens still follow its target exactly; a sampled
        row's tokens are then another draw than alone (the draws' layout follows the draft), greedy ones the same."""
        if self.costs is None or len(rows) < 2:
            return drafts, [None] * len(drafts)
        depth, rate, uncut_rate = plan_shared_pass(
            [row.chances(d) for row, d in zip(rows, drafts, strict=True)], self.costs
        )
        cuts: list[Cut | None] = []
        for draft in drafts:
            available = max(map(len, draft.token_ids), default=0)
            cuts.append(Cut(depth, available, len(rows), rate, uncut_rate) if available > depth else None)
        return [_cut(d, depth) if cut else d for d, cut in zip(drafts, cuts, strict=True)], cuts

    def _finish_round(
        self,
        b: int,
        key: Hashable,
        row: _Row,
        draft: Draft,
        cut: Cut | None,
        verdict: CandidateVerdict,
        row_inputs: RuleInputs,  # what the rule decided this row with
        timings: dict[str, float | int],
    ) -> Round:
        """Row b's Round from the verdict; the row grows by its emitted tokens and leaves when it is done."""
        candidates = _trace(verdict, b, draft)
        path, accepted = int(verdict.path[b]), int(verdict.num_accepted[b])
        chosen = candidates[path] if candidates else NOTHING_DRAFTED
        emitted = [*chosen.token_ids[:accepted], int(verdict.next_token_ids[b])]
        emitted = emitted[: _eos_cut(emitted, self.eos_token_ids)]
        has_next = len(emitted) > accepted  # False after an accepted EOS: no bonus token follows it
        next_id = int(verdict.next_token_ids[b]) if has_next else None
        # the inspector's data, for rows that draft: a target-alone row's is never shown
        views = _views(row_inputs, candidates, path, accepted, next_id) if row.drafting else ()
        coupled = ()
        if row.drafting and row_inputs.noise is not None and verdict.choices is not None:
            drafted = [list(c.token_ids) for c in candidates]
            choices = verdict.choices[b].tolist()
            target, draft_probs = row_inputs.target_probs[path], row_inputs.draft_probs  # [K+1, V], [W, K, V]
            coupled = path_choices(target, draft_probs, row_inputs.noise, drafted, path, accepted, choices)
        tested_at_end = bool(verdict.tested[b, :, accepted].any()) if accepted < verdict.tested.shape[2] else False
        next_token = None
        if has_next:
            next_token = (emitted[-1], "resampled" if tested_at_end else "bonus", float(verdict.next_token_probs[b]))
        num_input_tokens = self.verifier.last_input_lengths[key]
        round_ = _path_round(
            row, chosen, candidates, path, accepted, next_token, num_input_tokens, views, draft, cut, timings
        )
        round_ = replace(round_, coupled=coupled) if coupled else round_
        if self.verifier.keep_hidden_states:  # where the next token's logits were read
            row.hidden_state = self.verifier.last_hidden_states[key][path, accepted]
        self._grow(key, row, emitted, sum(chosen.tested), accepted)
        return round_


def _path_round(
    row: _Row,
    chosen: CandidateTrace,  # the candidate on the accepted path (NOTHING_DRAFTED when none was drafted)
    candidates: tuple[CandidateTrace, ...],
    path: int,
    accepted: int,
    next_token: tuple[int, NextKind, float] | None,  # id, kind and p; None after an accepted EOS
    num_input_tokens: int,
    views: tuple[PositionView, ...],
    draft: Draft,
    cut: Cut | None,
    timings: dict[str, float | int],  # the round's seconds (other_seconds set by the caller) and rows
) -> Round:
    """A row's Round from its path's trace."""
    next_id, next_kind, next_prob = next_token if next_token is not None else (None, None, None)
    return Round(
        index=row.num_rounds,
        draft_token_ids=chosen.token_ids,
        target_probs=chosen.target_probs,
        draft_probs=chosen.draft_probs,
        acceptance_probs=chosen.acceptance_probs,
        uniforms=chosen.uniforms,
        num_accepted=accepted,
        next_token_id=next_id,
        next_kind=next_kind,
        next_token_prob=next_prob,
        num_input_tokens=num_input_tokens,
        other_seconds=0.0,
        candidates=candidates,
        path=path,
        plan=draft.plan,
        cut=cut,
        views=views,
        **timings,
    )


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
