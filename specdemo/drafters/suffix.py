"""Suffix drafting (after SuffixDecoding, Oliaro et al. 2024, arXiv 2411.04975): count every short token string of
the row's prompt and output and of this drafter's earlier outputs, continue the longest matching suffix with its
most frequent continuations, and draft only as much as is expected to pay, from the counts, the match length and
the row's own accept/reject history."""

# W = num_candidates, K = num_draft_tokens, m = match length

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from specdemo.config import check_settings, setting
from specdemo.core.planning import PassCosts, plan_draft
from specdemo.drafters.base import Draft, DraftRequest

MAX_MATCH = 8  # the longest suffix matched; the trie keeps strings one longer, so a match has a next token
MATCH_BUCKETS = (1, 2, 3, 4, 6)  # match lengths calibrated apart: 1, 2, 3, 4-5, 6 and more
PRIOR_RATIOS = (0.3, 0.6, 0.8, 0.9, 0.95)  # accepted / frequency score per bucket before the row has history
PRIOR_WEIGHT = 2.0  # the prior counts as this many drafted tokens
ROW_PRIOR_WEIGHT = 5.0  # the row's own scale of the priors starts at 1 and counts as this many expected acceptances
MIN_REACH = 0.02  # a candidate stops growing when the chance of reaching its next token falls below this
MAX_SUFFIX_CACHE_TOKENS = 200_000  # its trie keeps up to 9 nodes per token: bounded memory (docs/how-it-works.md)


@dataclass(frozen=True)
class SuffixOptions:
    suffix_cache_tokens: int = setting(
        20_000,
        "suffix-cache-tokens",
        low=0,
        high=MAX_SUFFIX_CACHE_TOKENS,
        whole=True,
        label="Earlier output tokens remembered",
        help="suffix drafting: tokens of earlier outputs it remembers (the oldest go first)",
    )

    def __post_init__(self) -> None:
        check_settings(self)


