"""transformers' `generate` runs NASD from the repository's `custom_generate/` folder: greedy output is
`model.generate`'s own (decoder-only and encoder-decoder, with an assistant model too), batches come
back padded as `generate` pads them, the GenerationConfig, streamer and return_dict work, seeded
sampling is the library's, and what the method cannot honour is refused."""

from pathlib import Path

import pytest
import torch
import transformers
from transformers import GenerationConfig
from transformers.generation import GenerationMixin
from transformers.generation.streamers import BaseStreamer

from sampling import SpeculativeStats, autoregressive_generate
from tests.models import prompt, tiny_model
from utils.logits_processors import TopKNucleusProcessor

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


def test_seeded_sampling_is_the_librarys_plain_sampling_and_the_streamer_sees_every_token():
    model = tiny_model("qwen2")
    ids = repeating(8)

    class Collect(BaseStreamer):
        def __init__(self):
            self.puts = []

        def put(self, value):
            self.puts.append(value.reshape(-1).tolist())

        def end(self):
            self.puts.append("end")

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
        (dict(num_return_sequences=2, do_sample=True), "cannot honour num_return_sequences=2"),
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
