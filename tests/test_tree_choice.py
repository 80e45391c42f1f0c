"""Tree or chain (`sampling/policy/tree_choice.py`): the planner under cost tables written here (the drafter's
tree passes at their measured widths against the chain's timed drafting), the shape record's
warm-up, choice, exploration share and return to chains, and branching=None end to end under a fake
clock: greedy output token-identical to plain greedy decoding, the target's law in sampling."""

import copy

import pytest

from sampling import SpeculativeStats, autoregressive_generate, speculative_generate
from sampling.drafters.model_drafter import ModelDrafter
from sampling.drafters.model_tree import ModelTreeDrafter
from sampling.policy import tree_choice
from sampling.policy.draft_policy import ChainRecord, CostAwareDraftLength
from sampling.policy.tree_choice import RANK_PRIOR, ShapeRecord, TreeAcceptance, TreePlanner, shape_record
from tests.cost_tables import AVX2_FP32, BF16_05B, BF16_15B, fix_costs
from tests.models import prompt, tiny_model
from tests.stats_helpers import P_VALUE_THRESHOLD, chi_square_p_value, exact_two_token_distribution, first_two_tokens
from utils.cost_model import PassCosts
from utils.logits_processors import MultinomialProcessor

FREE = {0: 1.0, 31: 1.0}  # a pass over any width costs one (an idle accelerator)
TARGET_SECONDS = 0.158  # the 1.5B's one-token pass in bfloat16 (tests/cost_tables.py)


def planner(target: dict, drafter: dict, *, drafter_seconds: float, chain_draft_seconds: float,
            rates: tuple[float, float, float]) -> TreePlanner:
    """A planner over these tables (relative costs, one-token seconds), the chain drafter's steps timed at
    `chain_draft_seconds` a drafted token, and the per-rank acceptance rates learned as `rates`."""
    target_costs = PassCosts(dict(target), TARGET_SECONDS, measured=True)
    drafter_costs = PassCosts(dict(drafter), drafter_seconds, measured=True)
    policy = CostAwareDraftLength(16, target_costs, drafter_costs, draft_seconds=lambda: chain_draft_seconds)
    acceptance = TreeAcceptance()
    acceptance.accepted, acceptance.judged = [100.0 * r for r in rates], [100.0] * 3
    return TreePlanner(policy, drafter_costs, 3, acceptance)


def test_dear_wide_passes_make_the_planner_choose_chains_and_cheap_ones_with_second_children_trees():
    second_children = (0.6, 0.25, 0.1)  # a second child accepted often, less often than a chain's next node
    cheap = planner(FREE, FREE, drafter_seconds=0.01, chain_draft_seconds=0.01, rates=second_children)
    assert cheap.budget(16) >= 8
    steep = planner(AVX2_FP32, AVX2_FP32, drafter_seconds=0.01, chain_draft_seconds=0.01, rates=second_children)
    assert steep.budget(16) == 0
    sure = planner(FREE, FREE, drafter_seconds=0.01, chain_draft_seconds=0.01, rates=(0.95, 0.03, 0.01))
    assert sure.budget(16) == 0  # the chain's next node always adds more than a second child


def test_a_trees_drafter_passes_are_priced_at_their_own_widths():
    """A depth's pass over 2 tokens costs what the drafter's table says a pass over 2 costs (there the tree
    pays), one over 4 what it says for 4."""
    dear_wide = {0: 1.0, 1: 1.0, 2: 1.3, 3: 2.0, 15: 3.0, 31: 4.0}
    tree = planner(FREE, dear_wide, drafter_seconds=0.05, chain_draft_seconds=0.05, rates=(0.6, 0.25, 0.1))
    assert tree.pass_seconds(2, 1) == pytest.approx(0.05) and tree.pass_seconds(4, 1) == pytest.approx(0.05 * 2.0)
    assert tree.drafter_pass(1, 1) == pytest.approx(0.05 / TARGET_SECONDS)
    assert tree.budget(16) > 0


