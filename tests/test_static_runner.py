"""The static runner (a fixed KV buffer, writes at explicit slots, rollback by a length) and its
compiled passes: every method through it returns the tokens it returns through the eager runners."""

from __future__ import annotations

import json
import random
import types
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
    # past the context by the drafts' room: a row near its end still drafts (positions clamped, nothing kept past it)
    assert isinstance(runner, StaticRunner) and runner.slots == 256 + 256 and runner._compiled is None
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


@pytest.mark.slow
def test_a_compiled_graph_is_kept_on_disk_per_model(monkeypatch, tmp_path):
    """The FX-graph cache holds a graph with frozen weights (oneDNN-packed where this CPU packs
    bfloat16): the same model compiled again is a cache hit, and a model of the same shapes with other
    weights is a miss (its fingerprint enters the key), its logits its own."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    dtype = torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32
    ids = prompt(2)

    def compiled_logits(seed: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
        model = tiny_model("llama", seed=seed, dtype=dtype, attention="sdpa")
        counters["inductor"].clear()
        passes = compile_model(model, widths=(1,), autotune=(), progress=False)
        assert passes is not None
        eager, static = SequenceRunner(model), StaticRunner(model, rows=1, slots=passes.slots, compiled=passes)
        for runner in (eager, static):
            runner.forward_rows([(ids, None)], [1])
        want, got = (runner.forward_rows([([7], None)], [1])[0] for runner in (eager, static))
        return want, got, dict(counters["inductor"])

    first, again, other = compiled_logits(0), compiled_logits(0), compiled_logits(1)
    assert first[2].get("fxgraph_cache_miss") == 1 and not first[2].get("fxgraph_cache_bypass")
    assert again[2].get("fxgraph_cache_hit") == 1 and torch.equal(again[1], first[1])
    assert other[2].get("fxgraph_cache_miss") == 1  # the same shapes, other weights: its own graph
    for want, got, _ in (first, again, other):
        assert torch.allclose(got, want, atol=0.05 * float(want.abs().max()))  # bfloat16's rounding
    assert not torch.allclose(other[1], first[1])
    from torch._inductor import codecache  # inductor's own checks are back for every other compile
    assert codecache.CacheabilityValidator.check_tensor.__qualname__ == "CacheabilityValidator.check_tensor"
    assert codecache.FxGraphCachePickler._reduce_tensor.__qualname__ == "FxGraphCachePickler._reduce_tensor"


def test_auto_compiles_on_first_use_then_follows_the_measured_verdict(monkeypatch):
    """compile="auto" compiles a model on its first use on a machine and measures each width against
    eager (here a stand-in measurement); a later start compiles (loads) only the widths that paid, and
    none where none paid; compile=True measures again; SPECDEC_COMPILE=0 and compile=False never compile.
    A model our own forward runs (utils/lean/) is never compiled by "auto": here the Hugging Face path is asked for."""
    from utils import compile_policy
    from utils.lean import LEAN_ENV
    from utils.runners.compiled import CompiledPasses, register

    monkeypatch.setattr(compile_policy, "AUTO_MIN_PARAMETERS", 0)
    assert compile_policy._wanted(tiny_model("llama"), "auto") == ()
    monkeypatch.setenv(LEAN_ENV, "0")

    monkeypatch.delenv(compile_policy.COMPILE_ENV, raising=False)
    compiled = []  # the widths of each compile

    def stand_in(model, *, widths, progress, description):
        compiled.append(widths)
        register(model, CompiledPasses(widths, 64))  # no graphs: every pass eager over the buffer
        return compiled_passes(model)

    monkeypatch.setattr(compile_policy, "compile_model", stand_in)
    monkeypatch.setattr(compile_policy, "DEFAULT_WIDTHS", (1, 4, 16))
    busy = [False]  # the machine as the verdict's watch sees it (a busy machine's verdict is not stored)
    monkeypatch.setattr(compile_policy, "CoreWatch", lambda: types.SimpleNamespace(busy=lambda: busy[0]))
    model = tiny_model("llama")
    compile_policy._verdict_path(model).unlink(missing_ok=True)
    # width 1: 0.5x eager (pays); width 4: 0.99x (does not, < PAYS_BELOW); width 16: 0.9x (pays)
    ratios = {1: 0.5, 4: 0.99, 16: 0.9}
    monkeypatch.setattr(compile_policy, "measure", lambda model: {
        w: {"eager_seconds": 1.0, "compiled_seconds": ratios[w]} for w in compiled_passes(model).widths})
    assert compile_policy.apply(model, "auto") is True and compiled == [(1, 4, 16)]  # first use: all widths
    assert compiled_passes(model).widths == (1, 16)  # the width that did not pay runs eager
    verdict = compile_policy.stored_verdict(model)
    assert compile_policy.paying_widths(verdict) == (1, 16) and verdict["parameters"] > 0
    again = tiny_model("llama")
    assert compile_policy.apply(again, "auto") is True and compiled[-1] == (1, 16)  # a later start: the paying ones
    ratios.update({1: 0.97, 16: 1.2})
    busy[0] = True
    assert compile_policy.apply(tiny_model("llama"), True) is True  # measured busy: not stored
    assert compile_policy.paying_widths(compile_policy.stored_verdict(model)) == (1, 16)
    busy[0] = False
    asked = tiny_model("llama")
    assert compile_policy.apply(asked, True) is True  # asked: compiled as asked, measured again: none pays
    assert compiled_passes(asked).widths == (1, 4, 16)
    assert compile_policy.paying_widths(compile_policy.stored_verdict(model)) == ()
    before = len(compiled)
    third = tiny_model("llama")
    assert compile_policy.apply(third, "auto") is False and len(compiled) == before  # none pays: nothing compiled
    assert compiled_passes(third) is None
    assert compile_policy.apply(tiny_model("llama"), False) is False and len(compiled) == before
    # a verification width that runs eager over the buffer and got dearer (1.2x) makes the compile not pay
    dearer = {"compiled": [1], "widths": {"1": {"eager_seconds": 1.0, "compiled_seconds": 0.8},
                                          "4": {"eager_seconds": 1.0, "compiled_seconds": 1.2}}}
    assert compile_policy.paying_widths(dearer) == ()
    dearer["widths"]["4"]["compiled_seconds"] = 1.04  # within SLOWER_ABOVE
    assert compile_policy.paying_widths(dearer) == (1,)
    with pytest.raises(ValueError, match="compile must be"):
        compile_policy.apply(model, "yes")
    compile_policy._verdict_path(model).unlink()
    monkeypatch.setenv(compile_policy.COMPILE_ENV, "0")
    assert compile_policy.apply(tiny_model("llama"), "auto") is False and len(compiled) == before


def test_the_first_compile_says_how_long_it_should_take(monkeypatch, tmp_path):
    """The progress bar's words: a later start loads; a first compile estimates its wait from this
    machine's earlier compiles (seconds per parameter), or says minutes where there were none."""
    from utils import compile_policy

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    model = tiny_model("llama")
    parameters = compile_policy._parameters(model)
    assert compile_policy._description(model, first=False) == "loading compiled passes"
    assert compile_policy._description(model, first=True) == "compiling, once on this machine (minutes)"
    (tmp_path / "compiled").mkdir()
    (tmp_path / "compiled" / "a.json").write_text(json.dumps({"compile_seconds": 180.0 * 1e9 / parameters,
                                                              "parameters": int(1e9)}))
    assert compile_policy._description(model, first=True) == "compiling, once on this machine (about 3 min)"


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
