"""transformers' `generate` runs NASD from the repository's `custom_generate/` folder: greedy output is
`model.generate`'s own (decoder-only and encoder-decoder, with an assistant model too), batches come
back padded as `generate` pads them, the GenerationConfig, streamer and return_dict work, seeded
sampling is the library's, generate's habits (stop strings, stopping criteria, several return
sequences) give generate's own outputs, and what the method cannot honour is refused."""

from pathlib import Path

import pytest
import torch
import transformers
from transformers import (
    EosTokenCriteria,
    GenerationConfig,
    MaxLengthCriteria,
    StoppingCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)
from transformers.generation import GenerationMixin
from transformers.generation.streamers import BaseStreamer

from sampling import SpeculativeStats, autoregressive_generate, speculative_generate
from tests.models import prompt, tiny_model
from tests.test_examples import user_cache  # noqa: F401  (a fixture: the built-in model from the user's cache)
from tests.test_habits import FAMILIES, word_tokenizer
from utils.logits_processors import TopKNucleusProcessor, TopKProcessor

ROOT = str(Path(__file__).resolve().parent.parent)
pytestmark = pytest.mark.skipif(
    not hasattr(GenerationMixin, "load_custom_generate"),
    reason=f"transformers {transformers.__version__} cannot load a custom_generate folder "
           f"(GenerationMixin.load_custom_generate: 4.57 and 5.x have it)",
)


def custom(model, ids, **kwargs):
    return model.generate(ids, custom_generate=ROOT, trust_remote_code=True, **kwargs)


def repeating(seed: int, length: int = 6) -> torch.Tensor:
    return torch.tensor([prompt(seed, length=length) * 3])


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_greedy_nasd_returns_generates_own_tokens(name):
    model = tiny_model(name)
    for seed in range(3):
        ids = repeating(seed)
        plain = model.generate(ids, max_new_tokens=24, do_sample=False)
        assert torch.equal(custom(model, ids, max_new_tokens=24, do_sample=False), plain)
    stats = SpeculativeStats()
    config = GenerationConfig(max_new_tokens=16, do_sample=False, eos_token_id=2, pad_token_id=0)
    out = custom(model, ids, generation_config=config, stats=stats, return_dict_in_generate=True)
    assert torch.equal(out.sequences, model.generate(ids, generation_config=config))
    assert out.sequences.dtype == torch.long and stats.drafts_proposed > 0


def test_an_assistant_model_runs_speculative_decoding_with_generates_tokens():
    model, drafter = tiny_model("llama"), tiny_model("llama", seed=1)
    ids = repeating(4)
    plain = model.generate(ids, max_new_tokens=20, do_sample=False)
    stats = SpeculativeStats()
    assert torch.equal(custom(model, ids, max_new_tokens=20, do_sample=False, assistant_model=drafter, stats=stats,
                              gamma=3), plain)
    assert stats.drafter_forwards > 0


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_encoder_decoder_output_starts_with_the_decoder_start_token_as_generates(name):
    model = tiny_model(name)
    ids = torch.tensor([prompt(5, length=10)])
    plain = model.generate(ids, max_new_tokens=16, do_sample=False)
    assert torch.equal(custom(model, ids, max_new_tokens=16, do_sample=False), plain)


def test_a_padded_batch_gives_each_row_its_own_output_padded_on_the_right():
    model = tiny_model("llama")
    rows = [prompt(6, length=5) * 2, prompt(7, length=4)]
    width = max(len(row) for row in rows)
    ids = torch.tensor([[0] * (width - len(row)) + row for row in rows])  # left padding, pad_token_id 0
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])
    end = model.generate(torch.tensor([rows[0]]), max_new_tokens=20, do_sample=False)[0, len(rows[0]) + 3].item()
    out = custom(model, ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=end)
    singles = [model.generate(torch.tensor([row]), max_new_tokens=20, do_sample=False, eos_token_id=end)[0, len(row):]
               for row in rows]
    assert len({len(s) for s in singles}) > 1  # one row ends early: it is padded
    assert torch.equal(out[:, :width], ids)
    for b, new in enumerate(singles):
        assert out[b, width : width + len(new)].tolist() == new.tolist()
        assert (out[b, width + len(new) :] == 0).all()


