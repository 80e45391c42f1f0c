"""transformers' logits processors in every decoding function: the same tokens as `generate` with the
same processors (greedy), the exact law under speculative sampling, user subclasses, clear errors."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    GenerationConfig,
    LogitsProcessorList,
    MinPLogitsWarper,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
)
from transformers import LogitsProcessor as HFLogitsProcessor

from ngram_assisted import (
    MultiDynaGram,
    ngram_assisted_speculative_generate,
    ngram_assisted_speculative_generate_encoder_decoder,
)
from sampling import (
    autoregressive_generate,
    autoregressive_generate_encoder_decoder,
    speculative_generate,
    speculative_generate_encoder_decoder,
)
from tests.models import prompt, tiny_model
from tests.stats_helpers import P_VALUE_THRESHOLD, chi_square_p_value, exact_two_token_distribution, first_two_tokens
from utils.logits_processors import NucleusProcessor, TransformersProcessor


def history_processors():
    return [RepetitionPenaltyLogitsProcessor(3.0), NoRepeatNGramLogitsProcessor(2)]


def hf_generate(model, inputs, processors, max_new_tokens, encoder_decoder=False):
    ids = torch.tensor([inputs])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                         logits_processor=LogitsProcessorList(processors), eos_token_id=2, pad_token_id=0)
    start = 1 if encoder_decoder else len(inputs)  # the decoder start token / the prompt
    return out[0, start:].tolist()


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_greedy_equals_generate_with_the_same_processors(name):
    target, drafter = tiny_model(name), tiny_model(name, seed=1)
    inputs = prompt(0, length=10) * 2  # repeats: the penalties matter and the pool drafts
    expected = hf_generate(target, inputs, history_processors(), 24)
    processor = TransformersProcessor(history_processors(), do_sample=False)
    common = dict(max_gen_len=24, end_tokens_id=2, logits_processor=processor)
    assert autoregressive_generate(inputs, target, **common) == expected
    assert speculative_generate(inputs, drafter, target, gamma=3, **common)[0] == expected
    assert speculative_generate(inputs, target, target, gamma=3, **common)[0] == expected  # drafts all accepted
    assert ngram_assisted_speculative_generate(inputs, MultiDynaGram(3), target, stop_if_unknown=False, **common)[0] == expected
    assert autoregressive_generate(inputs, target, max_gen_len=24, end_tokens_id=2) != expected  # the processors matter


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_encoder_decoder_processors_see_the_decoders_ids(name):
    target, drafter = tiny_model(name), tiny_model(name, seed=1)
    inputs = prompt(1, length=10)
    expected = hf_generate(target, inputs, history_processors(), 16, encoder_decoder=True)
    processor = TransformersProcessor(history_processors(), do_sample=False)
    common = dict(max_gen_len=16, end_tokens_id=2, logits_processor=processor)
    assert autoregressive_generate_encoder_decoder(inputs, target, **common) == expected
    assert speculative_generate_encoder_decoder(inputs, drafter, target, gamma=3, **common)[0] == expected
    assert ngram_assisted_speculative_generate_encoder_decoder(inputs, MultiDynaGram(3), target, **common)[0] == expected


class BanToken(HFLogitsProcessor):
    """A user's own processor: token 7 never comes, and nothing after a 5 repeats the 5."""

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[:, 7] = -float("inf")
        scores[input_ids[:, -1] == 5, 5] = -float("inf")
        return scores


def test_a_custom_subclass_works_everywhere():
    target = tiny_model("qwen2")
    inputs = prompt(2, length=12)
    expected = hf_generate(target, inputs, [BanToken()], 30)
    processor = TransformersProcessor([BanToken()], do_sample=False)
    out, _ = ngram_assisted_speculative_generate(inputs, MultiDynaGram(3), target, max_gen_len=30, end_tokens_id=2,
                                                 logits_processor=processor)
    assert out == expected and 7 not in out


