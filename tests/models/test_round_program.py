"""A GPU round on the CPU: fixed-shape passes and graphs forced, each capture replaced by a stand-in that runs the
program eagerly and is counted as one launch, and what a round does outside its replay counted exactly: host waits
(a value read back, a stream or event wait), kernel-launching ops (aten ops that are not views), captures. These are
the CPU's proxies for what a GPU pays around its pass (docs/how-it-works.md, "A round on a GPU")."""

# B = rows, K = num_draft_tokens

from __future__ import annotations

from collections.abc import Hashable, Iterator

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.core.rounds import Round
from specdemo.core.stats import emitted_ids
from specdemo.drafters.base import Draft, DraftRequest, NoDrafter
from specdemo.drafters.suffix import SuffixDrafter
from specdemo.engine.decoding import BatchDecoder
from specdemo.models import graphs, passes
from specdemo.models.pools import pools_for
from tests.engine.test_batch import PROMPTS
from tests.helpers import FREE, HostWaits, StandIn, WarmingStandIn, tiny_drafter, tiny_model, tiny_recurrent_head

EOS: frozenset[int] = frozenset()
SAMPLED = SamplingConfig(temperature=0.8, top_p=0.9, repetition_penalty=1.2, seed=7)
COUPLED = SamplingConfig(temperature=0.8, top_p=0.9, repetition_penalty=1.2, rule="coupled", seed=7)
DEPTH = 16  # K: every column of a pass drafted


class DeviceOps(TorchDispatchMode):
    """Counts the aten ops that launch a kernel on a GPU (not views, not allocations) outside a replay; a replay
    counts as one."""

    QUIET = ("empty", "empty_like", "empty_strided", "_to_copy.dtype", "lift_fresh")

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket.__name__)
        if not StandIn.replaying and not func.is_view and name not in self.QUIET:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


class Counted:
    """Per round: host waits and kernel-launching ops outside the replay, and replays."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.stream_waits = 0
        for name in ("synchronize", "wait"):
            original = getattr(graphs, name)
            monkeypatch.setattr(graphs, name, self._counting(original))
        original_replay = StandIn.replay

        def replay(program: StandIn) -> tuple[torch.Tensor, ...]:
            self.ops.ops.append("replay")
            return original_replay(program)

        monkeypatch.setattr(StandIn, "replay", replay)
        self.ops = DeviceOps()

    def _counting(self, function):
        def counted(*args, **kwargs):
            self.stream_waits += 1
            return function(*args, **kwargs)

        return counted

    def round(self, decoder: BatchDecoder) -> tuple[int, int, list]:
        """(host waits, kernel-launching ops, outcomes) of one decoder.step()."""
        self.stream_waits, self.ops.ops = 0, []
        with HostWaits() as waits, self.ops:
            outcomes = decoder.step()
        return len(waits.calls) + self.stream_waits, len(self.ops.ops), outcomes


@pytest.fixture
def gpu_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counted]:
    """The GPU's path on the CPU: fixed-shape passes, graphs asked for, captures replaced by the stand-in."""
    monkeypatch.setenv(passes.PASS_SHAPE_VARIABLE, "fixed")
    monkeypatch.setenv(graphs.GRAPHS_VARIABLE, "1")
    StandIn.captures = 0
    with graphs.standing_in(StandIn):
        yield Counted(monkeypatch)


class Scripted:
    """A drafter that proposes given tokens: the target's own continuation (all accepted) or other tokens (none)."""

    def __init__(self, continuation: list[int], wrong: bool) -> None:
        self.continuation, self.wrong = continuation, wrong

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        drafts = []
        for request in requests:
            done = len(request.sequence_ids) - len(PROMPTS[0])
            tokens = self.continuation[done : done + request.num_draft_tokens]
            drafts.append(Draft([[(t + 1) % 32 if self.wrong else t for t in tokens]], None))
        return drafts

    def forget(self, key: Hashable) -> None:
        pass


def steady_rounds(counted: Counted, decoder: BatchDecoder) -> list[tuple[int, int, int]]:
    """(host waits, ops, tokens accepted) of every round after the first (which reads the prompt)."""
    decoder.step()
    found = []
    while decoder.rows:
        waits, ops, outcomes = counted.round(decoder)
        found.append((waits, ops, outcomes[0][1].num_accepted))
    return found


def unmade_rounds(counted: Counted, decoder: BatchDecoder) -> list[tuple[int, int, Round]]:
    """(host waits, ops, the row's Round) of every round after the first but those that made a program (a round that
    makes one pays for it once)."""
    decoder.step()
    found = []
    while decoder.rows:
        captures = StandIn.captures
        waits, ops, outcomes = counted.round(decoder)
        if StandIn.captures == captures:
            found.append((waits, ops, outcomes[0][1]))
    return found


