"""Model loading: local folders, clear errors, and the quantized path through bitsandbytes."""

import importlib.util

import pytest

from ngram_assisted import MultiDynaGram, ngram_assisted_speculative_generate
from sampling import autoregressive_generate
from tests.saved_model import save_tiny_chat_model
from utils.loading import end_token_ids, load_model


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny"), max_positions=256)


def test_load_a_local_folder(folder):
    model, tokenizer = load_model(str(folder), dtype="float32")
    assert not model.training
    assert end_token_ids(model, tokenizer) == [2]
    assert len(autoregressive_generate(tokenizer("w5 w6")["input_ids"], model, max_gen_len=5)) == 5


def test_bad_arguments(folder):
    with pytest.raises(ValueError, match="dtype"):
        load_model(str(folder), dtype="float13")
    with pytest.raises(ValueError, match="load_in_8bit"):
        load_model(str(folder), load_in_8bit=True, load_in_4bit=True)


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes is the optional 'quant' extra")
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_model_runs_every_method_exactly(folder, bits):
    model, tokenizer = load_model(str(folder), load_in_8bit=bits == 8, load_in_4bit=bits == 4)
    assert any("bitsandbytes" in type(m).__module__ for m in model.modules())
    inputs = tokenizer("w5 w6 w7 w5 w6 w7 w5")["input_ids"]
    reference = autoregressive_generate(inputs, model, max_gen_len=12)
    out, _ = ngram_assisted_speculative_generate(inputs, MultiDynaGram(3), model, max_gen_len=12)
    assert out == reference
