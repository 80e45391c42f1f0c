"""generate's habits in every decoding function, exact under speculation: keyword-only parameters,
the model's end tokens by default, stop strings and stopping criteria (a speculative call stops where
plain decoding stops), num_return_sequences (a batch of copies), logprobs (the target's raw logits,
log-softmaxed), and the checks of each, before any model runs."""

from __future__ import annotations

import copy

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, StoppingCriteria, StoppingCriteriaList

from ngram_assisted import (
    MultiDynaGram,
    ngram_assisted_speculative_generate,
    ngram_assisted_speculative_generate_encoder_decoder,
)
from sampling import (
    SpeculativeStats,
    autoregressive_generate,
    autoregressive_generate_encoder_decoder,
    beam_search_generate,
    speculative_generate,
    speculative_generate_encoder_decoder,
)
from tests.models import VOCAB, prompt, tiny_model
from tests.saved_model import SPECIALS
from tests.test_drafter_invariant import near_copy
from tests.test_validation import no_forward  # noqa: F401  (a fixture)
from utils.logits_processors import GreedyProcessor, MultinomialProcessor, TopKProcessor

FAMILIES = ["llama", "gpt2"]


def word_tokenizer(vocab: int = VOCAB) -> PreTrainedTokenizerFast:
    """A word-level tokenizer of the tiny models' vocabulary: token i is "w{i}" (the specials first; the
    last is "abcdef", which transformers' StopStringCriteria encodes to learn how tokens join)."""
    words = {token: i for i, token in enumerate(SPECIALS)}
    words.update({f"w{i}": i for i in range(len(SPECIALS), vocab - 1)})
    words["abcdef"] = vocab - 1
    backend = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


def drafter_for(target):
    return near_copy(target, scale=0.05)  # accepts often: stops fall inside accepted blocks


def every_method(target, drafter, ids, **kwargs):
    """Plain, speculative (a drafter model; the target itself, every draft accepted) and NASD outputs."""
    plain = autoregressive_generate(ids, target, **kwargs)
    sd, _ = speculative_generate(ids, drafter, target, gamma=4, **kwargs)
    self_sd, _ = speculative_generate(ids, target, target, gamma=5, **kwargs)
    nasd, _ = ngram_assisted_speculative_generate(ids, MultiDynaGram(3), target, gamma=6, **kwargs)
    return plain, sd, self_sd, nasd


class StopAt(StoppingCriteria):
    """Stops once `token` is generated; records the ids it was called with."""

    def __init__(self, token: int, prompt_length: int) -> None:
        self.token, self.prompt_length, self.calls = token, prompt_length, []

    def __call__(self, input_ids, scores, **kwargs):
        assert input_ids.dtype == torch.long and input_ids.shape[0] == 1
        assert scores is not None and scores[-1].shape == (1, VOCAB)
        self.calls.append(input_ids[0].tolist())
        return torch.tensor([self.token in input_ids[0, self.prompt_length :].tolist()])


# Keyword-only parameters.

@pytest.mark.parametrize("call", [
    lambda m, ids: autoregressive_generate(ids, m, True),
    lambda m, ids: beam_search_generate(ids, m, 10),
    lambda m, ids: speculative_generate(ids, m, m, 2),
    lambda m, ids: ngram_assisted_speculative_generate(ids, MultiDynaGram(3), m, None, 4),
])
def test_a_parameter_after_the_models_passed_by_position_is_a_type_error(no_forward, call):  # noqa: F811
    with pytest.raises(TypeError, match="positional"):
        call(tiny_model("llama"), prompt(0))


@pytest.mark.parametrize("call", [
    lambda m, ids: autoregressive_generate_encoder_decoder(ids, m, True),
    lambda m, ids: speculative_generate_encoder_decoder(ids, m, m, 2),
    lambda m, ids: ngram_assisted_speculative_generate_encoder_decoder(ids, MultiDynaGram(3), m, None),
])
def test_the_encoder_decoder_names_are_keyword_only_too(no_forward, call):  # noqa: F811
    with pytest.raises(TypeError, match="positional"):
        call(tiny_model("t5"), prompt(0))


# End tokens: the model's by default, none with an explicit None.

