"""The CPU shortcuts for passes over a few tokens: same logits, same tokens, nothing left behind."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from ngram_assisted import MultiDynaGram, ngram_assisted_speculative_generate
from sampling import autoregressive_generate
from tests.models import prompt, tiny_model
from utils import calibration
from utils.cost_model import PassCosts
from utils.cpu_passes import FewTokenPass, Shortcuts, available_shortcuts

BOTH = Shortcuts(few_row_linear=True, gqa_without_repeat=True)


def float32_llama():
    """Grouped-query attention (4 heads, 2 key/value heads) through SDPA: the path being changed."""
    return tiny_model("llama", seed=3, dtype=torch.float32, attention="sdpa")


def linears(model) -> list[nn.Linear]:
    return [m for m in model.modules() if type(m) is nn.Linear]


def test_logits_match_the_plain_pass_over_a_cache():
    model = float32_llama()
    ids = torch.tensor([prompt(0, length=20)])
    with torch.no_grad():
        expected = model(ids).logits[0, -6:]
        past = model(ids[:, :-6], use_cache=True).past_key_values
        with FewTokenPass(model).using(BOTH):
            assert all("forward" in m.__dict__ for m in linears(model))
            got = model(ids[:, -6:], past_key_values=past, use_cache=True).logits[0]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_everything_is_restored_even_after_an_error(monkeypatch):
    model = float32_llama()
    monkeypatch.setenv("TRANSFORMERS_SDPA_FORCE_GQA", "0")
    with pytest.raises(RuntimeError, match="boom"), FewTokenPass(model).using(BOTH):
        assert os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] == "1"
        raise RuntimeError("boom")
    assert os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] == "0"
    assert not any("forward" in m.__dict__ for m in linears(model))
    monkeypatch.delenv("TRANSFORMERS_SDPA_FORCE_GQA")
    with FewTokenPass(model).using(BOTH):
        pass
    assert "TRANSFORMERS_SDPA_FORCE_GQA" not in os.environ


def test_a_module_with_its_own_forward_hook_is_left_alone():
    model = tiny_model("llama", seed=4, dtype=torch.float32, attention="sdpa")
    hooked = linears(model)[0]
    calls = []

    def accelerate_like_forward(x):
        calls.append(x.shape)
        return nn.Linear.forward(hooked, x)

    hooked.forward = accelerate_like_forward  # what accelerate's dispatch hooks do
    with torch.no_grad(), FewTokenPass(model).using(BOTH):
        model(torch.tensor([prompt(1)]))
    assert hooked.forward is accelerate_like_forward and calls


def test_one_token_and_float64_passes_are_untouched():
    model = tiny_model("llama", seed=5)  # float64: MKL's path is fine there, nothing is changed
    with FewTokenPass(model).using(BOTH):
        assert not any("forward" in m.__dict__ for m in linears(model))
    assert available_shortcuts(model) == [Shortcuts(False, False), Shortcuts(False, True)]
    assert len(available_shortcuts(float32_llama())) == 4


def test_only_the_chosen_shortcuts_are_used(monkeypatch):
    model = float32_llama()
    monkeypatch.delenv("TRANSFORMERS_SDPA_FORCE_GQA", raising=False)
    with FewTokenPass(model).using(Shortcuts(gqa_without_repeat=True)):
        assert os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] == "1"
        assert not any("forward" in m.__dict__ for m in linears(model))
    with FewTokenPass(model).using(Shortcuts(few_row_linear=True)):
        assert "TRANSFORMERS_SDPA_FORCE_GQA" not in os.environ
        assert all("forward" in m.__dict__ for m in linears(model))


@pytest.fixture
def forced_choice(monkeypatch):
    """Make every pass over a few tokens of `model` use `choice`, whatever was measured."""

    def force(model, choice: Shortcuts) -> None:
        costs = PassCosts(relative={0: 1.0, 1: 1.1, 31: 2.0}, one_token_seconds=None, shortcuts={1: choice})
        monkeypatch.setitem(calibration._COSTS, model, costs)

    return force


@pytest.mark.parametrize("choice", available_shortcuts(float32_llama()))
def test_every_kernel_choice_gives_the_same_tokens(forced_choice, choice):
    """Whatever the calibration picks on a machine, every decoding function's output is the same."""
    from sampling import beam_search_generate, speculative_generate

    model = float32_llama()
    forced_choice(model, choice)
    context = prompt(0, length=10) * 3  # repeats, so that the pool drafts long chains
    expected = autoregressive_generate(context, model, max_gen_len=30)
    ids, alpha = ngram_assisted_speculative_generate(context, MultiDynaGram(4), model, max_gen_len=30)
    assert ids == expected
    assert alpha > 0  # drafts were verified, so passes over several tokens ran
    assert speculative_generate(context, model, model, gamma=3, max_gen_len=30)[0] == expected
    kwargs = dict(max_gen_len=12, end_tokens_id=[7], num_beams=4, top_k=3)
    assert beam_search_generate(prompt(2), model, **kwargs) == beam_search_generate(prompt(2), model, use_cache=False, **kwargs)