INPUTS = [3, 4, 5, 3]  # the pool proposes 4 after 3: drafts are verified under the processors


def sampling_processor():
    return TransformersProcessor([RepetitionPenaltyLogitsProcessor(1.3), TemperatureLogitsWarper(1.5),
                                  MinPLogitsWarper(0.05)], do_sample=True)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["plain", "speculative", "nasd"])
def test_sampling_follows_the_exact_law_of_the_processed_distribution(method):
    target, drafter = tiny_model("llama", vocab=8), tiny_model("llama", seed=1, vocab=8)
    processor = sampling_processor()

    def generate(rows, generator):
        common = dict(max_gen_len=2, logits_processor=processor, generator=generator)
        if method == "plain":
            return autoregressive_generate(rows, target, **common)
        if method == "speculative":
            return speculative_generate(rows, drafter, target, gamma=2, **common)
        return ngram_assisted_speculative_generate(rows, [MultiDynaGram(2) for _ in rows], target, gamma=2,
                                                   stop_if_unknown=False, **common)

    pairs = first_two_tokens(generate, INPUTS)
    joint = exact_two_token_distribution(target, INPUTS, processor)
    assert chi_square_p_value(pairs, joint) > P_VALUE_THRESHOLD


def test_from_generation_config_builds_what_generate_builds():
    config = GenerationConfig(repetition_penalty=1.2, no_repeat_ngram_size=3, do_sample=True, temperature=0.7,
                              top_k=20, top_p=0.9, min_p=0.05)
    processor = TransformersProcessor.from_generation_config(config)
    names = [type(p).__name__ for p in processor.processors]
    assert names == ["RepetitionPenaltyLogitsProcessor", "NoRepeatNGramLogitsProcessor", "TemperatureLogitsWarper",
                     "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper"]
    assert not processor.is_greedy
    greedy = TransformersProcessor.from_generation_config(GenerationConfig(repetition_penalty=1.2, temperature=0.7))
    assert greedy.is_greedy and [type(p).__name__ for p in greedy.processors] == ["RepetitionPenaltyLogitsProcessor"]


def test_processors_leave_their_input_untouched():
    logits = torch.randn(3, 8, dtype=torch.float64)
    before = logits.clone()
    processor = sampling_processor()
    probs = processor(logits, [1, 2, 3, 4, 5])
    assert torch.equal(logits, before) and torch.allclose(probs.sum(-1), torch.ones(3, dtype=torch.float64))
    # Each row gets its own prefix: the penalty of row 2 sees token 5, row 0 does not.
    rows = TransformersProcessor([RepetitionPenaltyLogitsProcessor(2.0)], do_sample=False).scores(
        torch.ones(3, 8), [1, 2, 3, 4, 5])
    assert rows[0, 5] == 1.0 and rows[2, 5] == 0.5 and rows[1, 4] == 0.5 and rows[0, 4] == 1.0


def test_bad_input_is_explained():
    with pytest.raises(TypeError, match=r"processors\[1\]"):
        TransformersProcessor([RepetitionPenaltyLogitsProcessor(1.2), "min_p"], do_sample=False)
    with pytest.raises(TypeError, match="do_sample"):
        TransformersProcessor([], do_sample="yes")
    with pytest.raises(TypeError, match="LogitsProcessorList"):
        TransformersProcessor({"penalty": 1.2}, do_sample=False)
    model = tiny_model("llama")
    with pytest.raises(TypeError, match="TransformersProcessor"):
        autoregressive_generate(prompt(0), model, logits_processor=LogitsProcessorList(history_processors()))
    with pytest.raises(ValueError, match="history"):
        TransformersProcessor(history_processors(), do_sample=False)(torch.zeros(1, 8))
    # The library's own processors ignore the history: unchanged.
    logits = torch.randn(2, 8)
    assert torch.equal(NucleusProcessor(0.7, 0.9)(logits), NucleusProcessor(0.7, 0.9)(logits, [1, 2]))
