"""SuffixDecoding as a benchmark peer: its drafts go through the library's loop and keep greedy
decoding's tokens. The adapter is tested on the pure-Python stand-in; the real peer (a C++
build, never needed by the library) is tested when it has been built here."""

import pytest

from benchmarks.suffix_decoding import PythonSuffixCache, SuffixDrafter, load_peer, run_suffix
from sampling import SpeculativeStats, autoregressive_generate
from tests import conftest
from tests.models import prompt, tiny_model


def check_cache(cache):
    model = tiny_model("llama")
    first, second = prompt(1, length=6) * 3, prompt(2, length=5) * 2
    for inputs in (first, second, first):  # the third call finds the first response in the global tree
        reference = autoregressive_generate(inputs, model, max_gen_len=20)
        stats, steps = SpeculativeStats(), []
        out, _ = run_suffix(inputs, model, cache, max_new_tokens=20, end_tokens=None, stats=stats, on_step=steps.append)
        assert out == reference
    assert stats.drafts_accepted > 5 and stats.tau > 1.3, stats  # the earlier response is copied


def test_the_adapter_keeps_greedy_tokens_with_the_python_stand_in():
    check_cache(PythonSuffixCache(max_tree_depth=24))


def test_the_stand_in_drafts_the_longest_match_and_stops_by_probability():
    cache = PythonSuffixCache(max_tree_depth=24)
    drafter = SuffixDrafter(cache)
    drafter.start([5, 6, 7, 8, 5, 6, 7, 9, 5, 6])
    tree, _ = drafter.draft([5, 6, 7, 8, 5, 6, 7, 9, 5, 6], max_drafts=8, max_depth=8)
    assert tree.tokens[:1] == [7] and tree.is_chain  # "5 6" -> 7 twice
    tree, _ = drafter.draft([5, 6, 7, 8, 5, 6, 7, 9, 5, 6], max_drafts=8, max_depth=1)
    assert len(tree) == 1  # no path deeper than the room left


def test_the_real_peer_when_it_is_built(monkeypatch):
    if conftest.USER_CACHE is None:  # the peer is built into the user's cache folder, not the tests' one
        monkeypatch.delenv("SPECDEC_CACHE")
    else:
        monkeypatch.setenv("SPECDEC_CACHE", conftest.USER_CACHE)
    peer, why = load_peer()
    if peer is None:
        pytest.skip(why)
    check_cache(peer(max_tree_depth=24))


def test_a_benchmark_run_sees_the_other_prompts_responses_not_its_own(monkeypatch):
    """Spec-Bench runs every prompt several times: the peer's global tree must hold the responses
    to the other prompts only, or the repeats would copy the first run's response whole."""
    import benchmarks.spec_bench as spec_bench

    monkeypatch.setattr(spec_bench, "load_peer", lambda: (PythonSuffixCache, ""))
    given = []  # the earlier responses each run's cache was built with
    build = spec_bench.cache_with_responses
    monkeypatch.setattr(spec_bench, "cache_with_responses", lambda peer, responses: given.append(responses) or build(peer, responses))
    model = tiny_model("llama")
    runner = spec_bench.Runner(model, None, end_tokens=[], max_new_tokens=20, sample=None)
    first, second = prompt(1, length=6), prompt(2, length=5)
    answers = {tuple(p): autoregressive_generate(p, model, max_gen_len=20) for p in (first, second)}
    for inputs in (first, first, second, first):
        out, _ = runner.run("suffix", inputs)
        assert out == answers[tuple(inputs)]
    assert given == [[], [], [answers[tuple(first)]], [answers[tuple(second)]]]