def target_text(target: torch.nn.Module, new_tokens: int, sampling: SamplingConfig | None = None) -> list[int]:
    """Target-only decoding's text after PROMPTS[0] (greedy unless `sampling` is given)."""
    decoder = BatchDecoder(target, NoDrafter(), EOS)
    decoder.add(0, PROMPTS[0], sampling or SamplingConfig(), SpeculativeConfig(max_new_tokens=new_tokens))
    rounds = []
    while decoder.rows:
        rounds += [round_ for _, round_ in decoder.step()]
    return emitted_ids(rounds)


@pytest.mark.parametrize("sampling", [SamplingConfig(), SAMPLED], ids=["greedy", "sampled"])
def test_a_target_only_round_waits_once_and_launches_a_few_ops(gpu_path: Counted, sampling: SamplingConfig) -> None:
    """Target-only, greedy and sampled (with top-p and a repetition penalty): one host wait a round, and the input
    copy, the replay and the output copy outside it. Planted: a synchronize() after the replay (2 waits a round)."""
    decoder = BatchDecoder(tiny_model(1), NoDrafter(), EOS)
    decoder.add(0, PROMPTS[0], sampling, SpeculativeConfig(max_new_tokens=12))
    rounds = steady_rounds(gpu_path, decoder)
    assert len(rounds) == 11
    assert max(waits for waits, _, _ in rounds) <= 1, rounds
    assert max(ops for _, ops, _ in rounds) <= 10, rounds


@pytest.mark.parametrize("wrong", [False, True], ids=["all-accepted", "none-accepted"])
def test_a_round_of_sixteen_drafted_tokens_costs_the_same_whatever_is_accepted(gpu_path: Counted, wrong: bool) -> None:
    """K = 16 drafted tokens a round, all accepted or none: one wait and a few ops, the same either way, so nothing
    the host does grows with the tokens accepted (the inspector's views are read from the packed round). Planted: one
    tensor op per accepted token in the round's bookkeeping (all-accepted fails)."""
    target = tiny_model(1)
    continuation = target_text(target, 3 * (DEPTH + 1))
    decoder = BatchDecoder(target, Scripted(continuation, wrong), EOS)
    decoder.add(0, PROMPTS[0], SamplingConfig(), SpeculativeConfig(DEPTH, max_new_tokens=3 * (DEPTH + 1)))
    rounds = steady_rounds(gpu_path, decoder)
    accepted = {count for _, _, count in rounds}
    assert accepted == ({0} if wrong else {DEPTH}), rounds
    assert max(waits for waits, _, _ in rounds) <= 1, rounds
    assert max(ops for _, ops, _ in rounds) <= 10, rounds


def test_the_suffix_drafter_at_sixteen_tokens_waits_once_a_round(gpu_path: Counted) -> None:
    """The suffix drafter, up to 16 tokens a round, on a prompt that holds the target's own text: its rounds wait once
    and launch a few ops, however many of its tokens are accepted."""
    target = tiny_model(1)
    text = target_text(target, 40)
    decoder = BatchDecoder(target, SuffixDrafter(FREE, cache_tokens=0), EOS)
    decoder.add(0, PROMPTS[0] + text + PROMPTS[0], SamplingConfig(), SpeculativeConfig(DEPTH, max_new_tokens=40))
    rounds = steady_rounds(gpu_path, decoder)
    assert max(count for _, _, count in rounds) > 1, rounds
    assert max(waits for waits, _, _ in rounds) <= 1, rounds
    assert max(ops for _, ops, _ in rounds) <= 10, rounds


def test_a_coupled_target_only_round_waits_once_and_launches_a_few_ops(gpu_path: Counted) -> None:
    """Target-only under the coupled rule, sampled with top-p and a repetition penalty: the noise, the Gumbel-max
    choice and the trace in the round program, so one host wait a round and a few ops outside the replay, as for the
    standard rule. Planted: coupled rows sent to the eager rule (FixedShapeModel.in_program refusing them: 26 waits
    and 194 ops a round)."""
    decoder = BatchDecoder(tiny_model(1), NoDrafter(), EOS)
    decoder.add(0, PROMPTS[0], COUPLED, SpeculativeConfig(max_new_tokens=12))
    rounds = steady_rounds(gpu_path, decoder)
    assert len(rounds) == 11
    assert max(waits for waits, _, _ in rounds) <= 1, rounds
    assert max(ops for _, ops, _ in rounds) <= 10, rounds