@pytest.mark.parametrize("name", FAMILIES)
def test_end_tokens_left_out_are_the_models_eos_and_none_means_none(name):
    target = copy.deepcopy(tiny_model(name))  # the cached model stays without an eos
    ids = prompt(2)
    full = autoregressive_generate(ids, target, max_gen_len=24)
    assert len(full) == 24  # no eos in this model's generation config
    first, second = full[9], full[5]
    target.generation_config.eos_token_id = [first, second]  # all of them, when a list
    cut = next(i for i, token in enumerate(full) if token in (first, second)) + 1
    assert cut < len(full)
    drafter = drafter_for(target)
    for out in every_method(target, drafter, ids, max_gen_len=24):
        assert out == full[:cut]
    assert beam_search_generate(ids, target, max_gen_len=24) == beam_search_generate(
        ids, target, max_gen_len=24, end_tokens_id=[first, second])
    for out in every_method(target, drafter, ids, max_gen_len=24, end_tokens_id=None):
        assert out == full  # an explicit None: only max_gen_len stops


# Stopping criteria and stop strings: plain decoding's stop, under speculation too.

@pytest.mark.parametrize("name", FAMILIES)
def test_a_stopping_criterion_stops_every_method_where_plain_decoding_stops(name):
    target = tiny_model(name)
    drafter = drafter_for(target)
    ids = prompt(3)
    full = autoregressive_generate(ids, target, max_gen_len=30)
    token = full[11]
    expected = full[: full.index(token) + 1]
    criterion = StopAt(token, len(ids))
    outs = every_method(target, drafter, ids, max_gen_len=30, logits_processor=GreedyProcessor(),
                        stopping_criteria=StoppingCriteriaList([criterion]))
    assert len(expected) < len(full) and all(out == expected for out in outs)
    # Plain decoding's calls, each with the prompt and the tokens so far, once per token.
    plain = StopAt(token, len(ids))
    autoregressive_generate(ids, target, max_gen_len=30, stopping_criteria=[plain])
    assert plain.calls == [ids + expected[: j + 1] for j in range(len(expected))]
    speculative = StopAt(token, len(ids))
    speculative_generate(ids, target, target, gamma=5, max_gen_len=30, stopping_criteria=speculative)
    assert speculative.calls == plain.calls  # every draft accepted: the stop fell inside a block and cut there


@pytest.mark.parametrize("name", FAMILIES)
def test_stop_strings_stop_every_method_where_plain_decoding_stops(name):
    target, tokenizer = tiny_model(name), word_tokenizer()
    drafter = drafter_for(target)
    ids = prompt(4)
    full = autoregressive_generate(ids, target, max_gen_len=30)
    stop = tokenizer.convert_ids_to_tokens(full[8])
    plain, *speculative = every_method(target, drafter, ids, max_gen_len=30, tokenizer=tokenizer,
                                       stop_strings=[stop, "never-in-the-text"])
    assert 0 < len(plain) <= 9 and plain == full[: len(plain)]
    assert stop in "".join(tokenizer.convert_ids_to_tokens(plain))
    assert all(out == plain for out in speculative)
    beams = beam_search_generate(ids, target, max_gen_len=30, tokenizer=tokenizer, stop_strings=stop)
    assert stop in "".join(tokenizer.convert_ids_to_tokens(beams)) or len(beams) == 30  # finished: a stop or the end


def test_sampled_outputs_with_a_stop_are_the_seeded_outputs_cut_there():
    target = tiny_model("llama")
    ids, processor = prompt(5), MultinomialProcessor(temperature=1.5)
    def seeded(**kwargs):
        return ngram_assisted_speculative_generate(ids, MultiDynaGram(3), target, max_gen_len=25, logits_processor=processor,
                                                   generator=torch.Generator().manual_seed(7), **kwargs)[0]
    full = seeded()
    plain = autoregressive_generate(ids, target, max_gen_len=25, logits_processor=processor,
                                    generator=torch.Generator().manual_seed(7))
    assert full == plain  # NASD sampling with a seed is plain seeded sampling (docs/seeds.md)
    token = full[10]
    assert seeded(stopping_criteria=[StopAt(token, len(ids))]) == full[: full.index(token) + 1]


def test_an_encoder_decoder_criterion_sees_the_decoders_ids():
    target = tiny_model("t5")
    full = autoregressive_generate_encoder_decoder(prompt(6), target, max_gen_len=12)
    criterion = StopAt(full[4], 1)  # the decoder's ids: its start token, then the generated tokens
    out, _ = speculative_generate_encoder_decoder(prompt(6), target, target, max_gen_len=12, stopping_criteria=criterion)
    assert out == full[: full.index(full[4]) + 1]
    assert criterion.calls[-1] == [target.config.decoder_start_token_id, *out]


