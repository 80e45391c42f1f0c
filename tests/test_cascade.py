"""Cascade drafting (sampling/drafters/cascade.py): the drafter model checks a proposer's tokens in one pass of
its own. The main property: with the cascade on or off (same seeds) every step drafts the very same
tokens and every output is the same, greedy and sampling, one row and batches, whatever the
proposer proposes and however many of its tokens the policy feeds. Then the proposer, and the policy
under given cost tables (the issue's measured bfloat16 and AVX2 float32 tables)."""

import random

import pytest

from ngram_assisted import MultiDynaGram
from sampling import SpeculativeStats, autoregressive_generate, speculative_generate
from sampling.drafters.cascade import Cascade, PromptLookup
from sampling.policy.draft_confidence import forget_pair_records
from tests.cost_tables import AVX2_FP32, BF16_05B, fix_costs
from tests.models import prompt, tiny_model
from tests.test_drafter_invariant import near_copy, seeded
from utils.cost_model import PassCosts
from utils.logits_processors import GreedyProcessor, NucleusProcessor, TopKProcessor

# Relative cost of a pass over 1 + k tokens (issue 34; REFERENCE_NOTES "Fifth round").


def table(relative: dict[int, float], seconds: float = 0.058) -> PassCosts:
    return PassCosts(relative=dict(relative), one_token_seconds=seconds, measured=True)


def test_prompt_lookup_proposes_what_followed_the_longest_suffix_latest_first():
    lookup = PromptLookup(max_match=4)
    lookup.start(1)
    text = [1, 2, 3, 9, 9, 2, 3, 7, 8, 5, 2, 3]
    # suffix [2, 3]: latest earlier occurrence at 5..6, followed by 7, 8 (not the older 1, 2, 3 -> 9)
    assert lookup.propose(0, text, [], 3) == (2, [7, 8, 5])
    assert lookup.propose(0, text[:-1], [3], 2) == (2, [7, 8])  # the drafts are part of the text
    assert lookup.propose(0, text, [4], 2) == (0, [])  # 4 never occurred
    # A longer match wins over a later shorter one: [5, 6, 7] then 1 ... 7 again later
    lookup.start(1)
    assert lookup.propose(0, [5, 6, 7, 1, 2, 0, 7, 3, 5, 6], [7], 2) == (3, [1, 2])


def test_prompt_lookup_reindexes_a_text_that_changed():
    lookup = PromptLookup(max_match=3)
    lookup.start(1)
    assert lookup.propose(0, [1, 2, 3, 4, 1, 2], [], 2) == (2, [3, 4])
    # The tail was re-read (another tokenizer's text): the old "3 4" after "1 2" is gone.
    assert lookup.propose(0, [1, 2, 5, 6, 1, 2], [], 2) == (2, [5, 6])
    assert lookup.propose(0, [1, 2, 5, 6, 1, 2, 5, 9, 1, 2], [], 1) == (2, [5])


def test_the_policy_feeds_many_where_wide_passes_are_cheap_and_none_where_they_are_dear():
    cheap = Cascade(table(BF16_05B))
    for _ in range(100):  # the proposer's tokens are the drafter's own 9 times in 10
        cheap.acceptance.update(3, 10, 9)
    assert cheap.choose(3, 16, 1, 1) >= 8
    dear = Cascade(table(AVX2_FP32))
    for _ in range(100):  # rarely right
        dear.acceptance.update(3, 20, 1)
    assert dear.choose(3, 16, 1, 1) == 0
    # Free proposals are fed however doubtful; dear ones only when they are right often.
    assert Cascade(table(BF16_05B)).choose(1, 2, 1, 1) == 2
    good_but_dear = Cascade(table(AVX2_FP32))
    for _ in range(100):
        good_but_dear.acceptance.update(3, 10, 9)
    assert good_but_dear.choose(3, 16, 1, 1) > 0
    assert cheap.choose(3, 0, 1, 1) == 0  # nothing to feed


def test_the_policy_learns_from_every_lookup_fed_or_not():
    cascade = Cascade(table(AVX2_FP32))
    cascade.start(1)
    before = cascade.acceptance(2)
    for _ in range(30):
        cascade.propose(0, [1, 2, 3, 1, 2], [], 4, 1, 1)  # proposes 3, 1, 2
        cascade.finish(0, [9, 9, 9, 9])  # the drafter drafted otherwise
    assert cascade.acceptance(2) < before / 3
    for _ in range(60):
        cascade.propose(0, [1, 2, 3, 1, 2], [], 4, 1, 1)
        cascade.finish(0, [3, 1, 2, 3])
    assert cascade.acceptance(2) > 0.8


