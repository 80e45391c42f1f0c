import copy

import pytest
import torch

import sampling.loop.acceptance
from sampling import (
    SpeculativeStats,
    autoregressive_generate,
    autoregressive_generate_encoder_decoder,
    speculative_generate,
    speculative_generate_encoder_decoder,
)
from sampling.loop.randomness import TARGET, inverse_cdf
from tests.models import DECODER_ONLY, ENCODER_DECODER, prompt, tiny_model
from tests.stats_helpers import P_VALUE_THRESHOLD, chi_square_p_value, exact_two_token_distribution, first_two_tokens
from utils import calibration
from utils.cost_model import PassCosts
from utils.logits_processors import MultinomialProcessor, NucleusProcessor, TopKProcessor


def pair(name):
    """(target, drafter): two different random models of one family."""
    return tiny_model(name, seed=0), tiny_model(name, seed=1)


def functions(name):
    if name in ENCODER_DECODER:
        return autoregressive_generate_encoder_decoder, speculative_generate_encoder_decoder
    return autoregressive_generate, speculative_generate


@pytest.mark.parametrize("name", DECODER_ONLY + ENCODER_DECODER)
def test_greedy_speculative_is_token_identical_to_greedy(name):
    target, drafter = pair(name)
    ar, sd = functions(name)
    for seed in range(2):
        inputs = prompt(seed, length=8 + 9 * seed)
        free = ar(inputs, target, max_gen_len=30)
        # End tokens that fire early, late, and none (max_gen_len decides).
        for end in (free[2], free[-1], None):
            reference = ar(inputs, target, max_gen_len=30, end_tokens_id=end)
            for gamma in (1, 3, 8):
                for use_cache in (True, False) if gamma == 3 else (True,):
                    out, alpha = sd(inputs, drafter, target, gamma=gamma, max_gen_len=30, end_tokens_id=end,
                                    use_cache=use_cache)
                    assert out == reference, (name, seed, end, gamma, use_cache)
                    assert 0.0 <= alpha <= 1.0


@pytest.mark.parametrize("max_gen_len", [1, 2, 3, 7])
def test_length_budget_is_exact_at_the_boundary(max_gen_len):
    target, drafter = pair("llama")
    reference = autoregressive_generate(prompt(1), target, max_gen_len=max_gen_len)
    out, _ = speculative_generate(prompt(1), target, target, gamma=5, max_gen_len=max_gen_len)
    assert out == reference and len(out) == max_gen_len
    out, _ = speculative_generate(prompt(1), drafter, target, gamma=5, max_gen_len=max_gen_len)
    assert out == reference


@pytest.mark.parametrize("name", ["qwen2", "t5"])
def test_drafter_is_target_accepts_everything(name):
    target, _ = pair(name)
    _, sd = functions(name)
    stats = SpeculativeStats()
    out, alpha = sd(prompt(2), target, target, gamma=4, max_gen_len=31, stats=stats)
    assert alpha == 1.0
    assert stats.drafts_accepted == stats.drafts_proposed > 0
    # 31 tokens in 7 verifications (6 of gamma + 1 accepted tokens, then 1 with no room to draft).
    assert stats.steps == 7 and stats.steps_without_drafts == 1 and stats.tau == 31 / 7
    assert stats.target_forwards in (7, 8) and stats.tokens_per_target_pass == 31 / stats.target_forwards  # + prefill
    assert stats.acceptance_by_position() == [1.0] * 4
    assert stats.generated_tokens == len(out) == 31


def test_adaptive_gamma_keeps_output_and_counts_statistics(monkeypatch):
    target, drafter = pair("llama")
    reference = autoregressive_generate(prompt(3), target, max_gen_len=40)
    for branching in (1, None):  # chains; the default: trees on the steps where the costs say they pay
        # A drafter that looks nearly free until its drafting steps are timed: the policy drafts (each run
        # from its own untimed costs: the first run's timings would price the second's drafts).
        monkeypatch.setitem(calibration._COSTS, drafter, PassCosts(relative={0: 1.0, 31: 2.0}, one_token_seconds=1e-9))
        stats = SpeculativeStats()
        out, alpha = speculative_generate(prompt(3), drafter, target, gamma=2, max_gen_len=40, adaptive_gamma=True,
                                          stats=stats, branching=branching)
        assert out == reference
        assert stats.alpha == alpha
        assert stats.drafter_forwards > 0 and stats.target_forwards == stats.steps + 1  # + the prefill
        if branching == 1:  # a chain's nodes are its positions; a tree's positions are its depths
            assert sum(stats.proposed_by_position) == stats.drafts_proposed
        else:
            assert sum(stats.proposed_by_position) <= stats.drafts_proposed


def test_streaming_callback_sees_every_token_in_order():
    target, drafter = pair("gpt2")
    steps = []
    out, _ = speculative_generate(prompt(4), drafter, target, gamma=3, max_gen_len=20, on_step=steps.append)
    assert [t for s in steps for t in s.tokens] == out
    assert all(s.tokens[: s.accepted] == s.drafts[: s.accepted] for s in steps)


# Exactness of speculative sampling: the first two tokens against their exact joint distribution.

SAMPLERS = [
    MultinomialProcessor(temperature=2.0),
    TopKProcessor(temperature=2.0, top_k=4),
    NucleusProcessor(temperature=2.0, top_p=0.8),
]
INPUTS = [3, 4, 5, 3]


def close_pair():
    """A target on 8 tokens and a drafter close to it but not equal."""
    target = tiny_model("llama", vocab=8)
    drafter = copy.deepcopy(target)
    with torch.no_grad():
        drafter.lm_head.weight.add_(1.0 * torch.randn(drafter.lm_head.weight.shape, generator=torch.Generator().manual_seed(0)))
    return target, drafter


def sample_pairs(target, drafter, processor, seed=0):
    return first_two_tokens(lambda rows, generator: speculative_generate(
        rows, drafter, target, gamma=2, max_gen_len=2, logits_processor=processor, generator=generator), INPUTS, seed=seed)


@pytest.mark.slow
@pytest.mark.parametrize("processor", SAMPLERS, ids=repr)
def test_speculative_sampling_follows_the_target_distribution(processor):
    target, drafter = close_pair()
    joint = exact_two_token_distribution(target, INPUTS, processor)
    assert chi_square_p_value(sample_pairs(target, drafter, processor), joint) > P_VALUE_THRESHOLD


@pytest.mark.slow
def test_the_statistical_test_catches_a_wrong_acceptance_rule(monkeypatch):
    """Resampling from p (instead of max(0, p - q)) after a rejection is biased: the test must see it."""

    right_rows = sampling.loop.acceptance.speculative_rows

    def wrong_rows(p, starts, trees, qs, uniforms, positions):  # the batched rule, the residual replaced by p
        n, _ = right_rows(p, starts, trees, qs, uniforms, positions)
        u = torch.tensor([u_b(t + int(n_b), TARGET) for u_b, t, n_b in zip(uniforms, positions, n, strict=True)])
        return n, inverse_cdf(p[torch.tensor(starts) + n], u)

    monkeypatch.setattr(sampling.loop.acceptance, "speculative_rows", wrong_rows)
    target, drafter = close_pair()
    processor = SAMPLERS[0]
    joint = exact_two_token_distribution(target, INPUTS, processor)
    assert chi_square_p_value(sample_pairs(target, drafter, processor), joint) < P_VALUE_THRESHOLD