class SuffixTrie:
    """How often each token string of length <= depth occurs in the sequences counted: a trie whose node for a
    string s has count(s) and a child per token that followed s."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.counts: list[int] = [0]  # node 0 is the empty string
        self.children: list[dict[int, int] | None] = [None]  # None: no child yet (most nodes are leaves)
        self.free: list[int] = []  # node ids to reuse after a removal
        self.emptied: list[tuple[int, int]] = []  # (node, token) edges whose child's count fell to 0 in a removal

    @property
    def num_nodes(self) -> int:
        return len(self.counts) - len(self.free)

    def extend(self, open_nodes: list[int], token: int, delta: int = 1) -> list[int]:
        """Count `token` after each open suffix (open_nodes[i] is the string of the last i tokens) and return the
        open suffixes after it. delta = -1 uncounts, for removal."""
        moved = [0]
        for length, node in enumerate(open_nodes[: self.depth]):
            children = self.children[node]
            if children is None:
                children = self.children[node] = {}
            child = children.get(token)
            if child is None:
                child = self._new_node()
                children[token] = child
            self.counts[child] += delta
            if self.counts[child] == 0:
                self.emptied.append((node, token))
            if length + 1 < self.depth:
                moved.append(child)
        return moved

    def _new_node(self) -> int:
        if self.free:
            node = self.free.pop()
            self.counts[node], self.children[node] = 0, None
            return node
        self.counts.append(0)
        self.children.append(None)
        return len(self.counts) - 1

    def add(self, token_ids: list[int]) -> None:
        open_nodes = [0]
        for token in token_ids:
            open_nodes = self.extend(open_nodes, token)

    def remove(self, token_ids: list[int]) -> None:
        """Uncount a sequence added earlier; strings no longer counted are pruned and their nodes reused."""
        open_nodes = [0]
        for token in token_ids:
            open_nodes = self.extend(open_nodes, token, delta=-1)
        for node, token in self.emptied:
            children = self.children[node]  # None once the node itself was pruned with its parent
            if children is not None and token in children:
                self._free_subtree(children.pop(token))
        self.emptied = []

    def _free_subtree(self, node: int) -> None:
        stack = [node]
        while stack:
            node = stack.pop()
            stack.extend((self.children[node] or {}).values())
            self.children[node] = None
            self.free.append(node)

    def match(self, context: list[int], max_match: int) -> tuple[int, dict[int, int]]:
        """The longest suffix of context (at most max_match tokens) that was followed by something: its length m
        and the counts of what followed it, token -> count. (0, {}) when even the last token is new."""
        for length in range(min(max_match, self.depth - 1, len(context)), 0, -1):
            node = 0
            for token in context[len(context) - length :]:
                node = (self.children[node] or {}).get(token, -1)
                if node < 0:
                    break
            if node >= 0 and self.children[node]:
                return length, {token: self.counts[child] for token, child in self.children[node].items()}
        return 0, {}


def bucket(match_length: int) -> int:
    return sum(match_length >= low for low in MATCH_BUCKETS) - 1


@dataclass
class _RowState:
    """One row's trie over its own prompt and output, and the accept/reject history that calibrates its drafts."""

    prompt_length: int
    trie: SuffixTrie = field(default_factory=lambda: SuffixTrie(MAX_MATCH + 1))
    open_nodes: list[int] = field(default_factory=lambda: [0])
    sequence_ids: list[int] = field(default_factory=list)  # the tokens counted so far
    last_draft: list[list[tuple[int, int, float]]] = field(default_factory=list)  # per candidate (token, bucket, score)
    accepted: list[float] = field(default_factory=lambda: [0.0] * len(MATCH_BUCKETS) * 2)  # per (source, bucket)
    scored: list[float] = field(default_factory=lambda: [0.0] * len(MATCH_BUCKETS) * 2)  # sum of frequency scores
    scale: float = 1.0  # the row's accepted tokens over what the priors expected of every token it drafted; set
    # by learn(), where accepted and scored change, not summed again by ratio() for every candidate token

    def ratio(self, key: int) -> float:
        """Accepted ÷ frequency score for this source and match length: the row's own history there, shrunk toward
        the prior scaled by the row's history everywhere. A row whose drafts break (free prose) then expects less
        even of a match length it has not drafted from yet, and a row that copies (a table) expects more."""
        prior = min(1.0, PRIOR_RATIOS[key % len(MATCH_BUCKETS)] * self.scale)
        return (self.accepted[key] + PRIOR_WEIGHT * prior) / (self.scored[key] + PRIOR_WEIGHT)

    def learn(self, emitted: list[int]) -> None:
        """Score the last round's drafted tokens against what was emitted: with drafts verified as one-hot
        proposals, a token whose prefix was emitted was reached, and it was accepted exactly when it was emitted
        too (the next token after a rejection is never the rejected one)."""
        for candidate in self.last_draft:
            for position, (token, key, score) in enumerate(candidate):
                if position >= len(emitted) or [t for t, _, _ in candidate[:position]] != emitted[:position]:
                    break
                self.scored[key] += score
                self.accepted[key] += token == emitted[position]
        self.last_draft = []
        expected = sum(score * PRIOR_RATIOS[key % len(MATCH_BUCKETS)] for key, score in enumerate(self.scored))
        self.scale = (sum(self.accepted) + ROW_PRIOR_WEIGHT) / (expected + ROW_PRIOR_WEIGHT)