class Collect(BaseStreamer):
    def __init__(self):
        self.puts = []

    def put(self, value):
        self.puts.append(value.reshape(-1).tolist())

    def end(self):
        self.puts.append("end")


def test_seeded_sampling_is_the_librarys_plain_sampling_and_the_streamer_sees_every_token():
    model = tiny_model("qwen2")
    ids = repeating(8)
    streamer = Collect()
    out = custom(model, ids, max_new_tokens=20, do_sample=True, temperature=0.8, top_k=50, top_p=0.9,
                 generator=torch.Generator().manual_seed(3), streamer=streamer, eos_token_id=2)
    plain = autoregressive_generate(ids[0].tolist(), model, max_gen_len=20,
                                    logits_processor=TopKNucleusProcessor(temperature=0.8, top_k=50, top_p=0.9),
                                    end_tokens_id=2, generator=torch.Generator().manual_seed(3))
    assert out[0, ids.shape[1] :].tolist() == plain
    assert streamer.puts[0] == ids[0].tolist() and streamer.puts[-1] == "end"
    assert [t for put in streamer.puts[1:-1] for t in put] == plain


def test_what_nasd_cannot_honour_is_refused():
    model = tiny_model("llama")
    ids = repeating(9)
    for kwargs, message in [
        (dict(num_beams=2), "cannot honour num_beams=2"),
        (dict(output_scores=True, return_dict_in_generate=True), "cannot honour output_scores=True"),
        (dict(not_an_argument=3), r"does not know these arguments: \['not_an_argument'\]"),
        (dict(max_length=5), "leaves no room"),
    ]:
        with pytest.raises(ValueError, match=message):
            custom(model, ids, max_new_tokens=None if "max_length" in kwargs else 8, **kwargs)


def generation_fields() -> list[str]:
    return sorted(GenerationConfig().to_dict())


def test_every_generate_argument_is_honoured_or_refused_never_ignored():
    """Each GenerationConfig field of this transformers: outside HONOURED, a value that asks for something
    (2: never a neutral value) is refused with the field's name, before any model runs; a neutral one is not."""
    from custom_generate.generate import HONOURED, NEUTRAL

    model = tiny_model("llama")
    ids = repeating(9)
    refused = [name for name in generation_fields() if name not in HONOURED]
    assert "prompt_lookup_num_tokens" in refused and "num_beams" in refused and "max_new_tokens" not in refused
    for name in refused:
        with pytest.raises(ValueError, match=f"cannot honour {name}=2"):
            custom(model, ids, max_new_tokens=4, **{name: 2})
    neutral = {name: value for name, value in NEUTRAL.items() if name in refused}
    assert torch.equal(custom(model, ids, max_new_tokens=4, do_sample=False, **neutral),
                       model.generate(ids, max_new_tokens=4, do_sample=False))
    config = GenerationConfig(max_new_tokens=4, prompt_lookup_num_tokens=10)  # given in a config: the same answer
    with pytest.raises(ValueError, match="cannot honour prompt_lookup_num_tokens=10 .*gamma="):
        custom(model, ids, generation_config=config)


@pytest.mark.parametrize("argument", [dict(synced_gpus=True), dict(negative_prompt_attention_mask=torch.ones(1, 3)),
                                      dict(use_model_defaults=False)])
def test_generates_own_parameters_are_refused_too(argument):
    with pytest.raises(ValueError, match=f"{next(iter(argument))}"):
        custom(tiny_model("llama"), repeating(9), max_new_tokens=4, **argument)


# generate's habits: stop strings, stopping criteria, several return sequences, as generate honours them.

def both(model, ids, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(generate's output, custom_generate's) for the same arguments."""
    return model.generate(ids, **kwargs), custom(model, ids, **kwargs)


def padded_batch(seeds: tuple[int, ...], lengths: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts (pad_token_id 0) and their attention mask. (For generate's side, a batch model with
    sdpa attention: transformers 5's eager attention gives a padded row NaN logits in float64.)"""
    rows = [prompt(seed, length=length) for seed, length in zip(seeds, lengths, strict=True)]
    width = max(lengths)
    ids = torch.tensor([[0] * (width - len(row)) + row for row in rows])
    return ids, (ids != 0).long()


class Seen(StoppingCriteria):
    """Stops a row once `token` is anywhere in it (its padding cannot hold it): one answer per row."""

    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids == self.token).any(dim=-1)


