"""Seeded sampling that speculation cannot change: with the same generator seed, NASD (chains and
trees, any gamma, branching, cost table) returns the very tokens of plain sampling, and every
method reproduces itself (random numbers belong to positions, `sampling.loop.randomness`)."""

import pytest
import torch
from transformers import GenerationConfig

from ngram_assisted import (
    MultiDynaGram,
    SimpleDynaGram,
    ngram_assisted_speculative_generate,
    ngram_assisted_speculative_generate_encoder_decoder,
)
from sampling import (
    SpeculativeStats,
    autoregressive_generate,
    autoregressive_generate_encoder_decoder,
    speculative_generate,
    speculative_generate_encoder_decoder,
)
from sampling.loop.randomness import CHUNK, PositionUniforms, inverse_cdf
from tests.models import DECODER_ONLY, ENCODER_DECODER, prompt, tiny_model
from utils.logits_processors import (
    MultinomialProcessor,
    NucleusProcessor,
    TopKNucleusProcessor,
    TopKProcessor,
    TransformersProcessor,
)

PROCESSORS = [
    MultinomialProcessor(temperature=0.8),
    TopKProcessor(temperature=0.9, top_k=5),
    NucleusProcessor(temperature=0.9, top_p=0.8),
    TopKNucleusProcessor(temperature=0.7, top_k=10, top_p=0.9),
    TransformersProcessor.from_generation_config(GenerationConfig(do_sample=True, temperature=0.8, min_p=0.05)),
    TransformersProcessor.from_generation_config(
        GenerationConfig(do_sample=True, repetition_penalty=1.3, top_k=20, no_repeat_ngram_size=3)),
]


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def cheap(k: int) -> float:
    """A cost table under which every draft pays."""
    return 1.0 + 0.01 * k


def dear(k: int) -> float:
    """Another table: drafts rarely pay."""
    return 1.0 + 0.9 * k


def repeating_prompt(seed: int) -> list[int]:
    """A prompt that repeats itself, so the pool has plenty to draft (and is often wrong)."""
    return prompt(seed, length=6) * 3


def test_inverse_cdf_samples_the_distribution_and_never_a_zero():
    probs = torch.tensor([0.0, 0.25, 0.0, 0.5, 0.25, 0.0])
    u = torch.linspace(0, 1, 10001)[:-1]
    tokens = inverse_cdf(probs.expand(len(u), -1), u)
    assert torch.bincount(tokens, minlength=6).tolist() == [0, 2500, 0, 5000, 2500, 0]
    assert int(inverse_cdf(probs, 1.0 - 1e-17)) == 4  # u * total rounding up: the last token with mass


def test_position_numbers_do_not_depend_on_how_they_are_read():
    a, b = PositionUniforms(seeded(3)), PositionUniforms(seeded(3))
    late = a(2 * CHUNK + 5)  # reading far ahead first...
    assert [b(t) for t in range(2 * CHUNK + 6)][-1] == late  # ...or in order: the same number
    assert a.span(0, 4, 1).tolist() == b.span(0, 4, 1).tolist()


@pytest.mark.parametrize("name", DECODER_ONLY)
def test_nasd_sampling_returns_the_tokens_of_plain_sampling(name):
    model = tiny_model(name)
    for seed, processor in enumerate(PROCESSORS):
        inputs = repeating_prompt(seed)
        plain = autoregressive_generate(inputs, model, max_gen_len=24, logits_processor=processor, generator=seeded(seed))
        for pool, branching, stop_if_unknown, gamma, cost in [
            (MultiDynaGram(3), None, True, 8, cheap),   # trees where the cost model keeps them
            (MultiDynaGram(3), 1, True, 4, dear),       # chains, cut by another cost table
            (SimpleDynaGram(2), 3, False, 6, None),     # wide trees, no cut, the measured table
            (MultiDynaGram(4), 1, False, 1, None),      # one draft a step
        ]:
            out, _ = ngram_assisted_speculative_generate(
                inputs, pool, model, gamma=gamma, max_gen_len=24, logits_processor=processor, generator=seeded(seed),
                branching=branching, stop_if_unknown=stop_if_unknown, draft_cost=cost)
            assert out == plain, (name, processor, branching, stop_if_unknown, gamma)


