"""The decoding loops on tiny random models: greedy parity with generate(), limits, EOS, seeds and the distribution."""

from __future__ import annotations

import pytest
import torch

from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.decoding import autoregressive_generate, speculative_generate
from specdemo.drafters import ModelDrafter, NgramDrafter
from specdemo.sampling import build_warpers, logits_to_probs
from specdemo.stats import run_stats
from tests.conftest import TINY_VOCAB, chi_square_pvalue, tv_distance

NO_EOS: frozenset[int] = frozenset()
PROMPT = torch.tensor([[0, 5, 9, 5, 9, 12, 7, 5, 9]])  # repeats, so prompt lookup finds n-grams


def generated(rounds) -> list[int]:
    return [token for round_ in rounds for token in round_.emitted_token_ids]


def hf_greedy(model, prompt_ids: torch.Tensor, max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        output = model.generate(
            prompt_ids,
            attention_mask=torch.ones_like(prompt_ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            pad_token_id=1,
        )
    return output[0, prompt_ids.shape[1] :].tolist()


@pytest.mark.parametrize("num_draft_tokens", [1, 3, 5])
def test_greedy_parity_model_drafter(tiny_target, tiny_draft, num_draft_tokens):
    greedy, spec = SamplingConfig(), SpeculativeConfig(num_draft_tokens=num_draft_tokens, max_new_tokens=40)
    baseline = generated(autoregressive_generate(tiny_target, PROMPT, greedy, 40, NO_EOS))
    same_model = list(
        speculative_generate(tiny_target, ModelDrafter(tiny_target, greedy, TINY_VOCAB), PROMPT, greedy, spec, NO_EOS)
    )
    unrelated = list(
        speculative_generate(tiny_target, ModelDrafter(tiny_draft, greedy, TINY_VOCAB), PROMPT, greedy, spec, NO_EOS)
    )
    assert generated(same_model) == baseline == hf_greedy(tiny_target, PROMPT, 40)
    assert generated(unrelated) == baseline
    # draft == target: everything accepted; an unrelated random draft: most drafts refused
    assert run_stats(same_model).acceptance_rate == 1.0
    assert all(round_.next_kind == "bonus" for round_ in same_model)
    assert run_stats(unrelated).acceptance_rate < 0.5
    assert any(round_.next_kind == "resampled" for round_ in unrelated)


def test_greedy_target_with_a_sampling_draft_is_still_greedy(tiny_target):
    """A hot draft (q not one-hot) goes through the general sampler; the output must still be the argmax path."""
    greedy, spec = SamplingConfig(), SpeculativeConfig(num_draft_tokens=4, max_new_tokens=40)
    drafter = ModelDrafter(tiny_target, SamplingConfig(temperature=1.5, seed=1), TINY_VOCAB)
    rounds = list(speculative_generate(tiny_target, drafter, PROMPT, greedy, spec, NO_EOS))
    assert generated(rounds) == hf_greedy(tiny_target, PROMPT, 40)
    assert 0 < run_stats(rounds).acceptance_rate < 1  # the hot draft strays and is corrected


def test_greedy_parity_ngram_drafter(tiny_target):
    greedy, spec = SamplingConfig(), SpeculativeConfig(num_draft_tokens=4, max_new_tokens=50)
    rounds = list(speculative_generate(tiny_target, NgramDrafter(), PROMPT, greedy, spec, NO_EOS))
    assert generated(rounds) == hf_greedy(tiny_target, PROMPT, 50)
    assert run_stats(rounds).num_drafted > 0  # the lookup did propose, so verification was exercised


def test_greedy_parity_with_repetition_penalty(tiny_target, tiny_draft):
    penalised = SamplingConfig(repetition_penalty=1.5)
    spec = SpeculativeConfig(num_draft_tokens=3, max_new_tokens=30)
    baseline = generated(autoregressive_generate(tiny_target, PROMPT, penalised, 30, NO_EOS))
    rounds = speculative_generate(
        tiny_target, ModelDrafter(tiny_draft, penalised, TINY_VOCAB), PROMPT, penalised, spec, NO_EOS
    )
    with torch.inference_mode():
        hf = tiny_target.generate(
            PROMPT,
            attention_mask=torch.ones_like(PROMPT),
            do_sample=False,
            repetition_penalty=1.5,
            max_new_tokens=30,
            min_new_tokens=30,
            pad_token_id=1,
        )
    assert generated(rounds) == baseline == hf[0, PROMPT.shape[1] :].tolist()


@pytest.mark.parametrize("max_new_tokens", [1, 2, 7, 13])
def test_max_new_tokens_is_exact(tiny_target, max_new_tokens):
    greedy, spec = SamplingConfig(), SpeculativeConfig(num_draft_tokens=5, max_new_tokens=max_new_tokens)
    drafter = ModelDrafter(tiny_target, greedy, TINY_VOCAB)  # accepts everything, so rounds would overshoot
    rounds = list(speculative_generate(tiny_target, drafter, PROMPT, greedy, spec, NO_EOS))
    assert len(generated(rounds)) == max_new_tokens


def test_stops_at_first_eos_even_inside_an_accepted_draft(tiny_target):
    greedy, spec = SamplingConfig(), SpeculativeConfig(num_draft_tokens=5, max_new_tokens=40)
    baseline = generated(autoregressive_generate(tiny_target, PROMPT, greedy, 40, NO_EOS))
    eos = baseline[6]  # pretend the 7th greedy token is EOS
    cut = baseline[: baseline.index(eos) + 1]
    drafter = ModelDrafter(tiny_target, greedy, TINY_VOCAB)  # the EOS arrives as an accepted draft token
    rounds = list(speculative_generate(tiny_target, drafter, PROMPT, greedy, spec, frozenset([eos])))
    assert generated(rounds) == cut
    assert generated(autoregressive_generate(tiny_target, PROMPT, greedy, 40, frozenset([eos]))) == cut


def test_seeded_runs_are_identical_and_seeds_matter(tiny_target, tiny_draft):
    spec = SpeculativeConfig(num_draft_tokens=3, max_new_tokens=30)

    def run(seed: int) -> list:
        sampling = SamplingConfig(temperature=1.0, seed=seed)
        drafter = ModelDrafter(tiny_draft, sampling, TINY_VOCAB)
        return list(speculative_generate(tiny_target, drafter, PROMPT, sampling, spec, NO_EOS))

    first, again, other = run(3), run(3), run(4)
    assert [r.draft_token_ids for r in first] == [r.draft_token_ids for r in again]
    assert [r.uniforms for r in first] == [r.uniforms for r in again]
    assert generated(first) == generated(again)
    assert generated(first) != generated(other)


def exact_first_two_marginals(model, prompt_ids: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """[2, V]: the target-only distribution of the first and of the second generated token, by enumeration."""
    warpers = build_warpers(sampling)

    def next_probs(ids: torch.Tensor) -> torch.Tensor:  # [V] without any cache
        with torch.inference_mode():
            logits = model(input_ids=ids).logits[:, -1:].float()
        return logits_to_probs(logits, ids, sampling, warpers)[0, 0].double()

    first = next_probs(prompt_ids)
    second = sum(first[t] * next_probs(torch.cat([prompt_ids, torch.tensor([[t]])], 1)) for t in range(TINY_VOCAB))
    return torch.stack([first, second])


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(temperature=1.3, repetition_penalty=1.4),
        SamplingConfig(temperature=0.9, top_k=12, top_p=0.9),
    ],
    ids=["temperature+penalty", "top-k+top-p"],
)
def test_sampled_tokens_follow_the_target_only_distribution(tiny_target, tiny_draft, sampling):
    """Many seeds: the first two tokens of speculative decoding match the exact target-only marginals,
    with a draft that samples at a different temperature (so rejections and resamples happen)."""
    num_runs = 1500
    exact = exact_first_two_marginals(tiny_target, PROMPT, sampling)  # [2, V]
    draft_sampling = SamplingConfig(temperature=0.7)
    spec = SpeculativeConfig(num_draft_tokens=2, max_new_tokens=2)
    counts = torch.zeros(2, TINY_VOCAB, dtype=torch.float64)
    num_resampled = 0
    for seed in range(num_runs):
        drafter = ModelDrafter(tiny_draft, draft_sampling, TINY_VOCAB)
        rounds = list(
            speculative_generate(
                tiny_target, drafter, PROMPT, sampling, spec, NO_EOS, generator=torch.Generator().manual_seed(seed)
            )
        )
        tokens = generated(rounds)
        counts[0, tokens[0]] += 1
        counts[1, tokens[1]] += 1
        num_resampled += sum(round_.next_kind == "resampled" for round_ in rounds)
    assert num_resampled > num_runs // 10, "the draft agreed too often for this test to mean anything"
    for position in range(2):
        assert counts[position][exact[position] == 0].sum() == 0, "a token the target gives p = 0 was emitted"
        assert chi_square_pvalue(counts[position], exact[position]) > 1e-4
        tv = tv_distance(counts[position], exact[position])
        assert tv < 0.08, f"position {position}: TV {tv:.3f}"