@pytest.mark.parametrize("name", FAMILIES)
def test_stop_strings_stop_where_generate_stops_also_mid_token(name):
    model, tokenizer = tiny_model(name), word_tokenizer()
    ids = torch.tensor([prompt(4)])
    full = model.generate(ids, max_new_tokens=30, do_sample=False)
    words = tokenizer.convert_ids_to_tokens(full[0, ids.shape[1] :].tolist())  # "w17", ...; the text joins them with spaces
    for stop in [words[8], words[8][:-1], f"{words[7][-1]} {words[8][:2]}", [f"{words[6][-2:]} w", "never-in-the-text"]]:
        plain, ours = both(model, ids, max_new_tokens=30, do_sample=False, stop_strings=stop, tokenizer=tokenizer)
        assert plain.shape[1] < full.shape[1] and torch.equal(ours, plain), stop  # "w5" stops at "w59": mid-token
    config = GenerationConfig(max_new_tokens=30, do_sample=False, stop_strings=words[5][:2])  # in a config: the same
    plain, ours = both(model, ids, generation_config=config, tokenizer=tokenizer)
    assert plain.shape[1] < full.shape[1] and torch.equal(ours, plain)
    streamer = Collect()  # a streamer sees the returned tokens, no more
    custom(model, ids, generation_config=config, tokenizer=tokenizer, streamer=streamer)
    assert [t for put in streamer.puts[1:-1] for t in put] == plain[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("name", FAMILIES)
def test_a_padded_batch_stops_each_row_as_generate_does_and_pads_it(name):
    model, tokenizer = tiny_model(name, attention="sdpa"), word_tokenizer()
    ids, mask = padded_batch((6, 7, 8), (9, 6, 8))
    full = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)[:, ids.shape[1] :]
    stop = tokenizer.convert_ids_to_tokens(full[0, 5].item())[:-1]
    token = full[1, 9].item()
    # An end token, so that generate pads a stopped row (without one, it decodes the row on to the batch's end).
    common, padded = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=2), False
    for habits in [dict(stop_strings=stop, tokenizer=tokenizer), dict(stopping_criteria=StoppingCriteriaList([Seen(token)])),
                   dict(stop_strings=stop, tokenizer=tokenizer, stopping_criteria=[Seen(token)], eos_token_id=full[2, 3].item())]:
        plain, ours = both(model, ids, **{**common, **habits})
        padded |= bool((plain[:, ids.shape[1] :] == 0).any())
        assert (plain.shape[1] < ids.shape[1] + 24 or padded) and torch.equal(ours, plain), habits
    assert padded  # a row stopped before another and was padded


@pytest.mark.parametrize("name", FAMILIES)
def test_a_criterion_of_a_type_generate_builds_takes_its_place_as_in_generate(name):
    model = tiny_model(name)
    ids = repeating(10)
    full = model.generate(ids, max_new_tokens=20, do_sample=False)[0, ids.shape[1] :].tolist()
    width = ids.shape[1]
    cases = [dict(stopping_criteria=[MaxLengthCriteria(width + 7)]),  # replaces max_new_tokens=20
             dict(stopping_criteria=[MaxLengthCriteria(width + 30), MaxLengthCriteria(width + 9)]),  # the least
             dict(stopping_criteria=[EosTokenCriteria(full[6])], eos_token_id=full[12]),  # replaces eos_token_id
             dict(stopping_criteria=StoppingCriteriaList([Seen(full[4])]), eos_token_id=full[12])]
    for habits in cases:
        plain, ours = both(model, ids, max_new_tokens=20, do_sample=False, **habits)
        assert plain.shape[1] < width + 20 and torch.equal(ours, plain), habits