@pytest.mark.parametrize("name", ENCODER_DECODER)
def test_encoder_decoder_nasd_sampling_returns_the_tokens_of_plain_sampling(name):
    model = tiny_model(name)
    for seed, processor in enumerate(PROCESSORS[:4]):
        inputs = repeating_prompt(seed)
        plain = autoregressive_generate_encoder_decoder(inputs, model, max_gen_len=20, logits_processor=processor,
                                                        generator=seeded(seed))
        out, _ = ngram_assisted_speculative_generate_encoder_decoder(
            inputs, MultiDynaGram(3), model, gamma=4, max_gen_len=20, logits_processor=processor, generator=seeded(seed),
            stop_if_unknown=False)
        assert out == plain, (name, processor)


def test_a_pool_that_knows_more_and_a_changed_cost_table_change_nothing():
    model = tiny_model("llama")
    processor = NucleusProcessor(temperature=1.0, top_p=0.95)
    inputs = repeating_prompt(7)
    plain = autoregressive_generate(inputs, model, max_gen_len=30, logits_processor=processor, generator=seeded(11))
    pool = MultiDynaGram(3)
    outputs = []
    for cost in (cheap, dear, cheap):  # the pool learns from every run; the table changes between runs
        out, _ = ngram_assisted_speculative_generate(inputs, pool, model, gamma=6, max_gen_len=30, logits_processor=processor,
                                                     generator=seeded(11), draft_cost=cost)
        outputs.append(out)
    assert outputs == [plain] * 3


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_a_pool_that_knows_the_answer_is_accepted_and_changes_nothing(name):
    """Taught the very output of plain sampling, the pool drafts the tokens the coupled rule emits:
    long drafts are accepted, and the output is still plain sampling's."""
    model = tiny_model(name)
    processor = MultinomialProcessor(temperature=1.0)
    inputs = prompt(5)
    plain = autoregressive_generate(inputs, model, max_gen_len=30, logits_processor=processor, generator=seeded(2))
    for branching in (1, 3):
        pool, stats = MultiDynaGram(4), SpeculativeStats()
        pool.fill(inputs + plain)
        out, _ = ngram_assisted_speculative_generate(inputs, pool, model, gamma=8, max_gen_len=30, logits_processor=processor,
                                                     generator=seeded(2), branching=branching, draft_cost=cheap, stats=stats)
        assert out == plain
        assert stats.drafts_accepted >= len(plain) // 2, (branching, stats)


def test_the_global_generator_reproduces_with_manual_seed():
    model = tiny_model("qwen2")
    processor = MultinomialProcessor(temperature=1.2)
    inputs = repeating_prompt(1)
    torch.manual_seed(5)
    plain = autoregressive_generate(inputs, model, max_gen_len=20, logits_processor=processor)
    torch.manual_seed(5)
    out, _ = ngram_assisted_speculative_generate(inputs, MultiDynaGram(3), model, max_gen_len=20, logits_processor=processor,
                                                 stop_if_unknown=False)
    assert out == plain


def test_speculative_sampling_with_a_model_drafter_reproduces_itself():
    target, drafter = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    processor = TopKProcessor(temperature=1.0, top_k=20)
    inputs = prompt(4)
    runs = [speculative_generate(inputs, drafter, target, gamma=3, max_gen_len=24, logits_processor=processor,
                                 generator=seeded(9))[0] for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    other = speculative_generate(inputs, drafter, target, gamma=3, max_gen_len=24, logits_processor=processor,
                                 generator=seeded(10))[0]
    assert other != runs[0]  # the seed matters


def test_encoder_decoder_speculative_sampling_reproduces_itself():
    target, drafter = tiny_model("t5", seed=0), tiny_model("t5", seed=1)
    processor = MultinomialProcessor(temperature=1.0)
    runs = [speculative_generate_encoder_decoder(prompt(2), drafter, target, gamma=2, max_gen_len=16,
                                                 logits_processor=processor, generator=seeded(4))[0] for _ in range(2)]
    assert runs[0] == runs[1]
