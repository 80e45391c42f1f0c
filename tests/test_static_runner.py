"""The static runner (a fixed KV buffer, writes at explicit slots, rollback by a length): every method
through it returns the tokens it returns through the growing cache."""

from __future__ import annotations

import random

import pytest
import torch

from ngram_assisted import MultiDynaGram, ngram_assisted_speculative_generate
from sampling import autoregressive_generate, speculative_generate
from tests import models
from tests.models import DECODER_ONLY, prompt
from utils.logits_processors import NucleusProcessor
from utils.runners import SequenceRunner, make_runner
from utils.runners.static import StaticRunner


def tiny_model(*args, **kwargs):
    """A model of its own (the suite shares cached tiny models, and our own forward's answer for a model is
    kept: one built here under SPECDEC_LEAN=0 keeps the Hugging Face forward)."""
    build = getattr(models.tiny_model, "__wrapped__", models.tiny_model)
    return build(*args, **kwargs)


def _outputs(target, drafter, ids):
    """Plain, speculative (chain) and NASD (trees where the policy says) greedy outputs, a batch, and seeded sampling."""
    return {
        "plain": autoregressive_generate(ids, target, max_gen_len=30, end_tokens_id=None),
        "sd": speculative_generate(ids, drafter, target, gamma=4, max_gen_len=30, end_tokens_id=None)[0],
        "nasd": ngram_assisted_speculative_generate(ids, MultiDynaGram(3), target, gamma=6, max_gen_len=30,
                                                    end_tokens_id=None)[0],
        "batch": speculative_generate([ids, prompt(5, 7)], drafter, target, gamma=3, max_gen_len=20, end_tokens_id=None),
        "sampled": autoregressive_generate(ids, target, logits_processor=NucleusProcessor(temperature=1.0, top_p=0.9),
                                           max_gen_len=20, end_tokens_id=None, generator=torch.Generator().manual_seed(3)),
    }


@pytest.mark.parametrize("family", DECODER_ONLY)
def test_every_method_through_the_static_buffer_returns_the_growing_caches_tokens(monkeypatch, family):
    """Our own forward over the static buffer, and transformers' forward over its own growing cache (our forward
    off): plain, speculative, NASD, a batch and seeded sampling give the same tokens. A model our forward does not
    run (GPT-2) never gets a static buffer."""
    ids = prompt(0)
    target, drafter = tiny_model(family), tiny_model(family, seed=1)
    assert isinstance(make_runner(target, max_tokens=50), StaticRunner) == (family != "gpt2")
    ours = _outputs(target, drafter, ids)
    monkeypatch.setenv("SPECDEC_LEAN", "0")  # models of their own: the answer for a model is kept
    target, drafter = tiny_model(family), tiny_model(family, seed=1)
    assert not isinstance(make_runner(target, max_tokens=50), StaticRunner)
    assert _outputs(target, drafter, ids) == ours
    assert ours["sd"] == ours["plain"] == ours["nasd"]


def test_a_static_runner_refuses_a_model_our_forward_does_not_run(monkeypatch):
    with pytest.raises(ValueError, match="a static runner runs our own forward, which does not run GPT2LMHeadModel"):
        StaticRunner(tiny_model("gpt2"), rows=1, slots=64)
    monkeypatch.setenv("SPECDEC_LEAN", "0")
    with pytest.raises(ValueError, match="SPECDEC_LEAN=0"):
        StaticRunner(tiny_model("llama"), rows=1, slots=64)


def _random_blocks(rng: random.Random, steps: int):
    """A walk of chains and trees with rollbacks and kept paths, as the loops make them."""
    for _ in range(steps):
        n = rng.randint(1, 6)
        tokens = [rng.randrange(3, 96) for _ in range(n)]
        if rng.random() < 0.5:
            yield tokens, None, rng.randint(0, n - 1)
        else:
            parents = [-1] + [rng.randrange(0, j) for j in range(1, n)]
            path, node = [], n - 1  # keep one root-to-leaf path: the last node's ancestors
            while node > 0:
                path.append(node - 1)
                node = parents[node]
            yield tokens, parents, path[::-1]


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_static_logits_equal_the_growing_cache_over_many_rollbacks_and_trees(family):
    # SDPA in float64 throughout (transformers' eager attention takes its softmax in float32, over
    # 256 slots here and over the cached tokens there: a 1e-6 difference that is rounding only).
    model = tiny_model(family, attention="sdpa")
    static, growing = StaticRunner(model, rows=1, slots=256), SequenceRunner(model)
    ids = prompt(1, 9)
    torch.testing.assert_close(static.forward_rows([(ids, None)], [2])[0], growing.forward_rows([(ids, None)], [2])[0],
                               rtol=1e-9, atol=1e-9)
    rng = random.Random(0)
    for tokens, parents, kept in _random_blocks(rng, 40):
        block = [(tokens, parents)]
        length = static.row_length(0)
        got, want = static.forward_rows(block, [len(tokens)])[0], growing.forward_rows(block, [len(tokens)])[0]
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
        if parents is None:  # a chain: keep `kept` drafts after the first token
            static.rollback_row(0, length + 1 + kept)
            growing.rollback_row(0, length + 1 + kept)
        else:
            static.keep_path_row(0, length, kept)
            growing.keep_path_row(0, length, kept)
        assert static.rows[0] == growing.tokens


def test_a_request_near_the_context_end_drafts_over_a_buffer_past_it():
    target, drafter = tiny_model("llama"), tiny_model("llama", seed=1)
    ids = prompt(2, 150)
    runner = make_runner(target, max_tokens=256)
    # past the context by the drafts' room: a row near its end still drafts (positions clamped, nothing kept past it)
    assert isinstance(runner, StaticRunner) and runner.slots == 256 + 256
    want = autoregressive_generate(ids, target, max_gen_len=106, end_tokens_id=None)  # to the context's end
    assert speculative_generate(ids, drafter, target, gamma=5, max_gen_len=106, end_tokens_id=None)[0] == want