@pytest.mark.parametrize("num_candidates", [1, 3])
def test_the_coupled_suffix_drafter_at_sixteen_tokens_waits_once_a_round(gpu_path: Counted, num_candidates: int):
    """The suffix drafter, up to 16 tokens a round and one or three candidates, under the coupled rule at a low
    temperature (so the coupled text mostly follows the greedy text), on a prompt that holds the target's greedy text:
    its rounds, the inspector's views and the coupled rule's choices included, wait once and launch a few ops, however
    many of its tokens are accepted (but a round that made a program, which pays for it once). Planted: the coupled
    rule's choices computed on the host (core/match_chance.path_choices on p read back: 30 waits and over 100 ops a
    round); every chain row of a row brought up each round, the ones its round leaves out too
    (FixedShapeModel._prepare: 11 ops a round of one candidate after a round of three)."""
    target = tiny_model(1)
    text = target_text(target, 40)
    decoder = BatchDecoder(target, SuffixDrafter(FREE, cache_tokens=0), EOS)
    sampling = SamplingConfig(temperature=0.1, rule="coupled", seed=7)
    spec = SpeculativeConfig(DEPTH, max_new_tokens=40, num_candidates=num_candidates)
    decoder.add(0, PROMPTS[0] + text + PROMPTS[0], sampling, spec)
    decoder.step()
    rounds, widths = [], set()
    while decoder.rows:
        captures = StandIn.captures
        waits, ops, outcomes = gpu_path.round(decoder)
        widths.add(len(outcomes[0][1].candidates))
        if StandIn.captures == captures:
            rounds.append((waits, ops, outcomes[0][1].num_accepted))
    assert max(count for _, _, count in rounds) > 1 and max(widths) == num_candidates, (rounds, widths)
    assert max(waits for waits, _, _ in rounds) <= 1, rounds
    assert max(ops for _, ops, _ in rounds) <= 10, rounds


def test_programs_are_captured_once_per_group_and_mode_for_the_process(gpu_path: Counted) -> None:
    """Two runs one after the other, then two requests at once, greedy and sampled: one capture per mode, all in the
    first runs; the later runs reuse the kept groups and their programs, and give the same text. Planted: a pool
    that lets an emptied group go (each run captures again)."""
    target = tiny_model(1)
    spec = SpeculativeConfig(max_new_tokens=6)

    def run(*samplings: SamplingConfig) -> list[list[int]]:
        decoder = BatchDecoder(target, NoDrafter(), EOS)
        for index, sampling in enumerate(samplings):
            decoder.add(index, PROMPTS[0], sampling, spec)
        rounds: dict[int, list] = {index: [] for index in range(len(samplings))}
        while decoder.rows:
            for key, round_ in decoder.step():
                rounds[key].append(round_)
        return [emitted_ids(found) for found in rounds.values()]

    first = run(SamplingConfig()) + run(SAMPLED)
    assert StandIn.captures == 2
    again = run(SamplingConfig()) + run(SAMPLED)
    together = run(SamplingConfig(), SAMPLED)
    assert StandIn.captures == 2  # a group with a sampled row runs the sampled program, greedy rows in it too
    assert again == first and together == first
    assert len(pools_for(target).idle) == 1


def test_a_model_loaded_where_rounds_replay_graphs_captures_them_at_load(gpu_path: Counted) -> None:
    """capture_at_load: the greedy and sampled rounds of a first group, with the inspector's entries and without,
    captured once with a line for the load's progress; a run then captures nothing. Where graphs are off, no line and
    no capture."""
    target = tiny_model(1)
    assert passes.capture_at_load(target).startswith("Captured greedy and sampled rounds as CUDA graphs")
    assert StandIn.captures == 4
    decoder = BatchDecoder(target, NoDrafter(), EOS)
    decoder.add(0, PROMPTS[0], SAMPLED, SpeculativeConfig(max_new_tokens=4))
    while decoder.rows:
        decoder.step()
    assert StandIn.captures == 4 + 1  # SAMPLED has a repetition penalty: a mode of its own, captured at first use
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(graphs.GRAPHS_VARIABLE, "0")
        assert passes.capture_at_load(tiny_model(1)) is None
    assert StandIn.captures == 5


