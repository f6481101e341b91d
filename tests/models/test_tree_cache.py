"""The tree KV cache: logits equal to uncached ones through joins, branches, holes and departures, on a tiny Llama and
past a sliding window on a tiny random Gemma 3 (window 8); decoding past the window on the offline Gemma 3 270M
(window 512); recurrent models refused at load."""

# T = sequence length, N = positions whose logits are kept, V = vocab_size

from __future__ import annotations

import random

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Qwen3NextConfig, Qwen3NextForCausalLM

from benchmarks.common import hf_greedy
from specdemo.cli.main import main
from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.core.rounds import Round
from specdemo.core.stats import emitted_ids
from specdemo.drafters import ModelDrafter, NgramDrafter
from specdemo.engine.decoding import BatchDecoder, autoregressive_generate, speculative_generate
from specdemo.engine.setup import make_drafter
from specdemo.models.layout import TRUNK, WIDTH_STEP
from specdemo.models.loading import LoadedModel, chat_prompt_ids, load_model
from specdemo.models.offline import OFFLINE_MODELS, package_dir
from specdemo.models.tree_cache import RowRequest, TreeCachedModel, attention_kinds
from specdemo.pairs import find_pair
from tests.helpers import tiny_model

GREEDY = SamplingConfig()
NO_EOS: frozenset[int] = frozenset()
TINY_WINDOW = 8
TINY_VOCAB = 32
ITEMS = ("apples", "pears", "plums", "cherries", "lemons", "grapes", "melons", "peaches", "figs", "limes")
CITIES = ("Leeds", "York", "Bath", "Derby", "Hull", "Wells")


def order_lines_prompt(num_lines: int) -> str:
    """Lines alike enough for prompt lookup to propose the next one, different enough for some drafts to fail."""
    lines = [
        f"Order {1000 + 7 * i}: {3 + i % 9} boxes of {ITEMS[i % 10]} for {CITIES[i % 6]}, "
        f"due day {1 + (5 * i) % 28}, paid {'yes' if i % 3 else 'no'}."
        for i in range(num_lines)
    ]
    return f"Copy these {num_lines} order lines exactly, one per line, in the same order:\n" + "\n".join(lines)


def tiny_gemma(seed: int, num_layers: int = 4) -> Gemma3ForCausalLM:
    """A random Gemma 3 in float64 with a window of 8 and a hybrid layer pattern, as the real one has."""
    layer_types = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"][:num_layers]
    config = Gemma3TextConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=TINY_WINDOW,
        layer_types=layer_types,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=None,  # no EOS: every run emits exactly max_new_tokens, in generate() too
        pad_token_id=0,
        tie_word_embeddings=False,  # tied, a random Gemma mostly repeats its last token and lookup rarely fails
    )
    torch.manual_seed(seed)
    return Gemma3ForCausalLM(config).to(torch.float64).eval()


@pytest.fixture(scope="module")
def gemma_target() -> Gemma3ForCausalLM:
    return tiny_gemma(seed=1)


def rejections_past(rounds: list[Round], prompt_length: int, window: int) -> list[int]:
    """Sequence positions of the rounds that rejected a draft token after the sliding window was full."""
    positions, position = [], prompt_length
    for round_ in rounds:
        if round_.num_accepted < len(round_.draft_token_ids) and position > window:
            positions.append(position)
        position += len(round_.emitted_token_ids)
    return positions


@pytest.mark.parametrize("model_kind", ["llama", "gemma-window-8"])
def test_tree_cache_logits_equal_uncached_logits(model_kind):
    """Random rows join, sit passes out, grow through their branches and leave; logits stay those of the row alone,
    also for a sliding-window model far past its window, with branches kept across passes (tips)."""
    model = tiny_model(0) if model_kind == "llama" else tiny_gemma(1)
    cached, rng, worst = TreeCachedModel(model), random.Random(0), 0.0
    rows = {key: [rng.randrange(TINY_VOCAB) for _ in range(rng.randint(1, 9))] for key in range(3)}
    for step in range(40):
        if step == 10:  # two join, one longer than the window: they read their prompts in a pass of their own
            rows[7] = [rng.randrange(TINY_VOCAB) for _ in range(5)]
            rows[8] = [rng.randrange(TINY_VOCAB) for _ in range(12)]
        if step == 20:
            rows.pop(0)
            cached.drop(0)  # leaves
        keys = [key for key in rows if rng.random() < 0.8] or list(rows)  # the others sit this pass out
        asked = {}
        for key in keys:
            branches = [[rng.randrange(TINY_VOCAB) for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(0, 3))]
            asked[key] = RowRequest(rows[key], branches, rng.choice(["all", "tips"]))
        all_logits = cached.logits(asked)
        for row in cached.layout.rows:  # a branch token hangs from an earlier token of its own row
            for index, node in enumerate(row.tree):
                assert node.parent == TRUNK or len(row.trunk_ids) <= node.parent < len(row.trunk_ids) + index
        for (key, request), logits in zip(asked.items(), all_logits, strict=True):
            for w, branch in enumerate(request.branch_ids or [[]]):
                depths = range(len(branch) + 1) if request.logits_for == "all" else [len(branch)]
                for depth in depths:
                    got = logits[w, depth] if request.logits_for == "all" else logits[w]
                    with torch.inference_mode():
                        alone = model(torch.tensor([request.trunk_ids + branch[:depth]])).logits[0, -1]
                    worst = max(worst, float((got - alone).abs().max()))
            if request.branch_ids and request.logits_for == "all" and rng.random() < 0.6:
                branch = rng.choice(request.branch_ids)  # the row accepts part of a branch, as after a round
                rows[key] = rows[key] + branch[: rng.randint(0, len(branch))] + [rng.randrange(TINY_VOCAB)]
            elif request.logits_for == "all":
                rows[key] = rows[key] + [rng.randrange(TINY_VOCAB)]
    assert worst < 1e-9
    assert max(map(len, rows.values())) > 8 * 3, "the rows never passed the sliding window several times over"


