"""The decoding loops on tiny random models: greedy parity with generate(), limits, EOS, seeds and the distribution."""

from __future__ import annotations

import pytest
import torch

from benchmarks.common import hf_greedy
from specdemo.audit import chi_square_pvalue, tv_distance
from specdemo.config import SamplingConfig, SpeculativeConfig
from specdemo.core.sampling import build_warpers, logits_to_probs
from specdemo.core.stats import emitted_ids, run_stats
from specdemo.drafters import DraftRequest, ModelDrafter, NgramDrafter
from specdemo.engine.decoding import autoregressive_generate, speculative_generate
from tests.helpers import TINY_VOCAB, seeded_runs

NO_EOS: frozenset[int] = frozenset()
EOS = frozenset([1])  # the tiny models' eos_token_id, which generate() stops at too
PROMPT = torch.tensor([[0, 5, 9, 5, 9, 12, 7, 5, 9]])  # repeats, so prompt lookup finds n-grams
EOS_PROMPT = torch.tensor([[0, 10, 19, 5, 21, 5, 13, 13, 21]])  # greedy emits EOS as its 31st token
PARITY_PROMPTS = {"no-eos": PROMPT, "eos-at-31": EOS_PROMPT}


def test_eos_prompt_reaches_eos_and_the_other_does_not(tiny_target):
    """Guards the parity tests: one prompt ends at EOS before the limit, so EOS handling is compared too."""
    assert hf_greedy(tiny_target, EOS_PROMPT, 40, EOS)[-1] in EOS
    assert len(hf_greedy(tiny_target, EOS_PROMPT, 40, EOS)) == 31
    assert not EOS & set(hf_greedy(tiny_target, PROMPT, 40, EOS))


@pytest.mark.parametrize("prompt", PARITY_PROMPTS.values(), ids=PARITY_PROMPTS.keys())
@pytest.mark.parametrize("num_draft_tokens", [1, 3, 5])
def test_greedy_parity_model_drafter(tiny_target, tiny_draft, num_draft_tokens, prompt):
    greedy, spec = SamplingConfig(), SpeculativeConfig(num_draft_tokens=num_draft_tokens, max_new_tokens=40)
    baseline = emitted_ids(autoregressive_generate(tiny_target, prompt, greedy, 40, EOS))
    same_model = list(
        speculative_generate(tiny_target, ModelDrafter(tiny_target, greedy, TINY_VOCAB), prompt, greedy, spec, EOS)
    )
    unrelated = list(
        speculative_generate(tiny_target, ModelDrafter(tiny_draft, greedy, TINY_VOCAB), prompt, greedy, spec, EOS)
    )
    assert emitted_ids(same_model) == baseline == hf_greedy(tiny_target, prompt, 40, EOS)
    assert emitted_ids(unrelated) == baseline
    # draft == target: everything accepted (an accepted EOS ends the run without a bonus); an unrelated random
    # draft: most drafts refused
    assert run_stats(same_model).acceptance_rate == 1.0
    assert all(round_.num_accepted == len(round_.draft_token_ids) for round_ in same_model)
    assert all(round_.next_kind == "bonus" for round_ in same_model[:-1])
    assert run_stats(unrelated).acceptance_rate < 0.5
    assert any(round_.next_kind == "resampled" for round_ in unrelated)


def test_greedy_target_with_a_sampling_draft_is_still_greedy(tiny_target):
    """A hot draft (q not one-hot) goes through the general sampler; the output must still be the argmax path."""
    greedy, spec = SamplingConfig(), SpeculativeConfig(num_draft_tokens=4, max_new_tokens=40)
    drafter = ModelDrafter(tiny_target, SamplingConfig(temperature=1.5, seed=1), TINY_VOCAB)
    rounds = list(speculative_generate(tiny_target, drafter, EOS_PROMPT, greedy, spec, EOS))
    assert emitted_ids(rounds) == hf_greedy(tiny_target, EOS_PROMPT, 40, EOS)
    assert 0 < run_stats(rounds).acceptance_rate < 1  # the hot draft strays and is corrected