@pytest.mark.parametrize("num_candidates", [1, 3])
def test_a_captures_warm_up_runs_change_nothing_the_rounds_read(monkeypatch: pytest.MonkeyPatch, num_candidates: int):
    """Rows greedy and sampled (one with a repetition penalty), target-alone, prompt lookup and a sampling draft
    model, one candidate (rounds in one program) and three (passes in one program): with captures that run their
    program three times first, as CUDA's do, every row's text is the text of programs that run eagerly, because a
    program is made with its first use's inputs and the penalty's seen rows are put back. Planted: a program made
    with zeros for inputs (its warm-up runs write keys at slot 0 of every row); seen rows not put back."""
    monkeypatch.setenv(passes.PASS_SHAPE_VARIABLE, "fixed")
    target, draft = tiny_model(1), tiny_model(2, num_layers=1)
    settings = [SamplingConfig(), SAMPLED, SamplingConfig(temperature=1.0, seed=3)]
    prompts = [[5, 9, 5, 9, 12, 7], [3, 11], [10, 19, 5, 21, 5, 13]]  # token 0 at slot 0 would hide a stray write

    def texts(graphs_on: str) -> dict:
        monkeypatch.setenv(graphs.GRAPHS_VARIABLE, graphs_on)
        found = {}
        for kind in ("none", "ngram", "model"):
            decoder = BatchDecoder(target, tiny_drafter(kind, draft, None), EOS)
            for row, sampling in enumerate(settings):
                spec = SpeculativeConfig(num_draft_tokens=4, max_new_tokens=16, num_candidates=num_candidates)
                decoder.add(row, prompts[row], sampling, spec)
            rounds: dict[int, list] = {row: [] for row in range(len(settings))}
            while decoder.rows:
                for row, round_ in decoder.step():
                    rounds[row].append(round_)
            found[kind] = {row: emitted_ids(r) for row, r in rounds.items()}
        return found

    eager = texts("0")
    with graphs.standing_in(WarmingStandIn):
        captured = texts("1")
    assert captured == eager


@pytest.mark.parametrize("sampling", [SamplingConfig(), SAMPLED], ids=["greedy", "sampled"])
def test_a_recurrent_round_waits_once_whatever_its_depth(gpu_path: Counted, sampling: SamplingConfig) -> None:
    """The recurrent head's K steps are one program (drafters/head_steps.py) whose drafts the round program reads on
    the device: a round waits once, for the round, and launches the same ops at K = 4 and K = 12. Planted: the head's
    steps run eagerly (a dozen ops a step); its drafts read back before the round (2 waits)."""
    target = tiny_model(1)
    head = tiny_recurrent_head(target, 3)
    found = {}
    for depth in (4, 12):
        decoder = BatchDecoder(target, tiny_drafter("recurrent", None, head), EOS)
        decoder.add(0, PROMPTS[0], sampling, SpeculativeConfig(depth, max_new_tokens=4 * (depth + 1)))
        found[depth] = max((waits, ops) for waits, ops, _ in unmade_rounds(gpu_path, decoder))
    assert found[4] == found[12] and found[4][0] <= 1 and found[4][1] <= 10, found


@pytest.mark.parametrize("sampling", [SamplingConfig(), SAMPLED], ids=["greedy", "sampled"])
def test_a_recurrent_round_of_three_candidates_waits_once(gpu_path: Counted, sampling: SamplingConfig) -> None:
    """The recurrent head at W = 3, K = 4: each beam is a chain row of its row's group and the round program decides
    them together (core/chain_round.decide_trees) on the drafts the head's program left on the device, so a round
    waits once and launches at most 10 ops: the head's two input copies, replay and output copy, the round's input
    copy, the drafts' ids (and q) into it in one copy each, its replay and read-back, and the hidden states kept (9
    greedy, 10 sampled). Planted: rows of several candidates sent to the eager rule (FixedShapeModel.in_program
    refusing them: 42 waits and 643 ops a round greedy, 69 and 734 sampled); the drafts read back before the round
    (DeviceIds left out: 2 waits); the q and ids copied a beam at a time (11 ops greedy, 14 sampled); the accepted
    tokens' keys and values copied into the other beams' chain rows on the host, not in the program (18 ops)."""
    target = tiny_model(1)
    decoder = BatchDecoder(target, tiny_drafter("recurrent", None, tiny_recurrent_head(target, 3)), EOS)
    decoder.add(0, PROMPTS[0], sampling, SpeculativeConfig(4, max_new_tokens=20, num_candidates=3))
    rounds = [(waits, ops, len(r.draft_token_ids)) for waits, ops, r in unmade_rounds(gpu_path, decoder)]
    assert max(drafted for _, _, drafted in rounds) == 4, rounds  # the beams were drafted and verified
    assert max(waits for waits, _, _ in rounds) <= 1, rounds
    assert max(ops for _, ops, _ in rounds) <= 10, rounds


DRAFT_MODEL_SETTINGS = {"greedy": SamplingConfig(), "sampled": SAMPLED, "coupled": COUPLED}