@pytest.mark.parametrize("name", FAMILIES)
def test_num_return_sequences_returns_generates_rows(name):
    """Greedy with num_return_sequences > 1 is refused as generate refuses it; sampling that picks the argmax
    (top_k=1) gives generate's rows, n per prompt side by side, padded as generate pads them."""
    model, tokenizer = tiny_model(name, attention="sdpa"), word_tokenizer()
    ids, mask = padded_batch((11, 12), (8, 5))
    for call in (model.generate, lambda *a, **k: custom(model, *a, **k)):
        with pytest.raises(ValueError, match="Greedy methods .* do not support `num_return_sequences`"):
            call(ids, attention_mask=mask, max_new_tokens=4, num_return_sequences=2)
    greedy = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=2)
    stop = tokenizer.convert_ids_to_tokens(greedy[1, -5].item())
    common = dict(attention_mask=mask, max_new_tokens=12, do_sample=True, top_k=1, num_return_sequences=3, eos_token_id=2)
    for habits in [{}, dict(stop_strings=stop, tokenizer=tokenizer)]:
        plain, ours = both(model, ids, **common, **habits)
        assert plain.shape[0] == 6 and torch.equal(ours, plain), habits
        assert all(torch.equal(ours[i], ours[i - i % 3]) for i in range(6))  # each prompt's rows alike
        assert habits or torch.equal(ours[::3], greedy)  # the argmax's: greedy output


def test_sampled_return_sequences_are_the_seeded_batch_of_copies():
    """docs/seeds.md: `num_return_sequences=n` returns what the batch of n copies returns, one stream per row from
    one generator (NASD: plain seeded sampling's tokens); a list of generators gives returned row i the single call
    with generator i; with an assistant model, speculative_generate's seeded rows; generate's shape."""
    model, drafter = tiny_model("llama"), tiny_model("llama", seed=1)
    ids = repeating(13)
    common = dict(max_new_tokens=10, do_sample=True, temperature=1.5, top_k=30)
    seeded = lambda s=5: torch.Generator().manual_seed(s)  # noqa: E731
    out = custom(model, ids, num_return_sequences=3, generator=seeded(), **common)
    assert out.shape == model.generate(ids, num_return_sequences=3, **common).shape == (3, ids.shape[1] + 10)
    assert torch.equal(out, custom(model, ids.repeat(3, 1), generator=seeded(), **common))
    config = GenerationConfig(num_return_sequences=3, **common)  # in a config: the same
    assert torch.equal(out, custom(model, ids, generation_config=config, generator=seeded()))
    library = autoregressive_generate([ids[0].tolist()] * 3, model, max_gen_len=10, generator=seeded(),
                                      logits_processor=TopKProcessor(temperature=1.5, top_k=30))
    assert out[:, ids.shape[1] :].tolist() == library and len({tuple(row) for row in library}) > 1
    two = torch.cat([ids, torch.tensor([prompt(14, length=ids.shape[1])])])
    singles = [custom(model, two[b : b + 1], generator=seeded(s), **common) for b in range(2) for s in (1, 2)]
    listed = custom(model, two, num_return_sequences=2, generator=[seeded(s) for s in (1, 2, 1, 2)], **common)
    assert torch.equal(listed, torch.cat(singles))
    sd = custom(model, ids, num_return_sequences=2, generator=seeded(), assistant_model=drafter, gamma=3, **common)
    expected = speculative_generate(ids[0].tolist(), drafter, model, gamma=3, max_gen_len=10, num_return_sequences=2,
                                    logits_processor=TopKProcessor(temperature=1.5, top_k=30), generator=seeded())
    assert sd[:, ids.shape[1] :].tolist() == [row for row, _ in expected]