@pytest.mark.parametrize("prompt", PARITY_PROMPTS.values(), ids=PARITY_PROMPTS.keys())
def test_greedy_parity_ngram_drafter(tiny_target, prompt):
    greedy, spec = SamplingConfig(), SpeculativeConfig(num_draft_tokens=4, max_new_tokens=50)
    rounds = list(speculative_generate(tiny_target, NgramDrafter(), prompt, greedy, spec, EOS))
    assert emitted_ids(rounds) == hf_greedy(tiny_target, prompt, 50, EOS)
    assert run_stats(rounds).num_accepted > 0  # the lookup proposed and was right, so verification was exercised


def test_ngram_candidates_beyond_one_also_follow_one_token_matches():
    sequence = [5, 6, 7, 9, 5, 6, 8, 3, 6]  # "3 6" never came before; "6" was followed by "8 3 6" and "7 9 5"

    def proposed(num_candidates: int) -> list[list[int]]:
        request = DraftRequest(0, sequence, 3, num_candidates, SamplingConfig(), torch.Generator())
        return NgramDrafter().propose([request])[0].token_ids

    assert proposed(1) == []  # one candidate needs a two-token match
    assert proposed(4) == [[8, 3, 6], [7, 9, 5]]  # the latest match first


def test_greedy_parity_with_repetition_penalty(tiny_target, tiny_draft):
    penalised = SamplingConfig(repetition_penalty=1.5)
    spec = SpeculativeConfig(num_draft_tokens=3, max_new_tokens=30)
    baseline = emitted_ids(autoregressive_generate(tiny_target, PROMPT, penalised, 30, EOS))
    rounds = speculative_generate(
        tiny_target, ModelDrafter(tiny_draft, penalised, TINY_VOCAB), PROMPT, penalised, spec, EOS
    )
    assert emitted_ids(rounds) == baseline == hf_greedy(tiny_target, PROMPT, 30, EOS, repetition_penalty=1.5)


@pytest.mark.parametrize("max_new_tokens", [1, 2, 7, 13])
def test_max_new_tokens_is_exact(tiny_target, max_new_tokens):
    greedy, spec = SamplingConfig(), SpeculativeConfig(num_draft_tokens=5, max_new_tokens=max_new_tokens)
    drafter = ModelDrafter(tiny_target, greedy, TINY_VOCAB)  # accepts everything, so rounds would overshoot
    rounds = list(speculative_generate(tiny_target, drafter, PROMPT, greedy, spec, NO_EOS))
    assert len(emitted_ids(rounds)) == max_new_tokens


def test_stops_at_first_eos_even_inside_an_accepted_draft(tiny_target):
    greedy, spec = SamplingConfig(), SpeculativeConfig(num_draft_tokens=5, max_new_tokens=40)
    baseline = emitted_ids(autoregressive_generate(tiny_target, PROMPT, greedy, 40, NO_EOS))
    eos = baseline[6]  # pretend the 7th greedy token is EOS
    cut = baseline[: baseline.index(eos) + 1]
    drafter = ModelDrafter(tiny_target, greedy, TINY_VOCAB)  # the EOS arrives as an accepted draft token
    rounds = list(speculative_generate(tiny_target, drafter, PROMPT, greedy, spec, frozenset([eos])))
    assert emitted_ids(rounds) == cut
    assert emitted_ids(autoregressive_generate(tiny_target, PROMPT, greedy, 40, frozenset([eos]))) == cut


def test_seeded_runs_are_identical_and_seeds_matter(tiny_target, tiny_draft):
    spec = SpeculativeConfig(num_draft_tokens=3, max_new_tokens=30)

    def run(seed: int) -> list:
        sampling = SamplingConfig(temperature=1.0, seed=seed)
        drafter = ModelDrafter(tiny_draft, sampling, TINY_VOCAB)
        return list(speculative_generate(tiny_target, drafter, PROMPT, sampling, spec, NO_EOS))

    first, again, other = run(3), run(3), run(4)
    assert [r.draft_token_ids for r in first] == [r.draft_token_ids for r in again]
    assert [r.uniforms for r in first] == [r.uniforms for r in again]
    assert emitted_ids(first) == emitted_ids(again)
    assert emitted_ids(first) != emitted_ids(other)