@pytest.mark.parametrize("rule", list(DRAFT_MODEL_SETTINGS))
def test_a_draft_model_round_waits_once_and_launches_a_few_ops(gpu_path: Counted, rule: str) -> None:
    """The draft-model pair at K = 4, greedy, and sampled and coupled with top-p and a repetition penalty: the draft
    model's K steps are one program a group (drafters/model_steps.py) whose drafts the round program reads on the
    device, so a round waits once and launches at most 10 ops (6 greedy: the draft's input copy and replay, the
    drafts' ids into the round, the round's input copy, replay and read-back; 7 sampled and coupled: q into the round
    too). Planted: the draft's programs run eagerly (ModelSteps.captured False: up to 284 ops a round greedy, 444
    sampled, 637 coupled); the drafts read back before the round (ModelSteps._read for every row: 2 waits)."""
    target, draft = tiny_model(1), tiny_model(2, num_layers=1)
    sampling = DRAFT_MODEL_SETTINGS[rule]
    decoder = BatchDecoder(target, tiny_drafter("model", draft, None), EOS)
    decoder.add(0, PROMPTS[0], sampling, SpeculativeConfig(4, max_new_tokens=30))
    rounds = [(waits, ops) for waits, ops, _ in unmade_rounds(gpu_path, decoder)]
    assert len(rounds) >= 3, rounds
    assert max(waits for waits, _ in rounds) <= 1, rounds
    assert max(ops for _, ops in rounds) <= 10, rounds


class ScriptedTree:
    """A fixed-token drafter of three candidates a round: the row's own continuation (all accepted), the same with
    its tokens past the second wrong, and wrong from the first (so two share a prefix and one is alone)."""

    def __init__(self, continuation: list[int]) -> None:
        self.continuation = continuation

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        drafts = []
        for request in requests:
            done = len(request.sequence_ids) - len(PROMPTS[0])
            tokens = self.continuation[done : done + request.num_draft_tokens]
            wrong = [(t + 1) % 32 for t in tokens]
            candidates = dict.fromkeys(tuple(c) for c in (tokens, tokens[:2] + wrong[2:], wrong) if c)
            drafts.append(Draft([list(c) for c in candidates], None))
        return drafts

    def forget(self, key: Hashable) -> None:
        pass


def tree_rounds(counted: Counted, sampling: SamplingConfig, depth: int) -> list[tuple[int, int, int, int]]:
    """(host waits, ops, tokens accepted, the most candidates alive at a position) of each round of ScriptedTree on
    the row's own text, K = depth, but those that made a program (which pay for it once)."""
    target = tiny_model(1)
    new_tokens = 4 * (depth + 1)
    decoder = BatchDecoder(target, ScriptedTree(target_text(target, new_tokens + depth, sampling)), EOS)
    decoder.add(0, PROMPTS[0], sampling, SpeculativeConfig(depth, max_new_tokens=new_tokens, num_candidates=3))
    return [
        (waits, ops, r.num_accepted, max((choice.num_alive for choice in r.coupled), default=len(r.candidates)))
        for waits, ops, r in unmade_rounds(counted, decoder)
    ]


@pytest.mark.parametrize("depth", [4, 16])
def test_a_coupled_round_of_three_fixed_token_candidates_waits_once(gpu_path: Counted, depth: int) -> None:
    """The coupled rule (top-p and a repetition penalty) with three fixed-token candidates a round (ScriptedTree on
    the coupled rule's own text, which no drafter changes), K = 4 and 16, each round accepting the first to its end:
    the round program decides them (core/chain_round.decide_trees with the rows' noise), the coupled rule's choices
    over the candidates alive at each position included, so a round waits once and launches what a greedy round of
    the same candidates launches: the input copy, the replay and the output copy (the accepted tokens' keys and
    values go to the two chain rows whose candidates lacked them inside the program, fixed_pass.sync_chains).
    Planted: coupled rows of several candidates sent to the eager rule (FixedShapeModel.in_program refusing them: 140
    waits and 429 ops a round at K = 4, 428 and 1113 at K = 16); those copies made on the host (8 ops more)."""
    coupled, greedy = (tree_rounds(gpu_path, sampling, depth) for sampling in (COUPLED, SamplingConfig()))
    assert len(coupled) >= 3 and {(accepted, alive) for *_, accepted, alive in coupled} == {(depth, 3)}, coupled
    assert max(waits for waits, *_ in coupled) <= 1, coupled
    assert max(ops for _, ops, *_ in coupled) <= max(ops for _, ops, *_ in greedy) <= 3, (coupled, greedy)