def record_chains(steps, rows):
    """{row's sequence before a step: the chain drafted there}, from a run's on_step log."""
    sequences, chains = [list(row) for row in rows], {}
    for step in steps:
        chains[tuple(sequences[step.row])] = step.drafts
        sequences[step.row] += step.tokens
    return chains


@pytest.fixture
def oracle(monkeypatch):
    """A proposer that knows the chain the drafter will draft (from a cascade-off run) and spoils one
    of its tokens now and then; the policy feeds a random number of its tokens."""
    rng = random.Random(0)
    chains = {}

    def propose(self, row, sequence, drafts, limit):
        chain = chains.get(tuple(sequence), ())
        if list(chain[: len(drafts)]) != drafts:
            return 0, []
        tokens = list(chain[len(drafts) : len(drafts) + limit])
        if tokens and rng.random() < 0.4:
            tokens[rng.randrange(len(tokens))] = 3 + rng.randrange(90)  # possibly the same token: fine
        return 3, tokens

    monkeypatch.setattr(PromptLookup, "propose", propose)
    monkeypatch.setattr(Cascade, "choose", lambda self, match, available, fed, rows: rng.randint(0, available))
    return chains


# A tiny model's passes on a quiet CPU: a wider pass costs next to nothing more (what its calibration measures).
TINY_MODEL = {0: 1.0, 8: 1.02, 16: 1.05, 31: 1.1}


@pytest.fixture
def fixed_costs(monkeypatch):
    """Adaptive draft lengths from fixed costs: no timing moves them (so two runs draft alike), and the
    same table on a quiet machine and a busy one (whose calibration gives up for the prior)."""
    fix_costs(monkeypatch, TINY_MODEL, drafter_step_cost=0.05)


def run(rows, drafter, target, cascade, seed=None, **kwargs):
    forget_pair_records()  # each run from the prior: the drafts of two runs compared step by step
    steps, stats = [], SpeculativeStats()
    generator = None if seed is None else ([seeded(seed + b) for b in range(len(rows))] if len(rows) > 1 else seeded(seed))
    # Chains (branching=1): the cascade drafts chains; a tree step (the default where the costs say trees
    # pay, sampling/drafters/model_tree.py) does not use the proposer.
    out = speculative_generate(rows if len(rows) > 1 else rows[0], drafter, target, max_gen_len=24, cascade=cascade,
                               on_step=steps.append, stats=stats, generator=generator, branching=1, **kwargs)
    return out, steps, stats


CASES = [(GreedyProcessor(), None), (TopKProcessor(0.9, 8), 5), (NucleusProcessor(0.8, 0.9), 7)]


@pytest.mark.parametrize("name", ["llama", "gpt2", "qwen2"])
@pytest.mark.parametrize("adaptive", [False, True])
def test_the_same_drafts_and_outputs_with_the_cascade_on_or_off(name, adaptive, oracle, fixed_costs):
    target = tiny_model(name)
    drafter = near_copy(target, scale=0.05)
    saved = 0
    for processor, seed in CASES:
        for rows in ([prompt(0)], [prompt(1), prompt(2)[:6], prompt(3)]):
            kwargs = dict(gamma=6, adaptive_gamma=adaptive, logits_processor=processor)
            off, off_steps, off_stats = run(rows, drafter, target, False, seed, **kwargs)
            oracle.clear()
            oracle.update(record_chains(off_steps, rows))
            on, on_steps, on_stats = run(rows, drafter, target, True, seed, **kwargs)
            assert on == off and on_steps == off_steps
            assert off_stats.cascade_proposed == 0 and on_stats.cascade_accepted <= on_stats.cascade_proposed
            if len(rows) == 1:  # each proposal the pass went on after saved one pass
                assert on_stats.drafter_forwards == off_stats.drafter_forwards - on_stats.cascade_accepted
            else:  # a batch's passes are shared: a pass is saved when no row needs it
                assert on_stats.drafter_forwards <= off_stats.drafter_forwards
            saved += on_stats.cascade_accepted
            if seed is None:
                references = [autoregressive_generate(row, target, max_gen_len=24) for row in rows]
                assert [ids for ids, _ in (on if len(rows) > 1 else [on])] == references
    assert saved > 10