def exact_marginals(model, prompt_ids: torch.Tensor, sampling: SamplingConfig, num_tokens: int) -> torch.Tensor:
    """[num_tokens, V]: the target-only distribution of each of the first generated tokens, by enumerating every
    continuation with probability > 0 (one batched forward per position, no cache)."""
    warpers = build_warpers(sampling)
    prefixes = prompt_ids  # [N, T+j] every continuation of length j with probability > 0
    weights = torch.ones(1, dtype=torch.float64)  # [N] the probability of each continuation
    marginals = []
    for _ in range(num_tokens):
        with torch.inference_mode():
            logits = model(input_ids=prefixes).logits[:, -1:]  # [N, 1, V]
        joint = weights[:, None] * logits_to_probs(logits, prefixes, sampling, warpers)[:, 0].double()  # [N, V]
        marginals.append(joint.sum(dim=0))
        possible = joint.flatten() > 0  # [N*V]
        tokens = torch.arange(TINY_VOCAB).repeat(prefixes.shape[0])[:, None]  # [N*V, 1]
        prefixes = torch.cat([prefixes.repeat_interleave(TINY_VOCAB, dim=0), tokens], dim=1)[possible]
        weights = joint.flatten()[possible]
    return torch.stack(marginals)


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(temperature=1.3, repetition_penalty=1.4),
        SamplingConfig(temperature=0.9, top_k=12, top_p=0.9),
    ],
    ids=["temperature+penalty", "top-k+top-p"],
)
def test_sampled_tokens_follow_the_target_only_distribution(tiny_target, tiny_draft, sampling):
    """Many seeds, as rows of batches: the first three tokens of speculative decoding with K = 2 match the exact
    target-only marginals, with a draft that samples at a different temperature (so rejections and resamples happen at
    both positions). Three tokens, because a run never drafts more than max_new_tokens - 1: the first round drafts 2."""
    num_runs, num_tokens = 1500, 3
    exact = exact_marginals(tiny_target, PROMPT, sampling, num_tokens)  # [3, V]
    draft_sampling = SamplingConfig(temperature=0.7)
    spec = SpeculativeConfig(num_draft_tokens=2, max_new_tokens=num_tokens)
    counts = torch.zeros(num_tokens, TINY_VOCAB, dtype=torch.float64)
    num_two_token_drafts = num_second_draft_rejected = 0
    drafter = ModelDrafter(tiny_draft, draft_sampling, TINY_VOCAB)
    for rounds in seeded_runs(tiny_target, drafter, PROMPT, sampling, spec, num_runs):
        for position, token in enumerate(emitted_ids(rounds)):
            counts[position, token] += 1
        two_token_drafts = [round_ for round_ in rounds if len(round_.draft_token_ids) == 2]
        num_two_token_drafts += len(two_token_drafts)
        num_second_draft_rejected += sum(round_.num_accepted == 1 for round_ in two_token_drafts)
    assert counts.sum(dim=1).tolist() == [num_runs] * num_tokens
    # guards: K = 2 really ran, and the second draft token was tested and refused often enough to matter
    assert num_two_token_drafts >= num_runs
    assert num_second_draft_rejected > num_runs // 20, f"only {num_second_draft_rejected} second drafts rejected"
    for position in range(num_tokens):
        assert counts[position][exact[position] == 0].sum() == 0, "a token the target gives p = 0 was emitted"
        assert chi_square_pvalue(counts[position], exact[position]) > 1e-4, f"position {position}"
        tv = tv_distance(counts[position], exact[position])
        assert tv < 0.08, f"position {position}: TV {tv:.3f}"