def test_the_habits_bad_inputs_are_refused_by_name():
    model, tokenizer = tiny_model("llama"), word_tokenizer()
    ids = repeating(9)
    for call in (model.generate, lambda *a, **k: custom(model, *a, **k)):  # generate refuses it too
        with pytest.raises(ValueError, match="stop strings|stop_strings"):
            call(ids, max_new_tokens=4, stop_strings="w5")
    for kwargs, error, message in [
        (dict(generation_config=GenerationConfig(max_new_tokens=4, stop_strings=["w5"])), ValueError,
         r"stop_strings=\['w5'\] .*no tokenizer: pass the model's tokenizer as tokenizer="),
        (dict(stop_strings=[""], tokenizer=tokenizer), TypeError, "stop_strings must be a non-empty string"),
        (dict(stop_strings="w5", tokenizer=word_tokenizer(400)), ValueError, "tokenizer has 400 tokens"),
        (dict(stop_strings="w5", tokenizer=3), TypeError, "tokenizer must be a transformers tokenizer"),
        (dict(stopping_criteria=[Seen(5), 3]), TypeError, r"stopping_criteria\[1\] must be"),
        (dict(num_return_sequences=0, do_sample=True), ValueError, r"num_return_sequences must be an int >= 1 \(.*\), got 0"),
        (dict(num_return_sequences=2, do_sample=True, streamer=BaseStreamer()), ValueError,
         "a streamer takes one sequence.*num_return_sequences=2"),
        (dict(stopping_criteria=[MaxLengthCriteria(ids.shape[1])]), ValueError, "max_length=18 leaves no room"),
    ]:
        with pytest.raises(error, match=message):
            custom(model, ids, **{"max_new_tokens": 4, **kwargs})
    # A tokenizer without stop strings asks for nothing, as in generate.
    assert torch.equal(*both(model, ids, max_new_tokens=6, do_sample=False, tokenizer=tokenizer))


def test_an_encoder_decoder_stops_and_repeats_as_generate_does():
    """The criteria see the decoder's ids (its start token, then the new tokens), as in generate. (generate's side
    gets the StopStringCriteria that it builds from stop_strings: transformers 4.57 passes an encoder-decoder's
    tokenizer= on to its forward.)"""
    model, tokenizer = tiny_model("t5"), word_tokenizer()
    ids = torch.tensor([prompt(4, length=10)])
    full = model.generate(ids, max_new_tokens=16, do_sample=False)
    words = tokenizer.convert_ids_to_tokens(full[0, 1:].tolist())
    for habits, sampled in [(dict(stop_strings=words[6][:-1]), {}), (dict(stopping_criteria=[Seen(full[0, 5].item())]), {}),
                            (dict(stop_strings=words[9]), dict(do_sample=True, top_k=1, num_return_sequences=2))]:
        common = {"max_new_tokens": 16, "do_sample": False, **sampled}
        strings = habits.pop("stop_strings", None)
        ours = custom(model, ids, **common, **habits, **(dict(stop_strings=strings, tokenizer=tokenizer) if strings else {}))
        criteria = habits.get("stopping_criteria") or [StopStringCriteria(tokenizer, [strings])]
        plain = model.generate(ids, **common, stopping_criteria=StoppingCriteriaList(criteria))
        assert plain.shape[1] < full.shape[1] and torch.equal(ours, plain), (habits, strings)


@pytest.mark.slow
@pytest.mark.xdist_group("built-in model")
def test_the_habits_on_the_built_in_model_give_generates_outputs(user_cache):  # noqa: F811
    from utils.loading import load_model

    model, tokenizer = load_model()
    ids = tokenizer("def fibonacci(n):\n", return_tensors="pt").input_ids
    full = model.generate(ids, max_new_tokens=40, do_sample=False)
    new = full[0, ids.shape[1] :].tolist()
    pieces = [tokenizer.decode([token]) for token in new]  # "def", " fib", "onacci", ...
    k = next(i for i, piece in enumerate(pieces) if i > 8 and len(piece.strip()) >= 4)
    inside = pieces[k].strip()[:-1]  # ends inside a token
    across = "".join(pieces[k - 3 : k - 1]) + pieces[k - 1][:2]  # over three tokens, ending inside the third
    assert len(pieces[k - 1]) > 2
    for habits in [dict(stop_strings=inside, tokenizer=tokenizer), dict(stop_strings=[across, "never"], tokenizer=tokenizer),
                   dict(stopping_criteria=StoppingCriteriaList([Seen(new[k + 2])])),
                   dict(do_sample=True, top_k=1, num_return_sequences=2, stop_strings=inside, tokenizer=tokenizer)]:
        plain, ours = both(model, ids, max_new_tokens=40, **{"do_sample": False, **habits})
        assert plain.shape[1] < full.shape[1] and torch.equal(ours, plain), habits