def test_the_real_proposer_saves_drafter_passes_on_repeating_text():
    target = tiny_model("gpt2")
    pattern = prompt(0)[:6]
    stats = {}
    for cascade in (False, True):
        out, steps, stats[cascade] = run([pattern * 4], target, target, cascade, gamma=12)
        assert out[0] == autoregressive_generate(pattern * 4, target, max_gen_len=24)
    assert stats[True].cascade_accepted > 0
    assert stats[True].drafter_forwards < stats[False].drafter_forwards


def test_the_hybrid_drafts_alike_with_the_cascade_on_or_off(oracle, fixed_costs):
    target = tiny_model("llama")
    drafter = near_copy(target, scale=0.05)
    rows = [prompt(0), prompt(1)[:7]]
    for processor, seed in CASES[:2]:
        kwargs = dict(gamma=6, adaptive_gamma=True, logits_processor=processor)
        off, off_steps, _ = run(rows, drafter, target, False, seed, ngram=MultiDynaGram(4), **kwargs)
        oracle.clear()
        oracle.update(record_chains(off_steps, rows))
        on, on_steps, _ = run(rows, drafter, target, True, seed, ngram=MultiDynaGram(4), **kwargs)
        assert on == off and on_steps == off_steps


def test_cascade_is_on_by_default_with_adaptive_gamma_only(monkeypatch, fixed_costs):
    target = tiny_model("llama")
    drafter = near_copy(target, scale=0.05)
    made = []
    original = Cascade.__init__

    def spy(self, *args, **kwargs):
        made.append(self)
        original(self, *args, **kwargs)

    monkeypatch.setattr(Cascade, "__init__", spy)
    speculative_generate(prompt(0), drafter, target, max_gen_len=4)
    assert not made
    speculative_generate(prompt(0), drafter, target, max_gen_len=4, adaptive_gamma=True)
    assert len(made) == 1
    speculative_generate(prompt(0), drafter, target, max_gen_len=4, adaptive_gamma=True, cascade=False)
    assert len(made) == 1


def test_bad_cascade_arguments_are_refused_before_any_model_runs():
    target = tiny_model("llama")
    with pytest.raises(TypeError, match="cascade must be a bool or None, got 'yes'"):
        speculative_generate(prompt(0), target, target, cascade="yes")

    class Echo:
        forward_passes = 0

        def start(self, sequences): ...
        def draft(self, sequences, max_drafts, max_depths): ...
        def update(self, sequences, paths, target_logits, p): ...
        def select_rows(self, keep): ...

    with pytest.raises(ValueError, match="cascade=True"):
        speculative_generate(prompt(0), Echo(), target, cascade=True)


@pytest.mark.parametrize("adaptive", [False, True])
def test_a_drafter_with_another_tokenizer_drafts_alike_with_the_cascade_on_or_off(adaptive, fixed_costs):
    from tests.test_universal import PROMPTS, models_for

    target, tokenizer, drafter, drafter_tokenizer = models_for("llama", "qwen2")
    proposed = 0
    for processor, seed in CASES[:2]:
        for text in PROMPTS:
            ids = tokenizer.encode(text * 3)  # repeated text: the proposer finds matches
            kwargs = dict(gamma=6, adaptive_gamma=adaptive, logits_processor=processor, tokenizer=tokenizer,
                          drafter_tokenizer=drafter_tokenizer)
            off, off_steps, _ = run([ids], drafter, target, False, seed, **kwargs)
            on, on_steps, on_stats = run([ids], drafter, target, True, seed, **kwargs)
            assert on == off and on_steps == off_steps
            proposed += on_stats.cascade_proposed
    assert proposed > 0 or adaptive  # adaptive: this random drafter's short chains leave nothing to propose


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_encoder_decoder_drafts_alike_with_the_cascade_on_or_off(name):
    from sampling import speculative_generate_encoder_decoder

    target = tiny_model(name)
    drafter = near_copy(target, scale=0.05)
    pattern = prompt(0)[:6]
    for processor, seed in CASES[:2]:
        outs = {}
        for cascade in (False, True):
            steps, stats = [], SpeculativeStats()
            rows = [pattern * 3, prompt(1)]
            generators = None if seed is None else [seeded(seed), seeded(seed + 1)]
            out = speculative_generate_encoder_decoder(rows, drafter, target, gamma=8, max_gen_len=24, cascade=cascade,
                                                       logits_processor=processor, generator=generators,
                                                       on_step=steps.append, stats=stats)
            outs[cascade] = (out, steps)
        assert outs[True] == outs[False]