def test_a_cascaded_chain_is_priced_as_timed_and_trees_lose_to_it():
    """The real pair's tables: the chain drafter's cascade makes a drafted token cost a fraction of a
    drafter pass (its timed steps); a tree needs one pass per depth, priced at the drafter's own seconds."""
    rates = (0.5, 0.3, 0.1)
    full = planner(BF16_15B, BF16_05B, drafter_seconds=0.056, chain_draft_seconds=0.056, rates=rates)
    cascaded = planner(BF16_15B, BF16_05B, drafter_seconds=0.056, chain_draft_seconds=0.012, rates=rates)
    assert full.budget(16) > 0 and cascaded.budget(16) == 0


def test_the_drafting_overhead_timed_raises_the_price_of_a_tree():
    p = planner(FREE, FREE, drafter_seconds=0.01, chain_draft_seconds=0.01, rates=(0.4, 0.4, 0.2))
    before = p.drafter_pass(4, 1)
    p.observe_drafting(3 * (p.pass_seconds(1, 1) + p.pass_seconds(4, 1)), [1, 4], 1)  # three times its passes
    assert p.drafter_pass(4, 1) == pytest.approx(3 * before)
    assert p.rates(16)[2] < planner(FREE, FREE, drafter_seconds=0.01, chain_draft_seconds=0.01,
                                    rates=(0.4, 0.4, 0.2)).rates(16)[2]


class FakeClock:
    """The record's clock: time moves only when a test says."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_steps(record: ShapeRecord, clock: FakeClock, steps: int, seconds: dict[bool, float],
              tokens: dict[bool, int]) -> list[bool]:
    """`steps` steps where the planner proposes a tree: each shape takes its seconds and gives its tokens."""
    chosen = []
    for _ in range(steps):
        tree = record.choose()
        record.begin(tree)
        clock.now += seconds[tree]
        record.end(tokens[tree])
        chosen.append(tree)
    return chosen


def test_the_record_warms_up_then_keeps_the_faster_shape_and_explores_one_step_in_32(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(tree_choice, "clock", clock)
    record = ShapeRecord()
    warm, every = ShapeRecord.WARMUP, ShapeRecord.EXPLORE_EVERY
    chosen = run_steps(record, clock, warm, {True: 1.0, False: 1.0}, {True: 2, False: 4})
    assert chosen == [False] * warm  # chains first: trees must earn their place
    chosen = run_steps(record, clock, 320, {True: 1.0, False: 1.0}, {True: 2, False: 4})
    assert chosen.count(True) == 320 // every  # chains won: trees only to explore, one step in 32
    assert record.rate(False) == pytest.approx(4.0) and record.rate(True) == pytest.approx(2.0)


def test_trees_that_measure_better_take_over_after_their_exploration_steps(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(tree_choice, "clock", clock)
    record = ShapeRecord()
    warm, every = ShapeRecord.WARMUP, ShapeRecord.EXPLORE_EVERY
    chosen = run_steps(record, clock, warm + warm * every, {True: 1.0, False: 1.0}, {True: 6, False: 4})
    assert chosen.count(True) == warm and record.trees_pay()  # explored WARMUP times, one step in 32: they pay
    chosen = run_steps(record, clock, 64, {True: 1.0, False: 1.0}, {True: 6, False: 4})
    assert chosen.count(False) == 64 // every  # trees pay: chains only to explore


def test_the_record_goes_back_to_chains_when_trees_measure_worse(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(tree_choice, "clock", clock)
    record = ShapeRecord()
    warm, every = ShapeRecord.WARMUP, ShapeRecord.EXPLORE_EVERY
    chosen = run_steps(record, clock, warm + warm * every + 64, {True: 1.0, False: 1.0}, {True: 6, False: 4})
    assert chosen[-32:].count(False) == 1  # trees pay: chains only to explore
    chosen = run_steps(record, clock, 64, {True: 2.0, False: 1.0}, {True: 6, False: 4})  # the text changed
    assert chosen[-32:].count(True) <= 1
    # A margin: trees 3% faster are not worth the risk.
    record = ShapeRecord()
    run_steps(record, clock, 64, {True: 1.0, False: 1.0}, {True: 103, False: 100})
    assert not record.trees_pay()


def fresh(name: str, **kwargs):
    """A tiny model of its own: the suite's are shared (tests/conftest.py), and so would be their record."""
    return copy.deepcopy(tiny_model(name, **kwargs))


