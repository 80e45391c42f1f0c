import pytest
import torch

from sampling import (
    autoregressive_generate,
    autoregressive_generate_encoder_decoder,
    beam_search_generate,
)
from sampling.beam_search import gnmt_penalty
from tests.models import DECODER_ONLY, ENCODER_DECODER, prompt, tiny_model
from utils.logits_processors import NucleusProcessor, TopKProcessor
from utils.runners import SequenceRunner

FAMILIES = DECODER_ONLY + ENCODER_DECODER


def generate(name, inputs, **kwargs):
    fn = autoregressive_generate_encoder_decoder if name in ENCODER_DECODER else autoregressive_generate
    return fn(inputs, tiny_model(name), **kwargs)


def hf_greedy(name, inputs, max_new_tokens, eos=None):
    model = tiny_model(name)
    out = model.generate(
        torch.tensor([inputs]), do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=0,
        eos_token_id=eos, num_beams=1,
    )[0].tolist()
    return out[1:] if name in ENCODER_DECODER else out[len(inputs) :]


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_equals_transformers_generate(name):
    for seed in range(3):
        inputs = prompt(seed, length=10 + 7 * seed)
        assert generate(name, inputs, max_gen_len=30) == hf_greedy(name, inputs, 30)


@pytest.mark.parametrize("name", FAMILIES)
def test_end_token_that_fires(name):
    inputs = prompt(5)
    free = generate(name, inputs, max_gen_len=30)
    end = free[len(free) // 2]  # a token the model really produces, so that it fires
    ours = generate(name, inputs, max_gen_len=30, end_tokens_id=end)
    assert ours == hf_greedy(name, inputs, 30, eos=end)
    assert ours[-1] == end and end not in ours[:-1]
    # Several end tokens: the first one produced wins.
    assert generate(name, inputs, max_gen_len=30, end_tokens_id=[free[-1], end]) == ours


@pytest.mark.parametrize("name", FAMILIES)
def test_cached_equals_uncached(name):
    inputs = prompt(2)
    assert generate(name, inputs, max_gen_len=25) == generate(name, inputs, max_gen_len=25, use_cache=False)
    sampler = TopKProcessor(temperature=1.0, top_k=8)
    cached = generate(name, inputs, max_gen_len=25, logits_processor=sampler, generator=torch.Generator().manual_seed(0))
    uncached = generate(
        name, inputs, max_gen_len=25, logits_processor=sampler, use_cache=False,
        generator=torch.Generator().manual_seed(0),
    )
    assert cached == uncached


def test_sampling_with_a_generator_is_reproducible():
    kwargs = dict(max_gen_len=30, logits_processor=NucleusProcessor(temperature=1.0, top_p=0.95))
    a = generate("llama", prompt(1), generator=torch.Generator().manual_seed(7), **kwargs)
    b = generate("llama", prompt(1), generator=torch.Generator().manual_seed(7), **kwargs)
    c = generate("llama", prompt(1), generator=torch.Generator().manual_seed(8), **kwargs)
    assert a == b and a != c


@pytest.mark.parametrize("max_gen_len", [1, 2, 3])
def test_tiny_lengths(max_gen_len):
    assert len(generate("llama", prompt(0), max_gen_len=max_gen_len)) == max_gen_len


def test_generation_stops_when_the_context_is_full():
    model = tiny_model("gpt2")  # 128 positions
    inputs = prompt(0, length=120)
    assert len(autoregressive_generate(inputs, model, max_gen_len=50)) == 8


@pytest.mark.parametrize("name", DECODER_ONLY)
def test_runner_rollback_matches_a_fresh_pass(name):
    model = tiny_model(name)
    tokens = prompt(4, length=30)
    runner = SequenceRunner(model)
    runner.forward(tokens[:20])
    runner.forward(tokens[20:26], num_logits=6)
    runner.rollback(22)  # forget four positions, as after a rejected draft
    assert len(runner) == 22
    resumed = runner.forward(tokens[22:], num_logits=8)
    fresh = SequenceRunner(model, use_cache=False).forward(tokens, num_logits=8)
    torch.testing.assert_close(resumed, fresh)


# Beam search


@pytest.mark.parametrize("name", DECODER_ONLY)
def test_one_beam_of_one_candidate_is_greedy(name):
    inputs = prompt(3)
    greedy = generate(name, inputs, max_gen_len=20, end_tokens_id=7)
    beam = beam_search_generate(inputs, tiny_model(name), max_gen_len=20, end_tokens_id=7, num_beams=1, top_k=1)
    assert beam == greedy


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_beam_search_cached_equals_uncached(name):
    kwargs = dict(max_gen_len=15, end_tokens_id=[7, 9], num_beams=4, top_k=3)
    model = tiny_model(name)
    assert beam_search_generate(prompt(1), model, **kwargs) == beam_search_generate(
        prompt(1), model, use_cache=False, **kwargs
    )


def test_beam_search_with_enough_beams_finds_the_best_sequence():
    """Brute force on a vocabulary of 6: every sequence of at most 3 tokens, scored as beam search
    scores it (sum of log-probabilities / GNMT length penalty)."""
    import itertools

    vocab, max_len, end, min_length, alpha = 6, 3, 2, 5, 1.2
    model = tiny_model("llama", seed=4, vocab=vocab)
    inputs = [3, 4, 5, 3]

    def score(seq):
        with torch.no_grad():
            log_probs = model(torch.tensor([inputs + seq])).logits[0].double().log_softmax(-1)
        total = sum(float(log_probs[len(inputs) - 1 + i, t]) for i, t in enumerate(seq))
        return total / gnmt_penalty(len(seq), min_length, alpha)

    candidates = []
    for n in range(1, max_len + 1):
        for seq in map(list, itertools.product(range(vocab), repeat=n)):
            if end in seq[:-1] or (n < max_len and seq[-1] != end):
                continue
            candidates.append(seq)
    best = max(candidates, key=score)
    found = beam_search_generate(
        inputs, model, max_gen_len=max_len, end_tokens_id=end, num_beams=vocab**max_len, top_k=vocab,
        min_length=min_length, alpha=alpha,
    )
    assert found == best


def test_beam_search_takes_the_seeds_alpha_as_its_length_penalty():
    model = tiny_model("llama")
    for penalty in (0.0, 2.5):
        assert (beam_search_generate(prompt(1), model, max_gen_len=8, num_beams=3, alpha=penalty)
                == beam_search_generate(prompt(1), model, max_gen_len=8, num_beams=3, length_penalty=penalty))


@pytest.mark.parametrize("name", FAMILIES)
def test_plain_decoding_prefills_as_the_speculative_loop_on_every_runner(name):
    """The prompt's pass holds each row's last token back, whatever the runner (our own forward's static buffer,
    transformers' growing cache, a shared batch, no cache): a prompt of several tokens costs that pass, then one
    pass per new token (the first token's included); a single token (an encoder-decoder's start token), one pass
    per new token."""
    from sampling import SpeculativeStats

    decoder_only = name in DECODER_ONLY
    cases = [(prompt(1, length=9), {}), (prompt(1, length=9), {"use_cache": False}), (prompt(2, length=1), {})]
    if decoder_only:
        cases.append(([prompt(3, length=9), prompt(4, length=5)], {}))  # a batch: one shared pass each
    for inputs, kwargs in cases:
        stats = SpeculativeStats()
        out = generate(name, inputs, max_gen_len=12, end_tokens_id=None, stats=stats, **kwargs)
        rows = out if isinstance(inputs[0], list) else [out]
        assert [len(row) for row in rows] == [12] * len(rows) and stats.generated_tokens == 12 * len(rows)
        held_back = decoder_only and len(inputs[0] if isinstance(inputs[0], list) else inputs) > 1
        # The prompts' pass: one for every row over the static buffer (our own forward), one a row in a batch
        # over transformers' cache (`SharedBatchRunner` prefills row by row: tests/test_runners.py).
        prompt_passes = (len(rows) if name == "gpt2" else 1) if held_back else 0
        assert stats.target_forwards == 12 + prompt_passes, (inputs, kwargs)
