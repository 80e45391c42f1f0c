"""Bad input gets a clear error naming the argument, before any forward pass."""

import inspect

import pytest

from ngram_assisted import (
    MultiDynaGram,
    SimpleDynaGram,
    ngram_assisted_speculative_generate,
    ngram_assisted_speculative_generate_encoder_decoder,
)
from sampling import (
    autoregressive_generate,
    autoregressive_generate_encoder_decoder,
    beam_search_generate,
    speculative_generate,
    speculative_generate_encoder_decoder,
)
from tests.models import VOCAB, prompt, tiny_model
from utils.logits_processors import GreedyProcessor


@pytest.fixture
def no_forward(monkeypatch):
    """Any forward pass fails the test: the checks must come first."""
    from utils.runners.passes import ModelPasses

    def forbidden(*args, **kwargs):
        raise AssertionError("a model ran before the input was checked")

    monkeypatch.setattr(ModelPasses, "run", forbidden)  # every pass of every runner


llama = lambda: tiny_model("llama")  # noqa: E731
t5 = lambda: tiny_model("t5")  # noqa: E731

CASES = [
    ("inputs", lambda: autoregressive_generate([], llama()), ValueError),
    ("inputs", lambda: autoregressive_generate("hello", llama()), TypeError),
    ("inputs", lambda: autoregressive_generate([1, VOCAB], llama()), ValueError),
    ("inputs", lambda: autoregressive_generate([1, -1], llama()), ValueError),
    ("inputs", lambda: autoregressive_generate([1, 2.0], llama()), TypeError),
    ("max_gen_len", lambda: autoregressive_generate([1, 2], llama(), max_gen_len=0), ValueError),
    ("end_tokens_id", lambda: autoregressive_generate([1, 2], llama(), end_tokens_id="eos"), TypeError),
    ("end_tokens_id", lambda: autoregressive_generate([1, 2], llama(), end_tokens_id=[VOCAB + 3]), ValueError),
    ("logits_processor", lambda: autoregressive_generate([1, 2], llama(), logits_processor="greedy"), TypeError),
    ("encoder-decoder", lambda: autoregressive_generate([1, 2], t5()), ValueError),
    ("decoder-only", lambda: autoregressive_generate_encoder_decoder([1, 2], llama()), ValueError),
    ("context", lambda: autoregressive_generate(prompt(0, length=300), llama()), ValueError),
    ("num_beams", lambda: beam_search_generate([1, 2], llama(), num_beams=0), ValueError),
    ("top_k", lambda: beam_search_generate([1, 2], llama(), top_k=0), ValueError),
    ("decoder-only models", lambda: beam_search_generate([1, 2], t5()), ValueError),
    ("gamma", lambda: speculative_generate([1, 2], llama(), llama(), gamma=0), ValueError),
    ("drafter", lambda: speculative_generate([1, 2], t5(), llama()), ValueError),
    ("decoder-only", lambda: speculative_generate_encoder_decoder([1, 2], llama(), llama()), ValueError),
    ("vocabularies", lambda: speculative_generate([1, 2], tiny_model("llama", vocab=300), llama()), ValueError),
    ("gamma", lambda: ngram_assisted_speculative_generate([1, 2], MultiDynaGram(3), llama(), gamma=0), ValueError),
    ("top_k_filler", lambda: ngram_assisted_speculative_generate([1, 2], MultiDynaGram(3), llama(), top_k_filler=0), ValueError),
    ("top_k_filler", lambda: ngram_assisted_speculative_generate([1, 2], MultiDynaGram(3), llama(), top_k_filler=VOCAB + 1), ValueError),
    ("ngram", lambda: ngram_assisted_speculative_generate([1, 2], {}, llama()), TypeError),
    ("n must", lambda: SimpleDynaGram(1), ValueError),
    ("n must", lambda: MultiDynaGram(0), ValueError),
]


@pytest.mark.parametrize("needle,call,error", CASES, ids=[f"{i}-{c[0]}" for i, c in enumerate(CASES)])
def test_bad_input_raises_a_clear_error_before_any_forward(no_forward, needle, call, error):
    with pytest.raises(error) as info:
        call()
    assert needle in str(info.value)


def test_a_pool_refuses_a_second_vocabulary():
    pool = MultiDynaGram(3)
    ngram_assisted_speculative_generate(prompt(0), pool, tiny_model("llama"), max_gen_len=3)
    with pytest.raises(ValueError, match="vocabulary"):
        ngram_assisted_speculative_generate([1, 2, 3], pool, tiny_model("llama", vocab=300), max_gen_len=3)
    pool.reset()
    ngram_assisted_speculative_generate([1, 2, 3], pool, tiny_model("llama", vocab=300), max_gen_len=3)


def test_padded_drafter_vocabulary_is_accepted():
    # Same tokenizer, embedding padded by 4 rows: compared on the shared part.
    target, drafter = tiny_model("llama", vocab=400), tiny_model("llama", seed=1, vocab=404)
    out, _ = speculative_generate(prompt(0, vocab=400), drafter, target, max_gen_len=10)
    assert out == autoregressive_generate(prompt(0, vocab=400), target, max_gen_len=10, logits_processor=GreedyProcessor())


# transformers habits: its generate() argument names get what this library calls them.

PUBLIC_FUNCTIONS = [autoregressive_generate, autoregressive_generate_encoder_decoder, beam_search_generate,
                    speculative_generate, speculative_generate_encoder_decoder, ngram_assisted_speculative_generate,
                    ngram_assisted_speculative_generate_encoder_decoder]
HABITS = [("max_new_tokens", 20, "max_gen_len"), ("eos_token_id", 2, "end_tokens_id"),
          ("do_sample", True, "logits_processor"), ("temperature", 0.7, "logits_processor"),
          ("top_p", 0.9, "logits_processor"), ("assistant_model", None, "drafter"), ("input_ids", [1, 2], "inputs"),
          ("streamer", None, "on_step")]


@pytest.mark.parametrize("function", PUBLIC_FUNCTIONS, ids=lambda f: f.__name__)
def test_transformers_argument_names_say_what_this_library_calls_them(no_forward, function):
    for name, value, ours in HABITS:
        with pytest.raises(TypeError, match=rf"{function.__name__}\(\) got {name}=, transformers' name: this "
                                            rf"library calls it {ours}"):
            function([1, 2], llama(), **{name: value})
    top_k = "top_k" in inspect.signature(function).parameters  # beam search's own top_k stays its own
    assert top_k == (function is beam_search_generate)
    if not top_k:
        with pytest.raises(TypeError, match="calls it logits_processor"):
            function([1, 2], llama(), top_k=5)
    num_beams = "num_beams" in inspect.signature(function).parameters
    if not num_beams:
        with pytest.raises(TypeError, match="beam_search_generate"):
            function([1, 2], llama(), num_beams=4)
    if "kind_options" not in inspect.signature(function).parameters:
        with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_name'"):  # Python's own, unchanged
            function([1, 2], llama(), no_such_name=1)
        return
    # A speculative function routes the keywords it does not list to the drafter's kind: one no kind
    # takes is refused by name, before any model runs.
    drafter = MultiDynaGram(2) if function.__name__.startswith("ngram") else llama()
    target = t5() if function.__name__.endswith("encoder_decoder") else llama()
    with pytest.raises(TypeError, match=r"_generate\(\) got an unexpected keyword argument 'no_such_name': "
                                        r"no drafter kind takes it"):
        function([1, 2], drafter, target, no_such_name=1)
