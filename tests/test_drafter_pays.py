"""A drafter that never loses (issue 34, item 4): a drafter whose drafts the target never accepts,
under costs where drafting is not free, soon drafts nothing (plain decoding at a verification's
cost) and spends far fewer passes than tokens generated: a model drafter, one with another
tokenizer, and the hybrid. Outputs stay exact meanwhile."""

import copy

import pytest
import torch

from ngram_assisted import MultiDynaGram
from sampling import SpeculativeStats, autoregressive_generate, speculative_generate
from sampling.policy.draft_confidence import ConfidenceStop
from sampling.policy.draft_policy import CostAwareDraftLength
from tests.cost_tables import AVX2_FP32, BF16_15B, fix_costs
from tests.models import prompt, tiny_model
from utils.cost_model import PassCosts

TOKENS = 96


def contrary(target):
    """The target with its output rows shifted by one: its argmax is always the target's + 1 (a head tied to the
    input embedding is untied first: shifted there too, the twin would read another text and agree now and then)."""
    twin = copy.deepcopy(target)
    head = twin.get_output_embeddings()
    head.weight = torch.nn.Parameter(torch.roll(head.weight.detach(), 1, dims=0))
    assert head.weight.data_ptr() != twin.get_input_embeddings().weight.data_ptr()
    return twin


@pytest.fixture
def dear_drafting(monkeypatch):
    """Every model's passes cost the AVX2 table; a drafted token costs 0.37 of a target pass (the
    0.5B's share of the 1.5B's pass); no timing moves either."""
    fix_costs(monkeypatch, AVX2_FP32, 0.37)


def assert_soon_plain(stats: SpeculativeStats) -> None:
    assert stats.drafts_accepted == 0
    assert stats.steps_without_drafts >= 0.8 * stats.steps
    assert stats.drafter_forwards <= 0.35 * stats.generated_tokens


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_a_model_drafter_that_never_agrees_soon_drafts_nothing(name, dear_drafting):
    target = tiny_model(name)
    drafter = contrary(target)
    rows = [prompt(0), prompt(1)[:7]]
    for row in rows:
        stats = SpeculativeStats()
        out, _ = speculative_generate(row, drafter, target, adaptive_gamma=True, max_gen_len=TOKENS, stats=stats)
        assert out == autoregressive_generate(row, target, max_gen_len=TOKENS)
        assert_soon_plain(stats)
    stats = SpeculativeStats()
    speculative_generate(rows, drafter, target, adaptive_gamma=True, max_gen_len=TOKENS, stats=stats)
    assert_soon_plain(stats)


def test_the_hybrid_with_a_drafter_that_never_agrees_soon_stops_using_it(dear_drafting):
    target = tiny_model("llama")
    stats = SpeculativeStats()
    out, _ = speculative_generate(prompt(2), contrary(target), target, adaptive_gamma=True, max_gen_len=TOKENS,
                                  stats=stats, ngram=MultiDynaGram(4))
    assert out == autoregressive_generate(prompt(2), target, max_gen_len=TOKENS)
    assert stats.drafter_forwards <= 0.35 * stats.generated_tokens


def other_tokenizer_runs():
    """A llama target drafted for by a qwen2 drafter with another tokenizer (tests/test_universal.py's
    pair, a drafter that rarely agrees), on each of its prompts: the output checked against greedy
    decoding -> each run's stats."""
    from tests.test_universal import PROMPTS, models_for

    target, tokenizer, drafter, drafter_tokenizer = models_for("llama", "qwen2")
    for text in PROMPTS:
        ids = tokenizer.encode(text)
        stats = SpeculativeStats()
        out, _ = speculative_generate(ids, drafter, target, tokenizer=tokenizer, drafter_tokenizer=drafter_tokenizer,
                                      adaptive_gamma=True, max_gen_len=TOKENS, stats=stats)
        assert out == autoregressive_generate(ids, target, max_gen_len=TOKENS)
        yield stats


def test_a_drafter_with_another_tokenizer_that_rarely_agrees_soon_drafts_nothing(dear_drafting):
    for stats in other_tokenizer_runs():
        # A random drafter: it may be right now and then, but it drafts no long chains for it.
        assert stats.alpha < 0.5
        assert stats.steps_without_drafts >= 0.8 * stats.steps
        assert stats.drafter_forwards <= 0.35 * stats.generated_tokens


def test_a_chain_the_stop_drops_whole_counts_against_drafting():
    policy = CostAwareDraftLength(16, PassCosts(relative=dict(AVX2_FP32), one_token_seconds=0.1),
                                  PassCosts(relative=dict(AVX2_FP32), one_token_seconds=0.1),
                                  draft_seconds=lambda: 0.02, per_token_stop=True)
    stop = ConfidenceStop(policy)
    assert policy.budget(1) > 0
    alpha = policy.acceptance_rate
    for _ in range(10):  # drafted, none kept: passes paid for nothing
        stop.on_discard()
        policy.update(0, 0)
    assert policy.acceptance_rate < alpha / 3 and policy.budget(1) == 0


@pytest.fixture
def cheap_drafting(monkeypatch):
    """Wide passes cost what a one-token pass costs, a drafted token 0.05 of a target pass: drafting
    a token the target takes one time in ten still pays, a long chain of them does not."""
    fix_costs(monkeypatch, BF16_15B, 0.05)


def test_a_drafter_with_another_tokenizer_drafts_short_chains_where_it_is_rarely_right(cheap_drafting):
    """The other-tokenizer drafter has no per-token stop: its chains are sized by its acceptance
    (SmolLM2 for Qwen2.5-Coder on Spec-Bench drafted ~15 tokens a step at alpha 0.13 before)."""
    for stats in other_tokenizer_runs():
        assert stats.alpha < 0.5
        assert stats.drafter_forwards <= 2 * stats.steps



def test_a_drafter_dearer_than_a_third_of_the_target_says_so_once_and_a_cheap_one_says_nothing():
    """A drafter that cannot pay is never used silently: one warning per pair, with its measured costs."""
    import warnings

    from sampling.drafters import model_kind

    target = PassCosts(relative={0: 1.0, 32: 3.0}, one_token_seconds=0.1, measured=True)
    dear, cheap = copy.deepcopy(tiny_model("llama")), copy.deepcopy(tiny_model("llama"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model_kind.say_if_it_cannot_pay(dear, PassCosts(relative={0: 1.0, 32: 3.0}, one_token_seconds=0.05, measured=True),
                                            target)
            model_kind.say_if_it_cannot_pay(cheap, PassCosts(relative={0: 1.0, 32: 3.0}, one_token_seconds=0.03, measured=True),
                                            target)
            model_kind.say_if_it_cannot_pay(cheap, PassCosts(relative={0: 1.0, 32: 3.0}, one_token_seconds=None), target)
    assert [str(w.message).split(":")[0] for w in caught] == [
        "the drafter's one-token pass costs 50.0 ms here, 0.50 of the target's (100.0 ms)"]
