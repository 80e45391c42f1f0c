"""Token trees: one pass scores every node as its own path, the cache keeps exactly the accepted path,
NASD with branching is token-identical to greedy decoding and exact in sampling."""

from __future__ import annotations

import pytest
import torch

from ngram_assisted import (
    MultiDynaGram,
    SimpleDynaGram,
    ngram_assisted_speculative_generate,
    ngram_assisted_speculative_generate_encoder_decoder,
)
from sampling import SpeculativeStats, autoregressive_generate, autoregressive_generate_encoder_decoder
from sampling.loop.acceptance import walk_tree
from tests.models import DECODER_ONLY, ENCODER_DECODER, prompt, tiny_model
from tests.stats_helpers import P_VALUE_THRESHOLD, SAMPLES, chi_square_p_value, exact_two_token_distribution, first_two_tokens
from utils.logits_processors import GreedyProcessor, MultinomialProcessor
from utils.runners import SequenceRunner

TOKENS = [10, 11, 12, 13, 14, 15]
PARENTS = [-1, -1, 0, 0, 2, 1]  # two children at the root, two under node 0, chains below


def greedy_accept_tree(target_logits: torch.Tensor, tokens: list[int], parents: list[int]) -> tuple[list[int], int]:
    """Greedy verification of a draft tree, the rule by hand: `walk_tree` along the argmax."""
    argmax = target_logits.argmax(dim=-1).tolist()
    return walk_tree(tokens, parents, lambda row, depth: argmax[row])