class SuffixDrafter:
    """Model-free drafting from suffix counts, with the draft length chosen per round to maximise the expected
    tokens per step of this device (PassCosts); drafts nothing when drafting is expected to lose."""

    def __init__(
        self,
        costs: PassCosts | Callable[[int], PassCosts],  # the target's pass costs, or a function that measures them
        # for passes of up to n tokens (DraftingContext.pass_costs: measured once per model, on this device)
        cache_tokens: int = SuffixOptions.suffix_cache_tokens,
    ) -> None:
        self.costs = costs
        self.cache_tokens = cache_tokens
        self.earlier = SuffixTrie(MAX_MATCH + 1)  # this drafter's earlier outputs, oldest forgotten first
        self.earlier_outputs: deque[list[int]] = deque()
        self.earlier_tokens = 0
        self.rows: dict[Hashable, _RowState] = {}

    def forget(self, key: Hashable) -> None:
        """The row left: its output joins the earlier outputs."""
        state = self.rows.pop(key, None)
        if state is not None and self.cache_tokens:
            self._remember(state.sequence_ids[state.prompt_length :][-self.cache_tokens :])

    def _remember(self, output_ids: list[int]) -> None:
        if not output_ids:
            return
        self.earlier.add(output_ids)
        self.earlier_outputs.append(output_ids)
        self.earlier_tokens += len(output_ids)
        while self.earlier_tokens > self.cache_tokens:
            oldest = self.earlier_outputs.popleft()
            self.earlier.remove(oldest)
            self.earlier_tokens -= len(oldest)

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        widest = max(r.num_candidates * r.num_draft_tokens + 1 for r in requests)
        costs = self.costs if isinstance(self.costs, PassCosts) else self.costs(widest)
        return [self._propose(request, costs) for request in requests]

    def _propose(self, request: DraftRequest, costs: PassCosts) -> Draft:
        state = self.rows.get(request.key)
        if state is None:
            state = self.rows[request.key] = _RowState(len(request.sequence_ids))
        sequence = request.sequence_ids
        new = sequence[len(state.sequence_ids) :]
        state.learn(new)
        for token in new:
            state.open_nodes = state.trie.extend(state.open_nodes, token)
        state.sequence_ids.extend(new)  # what the row emitted since: O(new tokens), not O(sequence)
        candidates = self._candidates(state, sequence, request.num_candidates, request.num_draft_tokens)
        estimates = [[min(1.0, score * state.ratio(key)) for _, key, score in candidate] for candidate in candidates]
        first = sum(candidate[0] for candidate in estimates)
        for candidate in estimates:  # the first tokens differ, so their chances cannot add up to more than 1
            candidate[0] /= max(1.0, first)
        plan = plan_draft(estimates, costs)  # no clock here: in one process, a seed gives the same drafts
        state.last_draft = [candidate[: plan.num_tokens] for candidate in candidates[: plan.num_candidates]]
        chances = [candidate[: plan.num_tokens] for candidate in estimates[: plan.num_candidates]]
        return Draft([[token for token, _, _ in c] for c in state.last_draft], None, plan=plan, chances=chances)

    def _candidates(
        self, state: _RowState, sequence: list[int], num_candidates: int, num_draft_tokens: int
    ) -> list[list[tuple[int, int, float]]]:
        """Up to W candidates with different first tokens, the most frequent continuations first, each grown by its
        most frequent next token while its chance of being reached stays above MIN_REACH: (token, calibration key,
        frequency score) per token."""
        if num_draft_tokens == 0:
            return []
        tail = sequence[-MAX_MATCH:]
        key, counts = self._continuations(state, tail)
        total = sum(counts.values())
        firsts = sorted(counts.items(), key=lambda item: -item[1])[:num_candidates]
        candidates = []
        for token, count in firsts:
            candidate, reach = [(token, key, count / total)], count / total * state.ratio(key)
            while len(candidate) < num_draft_tokens and reach >= MIN_REACH:
                key_next, next_counts = self._continuations(state, (tail + [t for t, _, _ in candidate])[-MAX_MATCH:])
                if not next_counts:
                    break
                token_next, count_next = max(next_counts.items(), key=lambda item: item[1])
                score = count_next / sum(next_counts.values())
                candidate.append((token_next, key_next, score))
                reach *= min(1.0, score * state.ratio(key_next))
            candidates.append(candidate)
        return candidates

    def _continuations(self, state: _RowState, context: list[int]) -> tuple[int, dict[int, int]]:
        """What followed the longest match of the context, in the row's own text or in earlier outputs (the longer
        match wins; the row's own on a tie), with the calibration key of that source and match length."""
        own_length, own = state.trie.match(context, MAX_MATCH)
        earlier_length, earlier = self.earlier.match(context, MAX_MATCH)
        if earlier_length > own_length:
            return len(MATCH_BUCKETS) + bucket(earlier_length), earlier
        return bucket(max(own_length, 1)), own