def test_a_beam_that_meets_a_stopping_criterion_is_finished():
    target, ids = tiny_model("llama"), prompt(7)
    best = beam_search_generate(ids, target, max_gen_len=12, end_tokens_id=None)
    stopped = beam_search_generate(ids, target, max_gen_len=12, end_tokens_id=None,
                                   stopping_criteria=lambda input_ids, scores: best[2] in input_ids[0, len(ids):])
    assert stopped == beam_search_generate(ids, target, max_gen_len=12, end_tokens_id=best[2])


# num_return_sequences: what a batch of copies returns.

@pytest.mark.parametrize("name", FAMILIES)
def test_num_return_sequences_returns_what_a_batch_of_copies_returns(name):
    target = tiny_model(name)
    drafter = drafter_for(target)
    processor, n = TopKProcessor(temperature=1.5, top_k=20), 3
    seeded = lambda: torch.Generator().manual_seed(11)  # noqa: E731
    common = dict(max_gen_len=10, logits_processor=processor)
    one, batch = prompt(8), [prompt(8), prompt(9)]
    cases = [
        (lambda x, **k: autoregressive_generate(x, target, **common, **k)),
        (lambda x, **k: speculative_generate(x, drafter, target, gamma=3, **common, **k)),
        (lambda x, **k: ngram_assisted_speculative_generate(x, MultiDynaGram(3), target, **common, **k)),
    ]
    # The tokens (alpha may differ: whether a step drafts follows the measured costs, as between any two calls).
    ids_of = lambda rows: [row[0] if isinstance(row, tuple) else row for row in rows]  # noqa: E731
    for generate in cases:
        rows = ids_of(generate(one, num_return_sequences=n, generator=seeded()))
        assert len(rows) == n and rows == ids_of(generate([one] * n, generator=seeded()))
        assert len(set(map(tuple, rows))) > 1  # each row its own random stream
        assert ids_of(generate(batch, num_return_sequences=2, generator=seeded())) == ids_of(generate(
            [batch[0], batch[0], batch[1], batch[1]], generator=seeded()))


def test_beam_search_returns_its_best_beams():
    target, ids = tiny_model("llama"), prompt(10)
    beams = beam_search_generate(ids, target, max_gen_len=8, num_beams=4, num_return_sequences=3)
    assert len(beams) == 3 and beams[0] == beam_search_generate(ids, target, max_gen_len=8, num_beams=4)
    assert len(set(map(tuple, beams))) == 3
    two = beam_search_generate([ids, prompt(11)], target, max_gen_len=8, num_beams=4, num_return_sequences=2)
    assert two[:2] == beams[:2] and len(two) == 4


# logprobs: the target's raw log-probabilities of the returned tokens.