def path_tokens(node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(TOKENS[node])
        node = PARENTS[node]
    return path[::-1]


@pytest.mark.parametrize("name", DECODER_ONLY)
def test_one_tree_pass_scores_each_node_as_its_own_path(name):
    model = tiny_model(name)
    context = prompt(0, length=20)  # longer than the Mistral-style window (8): it must be folded in
    runner = SequenceRunner(model)
    runner.forward(context[:-1])
    assert runner.supports_trees
    logits = runner.forward_tree(context[-1], TOKENS, PARENTS)
    with torch.no_grad():
        for row in range(len(TOKENS) + 1):
            ids = context + path_tokens(row - 1)
            expected = model(torch.tensor([ids])).logits[0, -1]
            # Eager attention takes its softmax in float32: rows of other lengths round differently.
            torch.testing.assert_close(logits[row], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", DECODER_ONLY)
def test_the_cache_after_a_tree_step_is_the_cache_of_the_accepted_tokens(name):
    model = tiny_model(name)
    context = prompt(1, length=14)
    runner = SequenceRunner(model)
    runner.forward(context[:-1])
    runner.forward_tree(context[-1], TOKENS, PARENTS)
    runner.keep_path(len(context) - 1, [0, 2, 4])
    accepted = context + path_tokens(4)
    assert runner.tokens == accepted
    reference = SequenceRunner(model)
    for token in accepted:  # fed one by one
        reference.forward([token])
    for mine, theirs in zip(runner._cache.layers, reference._cache.layers, strict=True):
        torch.testing.assert_close(mine.keys, theirs.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mine.values, theirs.values, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(runner.forward([7]), reference.forward([7]), rtol=1e-5, atol=1e-5)


def test_greedy_acceptance_walks_the_argmax_path():
    logits = torch.zeros(1 + len(TOKENS), 20)
    for row, wanted in [(0, 10), (1, 13), (4, 3)]:  # root -> node 0 (10) -> node 3 (13), then 3
        logits[row, wanted] = 1.0
    assert greedy_accept_tree(logits, TOKENS, PARENTS) == ([0, 3], 3)
    logits[0] = 0.0
    logits[0, 11] = 1.0  # the second root candidate
    logits[2, 15] = 1.0
    logits[6, 9] = 1.0
    assert greedy_accept_tree(logits, TOKENS, PARENTS) == ([1, 5], 9)


def branchy_prompt(seed: int) -> list[int]:
    """A random text whose n-grams continue several ways (what a tree is for)."""
    base = prompt(seed, length=12)
    return base + base[:5] + [base[7]] + base[:4] + [base[9]] + base[:5]


@pytest.mark.parametrize("name", DECODER_ONLY + ENCODER_DECODER)
def test_greedy_trees_are_token_identical_to_greedy(name):
    model = tiny_model(name)
    inputs = branchy_prompt(0)
    if name in ENCODER_DECODER:
        reference = autoregressive_generate_encoder_decoder(inputs, model, max_gen_len=30)
        generate = ngram_assisted_speculative_generate_encoder_decoder
    else:
        reference = autoregressive_generate(inputs, model, max_gen_len=30)
        generate = ngram_assisted_speculative_generate
    trees = 0
    for branching in (1, 2, 3, None):
        for stop_if_unknown in (True, False):
            for use_cache in (True, False):
                steps = []
                out, _ = generate(inputs, MultiDynaGram(3), model, gamma=6, max_gen_len=30, branching=branching,
                                  stop_if_unknown=stop_if_unknown, use_cache=use_cache, on_step=steps.append)
                assert out == reference, (name, branching, stop_if_unknown, use_cache)
                trees += branching != 1 and any(len(step.drafts) > step.accepted + 1 for step in steps)
    assert trees > 0 or name in ENCODER_DECODER  # trees were verified (encoder-decoder models verify chains)


def test_a_second_candidate_saves_passes_where_the_first_is_wrong():
    model = tiny_model("llama")
    inputs = prompt(5, length=12)
    reference = autoregressive_generate(inputs, model, max_gen_len=24)
    passes = {}
    for branching in (1, 2):
        pool = SimpleDynaGram(3)
        text = inputs + reference
        for i in range(len(inputs), len(text)):  # the right continuation once, a wrong one twice
            pool.add(text[i - 2 : i], text[i])
            pool.add(text[i - 2 : i], (text[i] + 1) % 96 or 3, count=2)
        stats = SpeculativeStats()
        out, _ = ngram_assisted_speculative_generate(inputs, pool, model, gamma=4, max_gen_len=24, branching=branching,
                                                     stop_if_unknown=False, stats=stats)
        assert out == reference
        passes[branching] = stats.target_forwards
    assert passes[2] <= 0.6 * passes[1], passes


INPUTS = [3, 4, 3, 5, 3, 6, 3]  # after 3 the pool knows 4, 5 and 6: three candidates at the root


@pytest.mark.slow
def test_tree_sampling_follows_the_target_distribution():
    target = tiny_model("llama", vocab=8)
    processor = MultinomialProcessor(temperature=2.0)
    first_steps = {}  # (call, row) -> the row's first step

    def generate(rows, generator):
        call = len(first_steps)  # the rows seen before: unique to this call
        return ngram_assisted_speculative_generate(
            rows, [SimpleDynaGram(2) for _ in rows], target, gamma=3, max_gen_len=4, branching=3, stop_if_unknown=False,
            logits_processor=processor, generator=generator,
            on_step=lambda step: first_steps.setdefault((call, step.row), step))

    pairs = first_two_tokens(generate, INPUTS)  # the first two tokens' joint law
    assert len(first_steps) == SAMPLES
    assert all(len(step.drafts) == 3 for step in first_steps.values())  # every first step verified a three-candidate tree
    joint = exact_two_token_distribution(target, INPUTS, processor)
    assert chi_square_p_value(pairs, joint) > P_VALUE_THRESHOLD


@pytest.mark.parametrize("processor", [GreedyProcessor(), MultinomialProcessor(temperature=2.0)], ids=repr)
def test_a_tree_is_drafted_when_one_token_of_room_is_left(processor):
    """Only a path's depth can become generated tokens: with max_gen_len=2 the first step may
    draft one level, and that level holds all three candidates the pool knows."""
    target = tiny_model("llama", vocab=8)
    steps = []
    ngram_assisted_speculative_generate(INPUTS, SimpleDynaGram(2), target, gamma=3, max_gen_len=2, branching=3,
                                        stop_if_unknown=False, logits_processor=processor, on_step=steps.append,
                                        generator=torch.Generator().manual_seed(0))
    assert sorted(steps[0].drafts) == [4, 5, 6]


def test_bad_branching_is_explained():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="branching"):
        ngram_assisted_speculative_generate(prompt(0), MultiDynaGram(3), model, branching=0)
    with pytest.raises(TypeError, match="branching"):
        ngram_assisted_speculative_generate(prompt(0), MultiDynaGram(3), model, branching=1.5)