def timed_shapes(monkeypatch, tree_seconds: float, chain_seconds: float) -> None:
    """A fake clock under which a tree step takes `tree_seconds` and a chain step `chain_seconds`."""
    clock = FakeClock()
    monkeypatch.setattr(tree_choice, "clock", clock)
    grow, draft = ModelTreeDrafter._grow, ModelDrafter.draft

    def slow_grow(self, *args):
        clock.now += tree_seconds
        return grow(self, *args)

    def slow_draft(self, *args):
        clock.now += chain_seconds
        return draft(self, *args)

    monkeypatch.setattr(ModelTreeDrafter, "_grow", slow_grow)
    monkeypatch.setattr(ModelDrafter, "draft", slow_draft)


@pytest.mark.parametrize("trees_faster", [False, True], ids=["trees slower", "trees faster"])
def test_branching_none_follows_the_measured_record_and_stays_greedy(monkeypatch, trees_faster):
    """The cost model proposes a tree on every step (every pass costs one, the acceptance rates held at
    their priors, chains always started): after the warm-up, trees measured slower run only to explore; measured faster, on
    most steps. Greedy output is plain greedy's either way."""
    fix_costs(monkeypatch, FREE, 0.05)
    monkeypatch.setattr(TreeAcceptance, "rate", lambda self, rank: RANK_PRIOR[min(rank, len(RANK_PRIOR) - 1)])
    monkeypatch.setattr(CostAwareDraftLength, "acceptance_rate", property(lambda self: CostAwareDraftLength.PRIOR_RATE))
    monkeypatch.setattr(ChainRecord, "pays", lambda self: True)
    timed_shapes(monkeypatch, 0.5 if trees_faster else 5.0, 1.0)
    target, drafter = fresh("llama"), fresh("llama", seed=1)
    record = shape_record(drafter, target, ("greedy", 1))
    for seed in range(10):  # trees explored one step in 32 until they have WARMUP steps: enough steps for that
        inputs = prompt(seed)
        stats = SpeculativeStats()
        out, _ = speculative_generate(inputs, drafter, target, adaptive_gamma=True, max_gen_len=40, stats=stats)
        assert out == autoregressive_generate(inputs, target, max_gen_len=40)
    assert min(record.steps.values()) >= ShapeRecord.WARMUP and sum(record.steps.values()) >= 40
    later = stats.counters["tree_steps"] / (stats.steps - stats.steps_without_drafts)  # the last generation
    assert later >= 0.9 if trees_faster else later <= 0.1, (later, stats.steps, stats.counters, record.steps)
    assert record.trees_pay() == trees_faster


@pytest.mark.slow
def test_branching_none_sampling_follows_the_target_distribution_while_the_record_switches(monkeypatch):
    """The standard rule (drafter_invariant=False) with adaptive gamma, trees and chains mixed by the
    record (trees measured slower: chains, and trees every other step to explore): the joint law of the
    first two tokens is the target's. Fixed seed, p > 1e-3."""
    fix_costs(monkeypatch, FREE, 0.05)
    timed_shapes(monkeypatch, 5.0, 1.0)
    monkeypatch.setattr(ShapeRecord, "EXPLORE_EVERY", 2)  # a few steps per call: switch often enough to mix both shapes
    target, drafter = fresh("llama", seed=0, vocab=8), fresh("llama", seed=1, vocab=8)
    inputs = [3, 4, 3, 5, 3, 6, 3]
    processor = MultinomialProcessor(temperature=1.5)
    stats = SpeculativeStats()

    def generate(rows, generator):
        return speculative_generate(rows, drafter, target, adaptive_gamma=True, max_gen_len=3, drafter_invariant=False,
                                    logits_processor=processor, generator=generator, stats=stats)

    pairs = first_two_tokens(generate, inputs)
    record = shape_record(drafter, target, ("sampled", 100))
    assert record.steps[True] >= 1 and record.steps[False] >= 1 and stats.counters["tree_steps"] >= 1
    assert chi_square_p_value(pairs, exact_two_token_distribution(target, inputs, processor)) > P_VALUE_THRESHOLD