def reference_logprobs(target, ids: list[int], out: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = target(torch.tensor([ids + out])).logits[0, len(ids) - 1 : -1].double()
    return logits.log_softmax(-1).gather(-1, torch.tensor(out)[:, None])[:, 0]


@pytest.mark.parametrize("name", FAMILIES)
def test_logprobs_are_the_log_softmax_of_a_separate_forward(name):
    target = tiny_model(name)  # float64
    drafter = drafter_for(target)
    ids, processor = prompt(12), TopKProcessor(temperature=2.0, top_k=10)  # not the argmax: raw, not processed
    runs = {
        "plain": lambda s: [autoregressive_generate(ids, target, max_gen_len=16, logits_processor=processor,
                                                    stats=s)],
        "sd": lambda s: [speculative_generate(ids, drafter, target, gamma=4, max_gen_len=16, logits_processor=processor,
                                              stats=s)[0]],
        "nasd trees": lambda s: [ngram_assisted_speculative_generate(ids + ids, MultiDynaGram(3), target, branching=3,
                                                                     max_gen_len=16, stats=s)[0]],
        "a batch": lambda s: [out for out, _ in speculative_generate([ids, prompt(13)], target, target, max_gen_len=9,
                                                                     stats=s)],
    }
    for label, run in runs.items():
        stats = SpeculativeStats()
        outs = run(stats)
        prompts = [ids + ids] if label == "nasd trees" else [ids, prompt(13)] if label == "a batch" else [ids]
        assert len(stats.logprobs) == len(outs), label
        for row, (p, out) in enumerate(zip(prompts, outs, strict=True)):
            assert len(stats.logprobs[row]) == len(out)
            # A cached pass and one full pass agree to ~1e-6 here (the suite's pass-against-pass tolerance);
            # processed scores (temperature 2) or a position off by one would differ by far more.
            torch.testing.assert_close(torch.tensor(stats.logprobs[row], dtype=torch.float64),
                                       reference_logprobs(target, p, out), rtol=1e-5, atol=1e-5, msg=label)


def test_logprobs_follow_a_stop():
    target, ids = tiny_model("llama"), prompt(14)
    full = autoregressive_generate(ids, target, max_gen_len=20)
    stats = SpeculativeStats()
    out, _ = speculative_generate(ids, target, target, max_gen_len=20, stats=stats,
                                  stopping_criteria=StopAt(full[6], len(ids)))
    assert len(stats.logprobs[0]) == len(out) < len(full)


# The checks, before any model runs.

@pytest.mark.parametrize("needle, call, error", [
    ("tokenizer is given but nothing uses it",
     lambda m: speculative_generate(prompt(0), m, m, tokenizer=word_tokenizer()), ValueError),
    ("tokenizer is given but nothing uses it",
     lambda m: ngram_assisted_speculative_generate(prompt(0), MultiDynaGram(3), m, tokenizer=word_tokenizer()), ValueError),
    ("stop_strings is given but tokenizer is not", lambda m: autoregressive_generate(prompt(0), m, stop_strings="w5"),
     ValueError),
    ("stop_strings must be", lambda m: autoregressive_generate(prompt(0), m, stop_strings=[""], tokenizer=word_tokenizer()),
     TypeError),
    ("stopping_criteria[0]", lambda m: speculative_generate(prompt(0), m, m, stopping_criteria=[3]), TypeError),
    ("on_step must be", lambda m: speculative_generate(prompt(0), m, m, on_step=3), TypeError),
    ("on_step must be", lambda m: autoregressive_generate(prompt(0), m, on_step="print"), TypeError),
    ("num_return_sequences must be", lambda m: autoregressive_generate(prompt(0), m, num_return_sequences=0), ValueError),
    ("num_return_sequences must be <= num_beams",
     lambda m: beam_search_generate(prompt(0), m, num_beams=2, num_return_sequences=3), ValueError),
    ("alpha must be >= 0", lambda m: beam_search_generate(prompt(0), m, alpha=-1), ValueError),
    ("length_penalty must be >= 0", lambda m: beam_search_generate(prompt(0), m, length_penalty=-1), ValueError),
    ("pass length_penalty only", lambda m: beam_search_generate(prompt(0), m, length_penalty=1.0, alpha=1.0), ValueError),
    ("logprobs", lambda m: speculative_generate(prompt(0), m, m, output_scores=True), TypeError),
    ("max_gen_len is 1000000000", lambda m: speculative_generate(prompt(0), m, m, max_gen_len=10**9), ValueError),
    ("context holds 256", lambda m: autoregressive_generate(prompt(0), m, max_gen_len=257), ValueError),
    ("tokenizer has", lambda m: autoregressive_generate(prompt(0), m, stop_strings="w5", tokenizer=word_tokenizer(400)),
     ValueError),
])
def test_each_habit_is_checked_before_any_model_runs(no_forward, needle, call, error):  # noqa: F811
    with pytest.raises(error) as info:
        call(tiny_model("llama"))
    assert needle in str(info.value)


@pytest.mark.parametrize("function", [autoregressive_generate, beam_search_generate, speculative_generate,
                                      ngram_assisted_speculative_generate], ids=lambda f: f.__name__)
def test_more_transformers_names_are_answered_in_every_function(no_forward, function):  # noqa: F811
    for name, ours in [("length_penalty", "length_penalty of beam_search_generate"), ("output_logits", "logprobs"),
                       ("no_repeat_ngram_size", "logits_processor"), ("generation_config", "from_generation_config")]:
        if name == "length_penalty" and function is beam_search_generate:
            continue  # its own parameter (tests/test_autoregressive.py)
        with pytest.raises(TypeError, match=f"got {name}=, transformers' name: this library calls it .*{ours}"):
            function([5, 6], tiny_model("llama"), **{name: 1})
