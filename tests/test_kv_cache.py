"""The KV cache's implicit rollback: dropped draft positions on a tiny Llama, and past a sliding window on a tiny
random Gemma 3 (window 8) and the offline Gemma 3 270M (window 512)."""

# T = sequence length, N = positions whose logits are kept, V = vocab_size

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, PreTrainedModel, Qwen3NextConfig, Qwen3NextForCausalLM

from specdemo.__main__ import main
from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.decoding import Round, autoregressive_generate, speculative_generate
from specdemo.drafters import ModelDrafter, NgramDrafter
from specdemo.kv_cache import KVCachedModel, check_rollback
from specdemo.models import LoadedModel, chat_prompt_ids, load_model, warm_up
from specdemo.offline import OFFLINE_MODELS, package_dir
from specdemo.pairs import make_drafter
from specdemo.stats import emitted_ids
from tests.conftest import hf_greedy

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


def fresh_logits(model: PreTrainedModel, ids: torch.Tensor, num_logits: int) -> torch.Tensor:  # [1, N, V]
    """An uncached forward of the whole sequence (a sliding window then comes from the mask alone)."""
    with torch.inference_mode():
        return model(input_ids=ids, use_cache=False).logits[:, -num_logits:]


def test_rollback_drops_rejected_positions(tiny_target):
    cached = KVCachedModel(tiny_target)
    prefix = torch.tensor([[0, 4, 8, 15, 16]])
    proposed = torch.cat([prefix, torch.tensor([[23, 31, 7]])], dim=1)  # three draft tokens
    cached.logits(proposed, num_logits=4)
    assert cached.cache.get_seq_length() == 8
    # The target kept one draft and replaced the second: the cache must forget 31 and 7.
    corrected = torch.cat([prefix, torch.tensor([[23, 3]])], dim=1)
    logits = cached.logits(corrected, num_logits=1)
    assert cached.last_input_length == 1  # only the new token was fed
    assert cached.cache.get_seq_length() == corrected.shape[1]
    torch.testing.assert_close(logits[:, -1], fresh_logits(tiny_target, corrected, 1)[:, -1], rtol=0, atol=1e-10)


def test_all_positions_of_a_verification_match_a_fresh_pass(tiny_target):
    cached = KVCachedModel(tiny_target)
    ids = torch.tensor([[0, 4, 8, 15, 16, 23, 31]])
    cached.logits(ids[:, :4], num_logits=1)
    logits = cached.logits(ids, num_logits=3)  # [1, 3, V] for the three new positions 4..6
    torch.testing.assert_close(logits, fresh_logits(tiny_target, ids, 3), rtol=0, atol=1e-10)


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


def test_tiny_cache_rolls_back_past_the_window(gemma_target):
    """Each step is a call the decoding loops make; after each, the cached logits equal a fresh full pass."""
    ids = torch.randint(2, TINY_VOCAB, (1, 40), generator=torch.Generator().manual_seed(0))  # [1, 40]
    cached = KVCachedModel(gemma_target)
    steps = [
        (ids[:, :20], 1),  # a prompt 2.5 windows long
        (ids[:, :25], 5),  # verify 4 drafts + bonus
        (torch.cat([ids[:, :22], ids[:, 30:31]], dim=1), 1),  # 2 accepted, 2 rejected: crop 3, feed the resampled
        (ids[:, :22], 1),  # a draft model's next step after a rejection: crop 1
        (ids[:, :23], 1),
        (ids[:, :24], 1),
        (ids[:, :26], 2),  # all accepted: feed the last draft and the bonus
        (ids[:, :21], 1),  # back past the tokens fed since the last crop: the cache starts over
        (ids[:, :40], 19),
    ]
    for sequence_ids, num_logits in steps:
        logits = cached.logits(sequence_ids, num_logits)  # [1, N, V]
        assert cached.cache.get_seq_length() == sequence_ids.shape[1]
        torch.testing.assert_close(logits, fresh_logits(gemma_target, sequence_ids, num_logits), rtol=0, atol=1e-9)
    assert cached.last_input_length == 19  # ids[:, :21] was still cached after the restart


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
    """Linear-attention layers keep a recurrent state that crop cannot restore: refused, with one sentence."""
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
    with pytest.raises(ValueError, match=r"'tiny-qwen3-next' keeps a recurrent state .* pick an attention-only model"):
        check_rollback("tiny-qwen3-next", warm_up(recurrent))
    check_rollback("tiny-gemma", warm_up(gemma_target))  # sliding windows roll back: accepted


GEMMA = "gemma-3-270m"
LONG_PROMPT = order_lines_prompt(60)  # about 790 words, as in the bug report


@pytest.fixture(scope="module")
def gemma() -> LoadedModel:
    if package_dir(OFFLINE_MODELS[GEMMA]) is None:
        pytest.skip(f"{GEMMA}: optional package not installed ({OFFLINE_MODELS[GEMMA].install})")
    return load_model(GEMMA, device=torch.device("cpu"))


def test_gemma_greedy_parity_with_rejections_past_the_window(gemma):
    prompt_ids = chat_prompt_ids(gemma, LONG_PROMPT)  # [1, T]
    window = gemma.model.config.sliding_window
    assert window == 512 and prompt_ids.shape[1] >= 700, (window, prompt_ids.shape)
    spec = SpeculativeConfig(max_new_tokens=50)
    drafter = make_drafter(gemma, None, spec)
    assert isinstance(drafter, NgramDrafter)
    rounds = list(speculative_generate(gemma.model, drafter, prompt_ids, GREEDY, spec, gemma.eos_token_ids))
    assert rejections_past(rounds, prompt_ids.shape[1], window), [(r.draft_token_ids, r.num_accepted) for r in rounds]
    baseline = list(autoregressive_generate(gemma.model, prompt_ids, GREEDY, 50, gemma.eos_token_ids))
    assert emitted_ids(rounds) == emitted_ids(baseline) == hf_greedy(gemma.model, prompt_ids, 50, gemma.eos_token_ids)


def test_cli_generates_on_the_long_prompt_of_the_bug_report(gemma, capsys):
    """The command of the bug report (fewer tokens): it loads its own copy of the model and must exit 0."""
    command = ["generate", "--pair", "gemma-3-270m-ngram", "--prompt", LONG_PROMPT, "--max-new-tokens", "30", "--json"]
    assert main(command) == 0, capsys.readouterr().err[-2000:]