def test_rows_joining_a_running_batch_read_their_prompts_without_the_others():
    """A row joining rows that already decode reads its prompt in a pass of the joining rows alone: the running rows
    are not padded to the prompt's length (eight rows padded to a 60-token prompt cost the load test a second per
    join). Its next pass is one token wide for everyone."""
    model, widths = tiny_model(0), []
    model.register_forward_pre_hook(
        lambda _, args, kwargs: widths.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    cached = TreeCachedModel(model)
    running = {key: RowRequest(list(range(1, 4 + key)), [], "tips") for key in range(3)}
    cached.logits(running)
    widths.clear()
    joining = {7: RowRequest(list(range(2, 22)), [], "tips"), 8: RowRequest(list(range(3, 13)), [], "tips")}
    cached.logits({**{k: RowRequest([*r.trunk_ids, 5], [], "tips") for k, r in running.items()}, **joining})
    assert widths == [(2, 19), (5, 1)], widths


def test_rows_with_the_same_prompt_read_it_once():
    """Rows of one prompt (the audit's samples) read it in one pass of one row, and each then has the logits of the
    prompt alone."""
    model, widths = tiny_model(0), []
    hook = model.register_forward_pre_hook(
        lambda _, args, kwargs: widths.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    cached, prompt = TreeCachedModel(model), list(range(3, 20))
    logits = cached.logits({key: RowRequest(prompt, [[key + 1]], "all") for key in range(4)})
    assert widths == [(1, 16), (4, 2)], widths
    hook.remove()
    with torch.inference_mode():
        for key, row_logits in enumerate(logits):
            alone = model(torch.tensor([[*prompt, key + 1]])).logits[0, -2:]
            assert torch.allclose(row_logits[0], alone, atol=1e-9), key


@pytest.mark.parametrize("drafter_kind", ["ngram", "model"])
def test_a_batch_that_rows_keep_joining_attends_over_what_its_rows_hold(tiny_target, tiny_draft, drafter_kind):
    """Twenty rows pass through a batch of three, each joining as another leaves (continuous batching, as the app's
    scheduler runs). Each row keeps its own slots, so a pass attends over the widest row rounded up to WIDTH_STEP, in
    the target's cache and in the draft model's, and every row still emits what it emits alone, with two candidates,
    sampled and greedy rows. (A cache that kept joining prompts as holes in every row outgrew that 6.4 times.)"""
    rng = random.Random(3)
    prompts = [[rng.randrange(2, TINY_VOCAB) for _ in range(rng.randint(12, 30))] for _ in range(20)]
    samplings = [SamplingConfig(temperature=0.9 * (i % 2), seed=i) for i in range(20)]
    spec = SpeculativeConfig(num_draft_tokens=3, max_new_tokens=16, num_candidates=2)

    def drafter() -> NgramDrafter | ModelDrafter:
        return NgramDrafter(3, 1) if drafter_kind == "ngram" else ModelDrafter(tiny_draft, None, TINY_VOCAB)

    decoder, waiting, batched, excess = BatchDecoder(tiny_target, drafter(), NO_EOS), list(range(20)), {}, []
    caches = [decoder.verifier] + ([decoder.drafter.cached] if drafter_kind == "model" else [])
    while waiting or decoder.rows:
        while waiting and len(decoder.rows) < 3:
            row = waiting.pop(0)
            decoder.add(row, prompts[row], samplings[row], spec)
        for row, round_ in decoder.step():
            batched.setdefault(row, []).append(round_)
        excess += [cache.length - cache.widest for cache in caches]
    assert 0 <= min(excess) and max(excess) < WIDTH_STEP, f"a pass attended over {max(excess)} slots past every row"
    for row in range(20):
        prompt = torch.tensor([prompts[row]])
        alone = speculative_generate(tiny_target, drafter(), prompt, samplings[row], spec, NO_EOS)
        assert emitted_ids(batched[row]) == emitted_ids(alone), f"row {row}"


def test_tiny_greedy_parity_past_the_window(gemma_target):
    """Prompt lookup and an unrelated draft model both meet rejections past the window; the output is the target's."""
    pattern = torch.randint(2, TINY_VOCAB, (6,), generator=torch.Generator().manual_seed(1))  # [6]
    prompt_ids = torch.cat([pattern, pattern[:4], pattern, pattern[2:]])[None]  # [1, 20] repeats, for lookup
    spec = SpeculativeConfig(num_draft_tokens=4, max_new_tokens=40)
    baseline = emitted_ids(list(autoregressive_generate(gemma_target, prompt_ids, GREEDY, 40, NO_EOS)))
    assert baseline == hf_greedy(gemma_target, prompt_ids, 40)
    for drafter in (NgramDrafter(), ModelDrafter(tiny_gemma(seed=2, num_layers=2), GREEDY, TINY_VOCAB)):
        rounds = list(speculative_generate(gemma_target, drafter, prompt_ids, GREEDY, spec, NO_EOS))
        assert emitted_ids(rounds) == baseline, type(drafter).__name__
        assert rejections_past(rounds, prompt_ids.shape[1], TINY_WINDOW), type(drafter).__name__


def test_a_recurrent_state_is_refused_before_any_run(gemma_target):
    """Linear-attention layers keep a recurrent state that cannot be rolled back: refused, with one sentence."""
    config = Qwen3NextConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        num_experts=2,
        num_experts_per_tok=1,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        linear_num_value_heads=2,
        linear_num_key_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        layer_types=["linear_attention", "full_attention"],
    )
    torch.manual_seed(0)
    recurrent = Qwen3NextForCausalLM(config).eval()
    with pytest.raises(ValueError, match=r"'tiny-qwen3-next' has linear_attention layers, .* an attention-only model"):
        attention_kinds("tiny-qwen3-next", recurrent.config)
    with pytest.raises(ValueError, match="linear_attention"):
        TreeCachedModel(recurrent)
    assert attention_kinds("tiny-gemma", gemma_target.config) == ("full_attention", "sliding_attention")


GEMMA = "gemma-3-270m"
LONG_PROMPT = order_lines_prompt(60)  # about 790 words (1,511 tokens), as in the bug report
PAST_THE_WINDOW_PROMPT = order_lines_prompt(30)  # 764 tokens: past the window of 512, half the reading of the above


@pytest.fixture(scope="module")
def gemma() -> LoadedModel:
    if package_dir(OFFLINE_MODELS[GEMMA]) is None:
        pytest.skip(f"{GEMMA}: optional package not installed ({OFFLINE_MODELS[GEMMA].install})")
    return load_model(GEMMA, device=torch.device("cpu"), dtype=torch.float32)  # parity tests need float32


def test_gemma_greedy_parity_with_rejections_past_the_window(gemma):
    prompt_ids = chat_prompt_ids(gemma, PAST_THE_WINDOW_PROMPT)  # [1, T]
    window = gemma.model.config.sliding_window
    assert window == 512 and prompt_ids.shape[1] >= 700, (window, prompt_ids.shape)
    spec = SpeculativeConfig(max_new_tokens=12)  # drafts rejected from the second round on (three of five rounds)
    drafter = make_drafter(find_pair("gemma-3-270m-ngram"), gemma, None)
    assert isinstance(drafter, NgramDrafter)
    rounds = list(speculative_generate(gemma.model, drafter, prompt_ids, GREEDY, spec, gemma.eos_token_ids))
    assert rejections_past(rounds, prompt_ids.shape[1], window), [(r.draft_token_ids, r.num_accepted) for r in rounds]
    baseline = list(autoregressive_generate(gemma.model, prompt_ids, GREEDY, 12, gemma.eos_token_ids))
    assert emitted_ids(rounds) == emitted_ids(baseline) == hf_greedy(gemma.model, prompt_ids, 12, gemma.eos_token_ids)


def test_cli_generates_on_the_long_prompt_of_the_bug_report(gemma, capsys):
    """The command of the bug report (fewer tokens): it loads its own copy of the model and must exit 0."""
    command = ["generate", "--pair", "gemma-3-270m-ngram", "--prompt", LONG_PROMPT, "--max-new-tokens", "12", "--json"]
    assert main(command) == 0, capsys.readouterr().err[-2000:]
