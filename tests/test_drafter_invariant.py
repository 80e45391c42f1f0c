"""Drafter-invariant sampling for model drafters (`drafter_invariant=`): the drafter drafts with the
target's own uniform of each position and a draft is accepted iff the target samples it there, so
the output is plain seeded sampling's, whatever gamma, adaptive_gamma, timings or cost tables chose."""

import copy

import pytest
import torch
from transformers import GenerationConfig

from sampling import (
    SpeculativeStats,
    autoregressive_generate,
    autoregressive_generate_encoder_decoder,
    speculative_generate,
    speculative_generate_encoder_decoder,
)
from tests.models import prompt, tiny_model
from tests.stats_helpers import P_VALUE_THRESHOLD, chi_square_p_value, exact_two_token_distribution, first_two_tokens
from utils.calibration import pass_costs
from utils.logits_processors import MultinomialProcessor, NucleusProcessor, TopKProcessor, TransformersProcessor

PROCESSORS = [
    NucleusProcessor(temperature=0.7, top_p=0.9),
    TopKProcessor(temperature=1.0, top_k=20),
    TransformersProcessor.from_generation_config(GenerationConfig(do_sample=True, repetition_penalty=1.3, top_k=20)),
]


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def near_copy(model, scale: float = 0.02, seed: int = 0):
    """`model` with small noise on every weight: a drafter whose q is close to p (drafts accepted often)."""
    torch.manual_seed(seed)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for weight in twin.parameters():
            weight.add_(scale * torch.randn_like(weight))
    return twin


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_every_gamma_returns_the_tokens_of_plain_sampling(name):
    target = tiny_model(name)
    drafter = near_copy(target)
    for seed, processor in enumerate(PROCESSORS):
        inputs = prompt(seed)
        plain = autoregressive_generate(inputs, target, max_gen_len=24, logits_processor=processor, generator=seeded(seed))
        stats = SpeculativeStats()
        for gamma, adaptive in [(1, False), (3, False), (6, False), (4, True)]:
            out, alpha = speculative_generate(inputs, drafter, target, gamma=gamma, max_gen_len=24, logits_processor=processor,
                                              generator=seeded(seed), adaptive_gamma=adaptive, drafter_invariant=True,
                                              stats=stats)
            assert out == plain, (name, processor, gamma, adaptive)
            assert 0.0 <= alpha <= 1.0
        assert stats.drafts_accepted > 0  # drafts were really decided, not only plain steps


def test_adaptive_gamma_reproduces_plain_sampling_whatever_the_cost_table():
    """The default with adaptive_gamma is drafter-invariant: the draft lengths follow the measured
    (here: rewritten) cost tables and the drafter's timings, and the tokens stay plain sampling's."""
    target = tiny_model("qwen2")
    drafter = near_copy(target, seed=1)
    processor = NucleusProcessor(temperature=0.7, top_p=0.9)
    inputs = prompt(3)
    plain = autoregressive_generate(inputs, target, max_gen_len=30, logits_processor=processor, generator=seeded(5))
    target_costs, drafter_costs = pass_costs(target), pass_costs(drafter)
    saved = (dict(target_costs.relative), target_costs.one_token_seconds, drafter_costs.one_token_seconds)
    tables = [({k: 1.0 + 0.01 * k for k in (0, 1, 2, 4, 8, 16, 32)}, 1.0, 0.01),  # drafting nearly free
              ({k: 1.0 + 0.5 * k for k in (0, 1, 2, 4, 8, 16, 32)}, 1.0, 0.3),   # drafts dear
              ({k: 1.0 + 0.05 * k for k in (0, 1, 2, 4, 8, 16, 32)}, 1.0, 0.05)]
    try:
        proposed = []
        for relative, target_seconds, drafter_seconds in tables:
            target_costs.relative, target_costs.one_token_seconds = relative, target_seconds
            drafter_costs.one_token_seconds = drafter_seconds
            target_costs._online.clear()
            target_costs._batches.clear()
            stats = SpeculativeStats()
            out, _ = speculative_generate(inputs, drafter, target, gamma=4, max_gen_len=30, logits_processor=processor,
                                          generator=seeded(5), adaptive_gamma=True, stats=stats)
            assert out == plain
            proposed.append(stats.drafts_proposed)
        assert max(proposed) > 0
    finally:
        target_costs.relative, target_costs.one_token_seconds, drafter_costs.one_token_seconds = saved
        target_costs._online.clear()


def test_a_batch_with_one_generator_per_row_gives_each_rows_plain_sampling():
    target = tiny_model("llama")
    drafter = near_copy(target, seed=2)
    processor = NucleusProcessor(temperature=0.7, top_p=0.9)
    rows = [prompt(0, length=8), prompt(1, length=15), prompt(2, length=5)]
    seeds = [3, 4, 5]
    single = [autoregressive_generate(row, target, max_gen_len=20, logits_processor=processor, generator=seeded(s))
              for row, s in zip(rows, seeds, strict=True)]
    for adaptive in (False, True):
        batch = speculative_generate(rows, drafter, target, gamma=3, max_gen_len=20, logits_processor=processor,
                                     generator=[seeded(s) for s in seeds], adaptive_gamma=adaptive, drafter_invariant=True)
        assert [out for out, _ in batch] == single, adaptive


def test_encoder_decoder_returns_the_tokens_of_plain_sampling():
    target = tiny_model("t5")
    drafter = near_copy(target, seed=3)
    processor = MultinomialProcessor(temperature=0.8)
    inputs = prompt(2)
    plain = autoregressive_generate_encoder_decoder(inputs, target, max_gen_len=16, logits_processor=processor,
                                                    generator=seeded(4))
    for gamma in (1, 4):
        out, _ = speculative_generate_encoder_decoder(inputs, drafter, target, gamma=gamma, max_gen_len=16,
                                                      logits_processor=processor, generator=seeded(4), drafter_invariant=True)
        assert out == plain, gamma


def test_the_option_is_checked():
    target = tiny_model("llama")
    with pytest.raises(TypeError, match="drafter_invariant must be a bool or None"):
        speculative_generate(prompt(0), target, target, drafter_invariant="yes")




@pytest.mark.slow
def test_drafter_invariant_sampling_follows_the_targets_law():
    target = tiny_model("llama", vocab=8)
    drafter = tiny_model("llama", seed=1, vocab=8)
    processor = MultinomialProcessor(temperature=2.0)
    inputs = [3, 4, 5, 3]
    samples = first_two_tokens(lambda rows, generator: speculative_generate(
        rows, drafter, target, gamma=2, max_gen_len=2, logits_processor=processor, generator=generator,
        drafter_invariant=True), inputs)
    joint = exact_two_token_distribution(target, inputs, processor)
    assert chi_square_p_value(samples, joint) > P_VALUE_THRESHOLD
