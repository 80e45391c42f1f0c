"""The static runner (a fixed KV buffer, writes at explicit slots, rollback by a length) and its
compiled passes: every method through it returns the tokens it returns through the eager runners."""

from __future__ import annotations

import random
import warnings

import pytest
import torch

from ngram_assisted import MultiDynaGram, ngram_assisted_speculative_generate
from sampling import autoregressive_generate, speculative_generate
from tests import models
from tests.models import DECODER_ONLY, prompt
from utils.cost_model import PassCosts
from utils.logits_processors import NucleusProcessor
from utils.runners import SequenceRunner, make_runner
from utils.runners.compiled import compile_model, compiled_passes
from utils.runners.static import StaticRunner


def tiny_model(*args, **kwargs):
    """A model of its own (the suite shares cached tiny models: a registered one would run every other
    test through the static runner)."""
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
def test_every_method_through_the_static_buffer_returns_the_eager_tokens(family):
    target, drafter = tiny_model(family), tiny_model(family, seed=1)
    ids = prompt(0)
    eager = _outputs(target, drafter, ids)
    assert compile_model(target, widths=()) is not None and compile_model(drafter, widths=()) is not None
    assert isinstance(make_runner(target, max_tokens=50), StaticRunner)
    static = _outputs(target, drafter, ids)
    assert static == eager
    assert static["sd"] == static["plain"] == static["nasd"]


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


@pytest.mark.parametrize("family", ["llama", "gpt2", "mistral"])
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


def test_a_request_past_the_compiled_buffer_runs_eager_over_a_larger_one():
    target, drafter = tiny_model("llama"), tiny_model("llama", seed=1)
    ids = prompt(2, 150)
    want = speculative_generate(ids, drafter, target, gamma=5, max_gen_len=106, end_tokens_id=None)  # to the context's end
    compile_model(target, widths=(), slots=200), compile_model(drafter, widths=(), slots=200)
    runner = make_runner(target, max_tokens=256)
    assert isinstance(runner, StaticRunner) and runner.slots == 256 and runner._compiled is None  # the context's size
    assert speculative_generate(ids, drafter, target, gamma=5, max_gen_len=106, end_tokens_id=None) == want


def test_models_a_static_buffer_cannot_serve_stay_eager_with_a_warning():
    model = tiny_model("t5")
    with pytest.warns(UserWarning, match="stays eager"):
        assert compile_model(model, widths=(1,)) is None
    assert compiled_passes(model) is None
    with pytest.raises(ValueError, match="widths"):
        compile_model(tiny_model("llama"), widths=[1, 2])


def test_a_failing_compile_leaves_the_model_eager_with_one_line(monkeypatch):
    model = tiny_model("qwen2")
    ids = prompt(3)
    want = autoregressive_generate(ids, model, max_gen_len=12, end_tokens_id=None)

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler found\nsecond line")

    monkeypatch.setattr(torch, "compile", no_compiler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert compile_model(model, widths=(1,), progress=False) is None
    assert len(caught) == 1 and "no C++ compiler found" in str(caught[0].message)
    assert "second line" not in str(caught[0].message)
    assert compiled_passes(model) is None
    assert autoregressive_generate(ids, model, max_gen_len=12, end_tokens_id=None) == want


def test_a_compiled_model_costs_what_its_padded_width_costs():
    costs = PassCosts(relative={0: 1.0, 1: 1.2, 3: 1.5, 7: 2.0, 15: 3.0}, one_token_seconds=0.01, widths=(1, 2, 4, 8, 16))
    assert costs(2) == costs(3) == 1.5  # 3 or 4 new tokens: one width-4 pass
    assert costs(4) == costs(7) == 2.0
    assert costs(15) == 3.0 and costs(20) > 3.0  # past the widest: its own k
    assert PassCosts.from_json(costs.to_json()).widths == (1, 2, 4, 8, 16)


@pytest.mark.slow
def test_compiled_passes_return_the_eager_tokens():
    """The target compiled (inductor) at widths 1 and 4, float64: plain, chains, trees and a batch (which
    runs eager over the static buffer) give the eager runners' tokens; a pass wider than every graph runs eager."""
    target, drafter = tiny_model("llama"), tiny_model("llama", seed=1)
    ids = prompt(4)
    eager = _outputs(target, drafter, ids)
    passes = compile_model(target, widths=(1, 4), progress=False)
    assert passes is not None and set(passes.compile_seconds) == {1, 4}
    compiled = _outputs(target, drafter, ids)  # the drafter stays eager: its compiled passes are the target's kind
    assert compiled == eager
    runner = make_runner(target, max_tokens=40)
    runner.forward_rows([(ids, None)], [1])
    assert runner._width(3) == 4 and runner._width(5) == 5  # padded to a graph; wider: its own width, eager


def test_auto_compiles_only_where_a_stored_verdict_says_it_pays(monkeypatch):
    """compile=True compiles and stores a measured verdict (here a stand-in measurement); "auto"
    compiles nothing without one, and follows it after: a compile its passes do not repay stays off."""
    from utils import compile_policy

    monkeypatch.delenv(compile_policy.COMPILE_ENV, raising=False)
    monkeypatch.setattr(compile_policy, "AUTO_MIN_PARAMETERS", 0)
    compiled = []
    monkeypatch.setattr(compile_policy, "compile_model",
                        lambda model, progress: compiled.append(model) or compile_model(model, widths=()))
    model = tiny_model("llama")
    compile_policy._verdict_path(model).unlink(missing_ok=True)
    assert compile_policy.apply(model, "auto") is False and not compiled  # no verdict: nothing compiled unasked
    # 0.5 s saved a pass over PASSES_PER_START passes repays a compile of seconds; 0.99x is no gain.
    for compiled_seconds, pays in ((0.5, True), (0.99, False)):
        monkeypatch.setattr(compile_policy, "measure",
                            lambda model, s=compiled_seconds: {"eager_seconds": 1.0, "compiled_seconds": s})
        assert compile_policy.apply(tiny_model("llama"), True) is True  # asked: compiled, the verdict stored
        assert compile_policy._stored_verdict(model)["pays"] is pays
        before = len(compiled)
        again = tiny_model("llama")
        assert compile_policy.apply(again, "auto") is pays  # the next start follows the verdict
        assert (compiled_passes(again) is not None) is pays and len(compiled) == before + pays
    assert compile_policy.pays({"eager_seconds": 1.0, "compiled_seconds": 0.97, "compile_seconds": 0}) is False
    assert compile_policy.pays({"eager_seconds": 0.34, "compiled_seconds": 0.27, "compile_seconds": 193}) is False  # 140 s saved
    with pytest.raises(ValueError, match="compile must be"):
        compile_policy.apply(model, "yes")
    monkeypatch.setenv(compile_policy.COMPILE_ENV, "0")
    assert compile_policy.apply(tiny_model("llama"), "auto") is False


def test_a_model_whose_logits_differ_over_the_buffer_stays_eager(monkeypatch):
    """The probe (a prefix and a chain through the buffer and the growing cache) refuses a model the
    static mask does not serve exactly: here every query made to see the whole buffer, as a model
    with its own causal mask at the wrong place would."""
    from utils.runners import static

    monkeypatch.setattr(static, "static_mask", lambda lengths, depths, ancestry, slots, window, dtype:
                        torch.zeros(depths.shape[0], 1, depths.shape[1], slots, dtype=dtype))
    model = tiny_model("llama")
    with pytest.warns(UserWarning, match="does not take a static buffer's mask exactly"):
        assert compile_model(model, widths=()) is None
    assert compiled_passes(model) is None
