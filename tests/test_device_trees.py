"""Greedy token trees grown on the device (sampling/drafters/device_tree.py): the blocks' layout and widths, the
host's tree rebuilt from what it reads (ranks, parents, a candidate without mass, the cache's block), greedy output
token-identical to plain greedy decoding alone and in a batch, the drafter's cache kept exact, the planner's
pricing of whole paths, and one host read per step for the tree."""

import pytest
import torch

from sampling import SpeculativeStats, autoregressive_generate, speculative_generate
from sampling.drafters.device_tree import Growth, expansion_widths, path_layout
from sampling.drafters.model_drafter import ModelDrafter
from sampling.drafters.model_tree import RowTree
from sampling.policy.tree_choice import TreeAcceptance, positional_tree
from tests import test_model_trees
from tests.models import DECODER_ONLY, prompt, tiny_model
from tests.test_host_reads import Steps, count_reads
from tests.test_model_trees import seeded, tree_steps
from utils.logits_processors import MultinomialProcessor, NucleusProcessor


@pytest.fixture
def on_device(monkeypatch):
    monkeypatch.setattr(ModelDrafter, "DEVICE", True)


def test_a_pass_feeds_the_root_then_each_path_depth_by_depth():
    assert path_layout(3, 1) == [-1, 0, 0, 0]
    # two paths of three: depth 1 at 1, 2; depth 2 at 3, 4; depth 3 at 5, 6
    assert path_layout(2, 3) == [-1, 0, 0, 1, 2, 3, 4]


def test_each_depth_expands_what_the_positional_model_expands_there():
    nodes = [(-1, 1, 0), (0, 2, 0), (-1, 1, 1), (1, 3, 0), (0, 2, 1), (2, 2, 0)]  # (parent, depth, rank)
    assert expansion_widths(nodes) == [2, 1]  # nodes 0 and 2 at depth 1, node 1 at depth 2; none at depth 3
    assert expansion_widths([(-1, 1, 0), (-1, 1, 1)]) == []
    nodes, _ = positional_tree(TreeAcceptance(), 3, 8)
    widths = expansion_widths(nodes)
    assert len(widths) == max(depth for _, depth, _ in nodes) - 1 and all(w >= 1 for w in widths)


def test_beams_are_a_depths_best_candidates_and_their_paths_are_fed_depth_by_depth():
    def add(growth, qs):  # greedy children: the top two
        factors, tokens = qs.topk(2, dim=-1)
        growth.add(qs, tokens, factors)

    growth = Growth()
    add(growth, torch.tensor([[0.1, 0.5, 0.0, 0.4]]))  # the root's children: 1 (0.5), 3 (0.4)
    assert growth.choose(2).tolist() == [1, 3]
    add(growth, torch.tensor([[0.7, 0.2, 0.05, 0.05], [0.1, 0.1, 0.2, 0.6]]))  # children: 0, 1; 3, 2
    # scores: 0.35, 0.1 (under 1); 0.24, 0.08 (under 3): the best two are 0 (under 1) and 3 (under 3)
    assert growth.choose(2).tolist() == [1, 3, 0, 3]
    assert [beams.tolist() for beams in growth.beams] == [[0, 1], [0, 2]]


def test_the_host_rebuilds_the_tree_its_ranks_and_the_caches_block():
    levels = [([5, 7], [0.6, 0.3]), ([8, 9, 4, 0], [0.5, 0.0, 0.9, 0.1])]  # 9 has no mass
    tree = RowTree.from_levels([1, 2, 3], levels, [[1, 0]], [], sampled=False)  # beams: 7 first, then 5
    assert [(c.token, c.parent, c.depth, c.rank) for c in tree.candidates] == [
        (5, -1, 1, 0), (7, -1, 1, 1), (8, 1, 2, 0), (4, 0, 2, 0), (0, 0, 2, 1)]
    assert tree.candidates[3].score == pytest.approx(0.54)
    assert tree.fed == [1, 0] and tree.fed_parents == [0, 0]  # the last pass's block after the root
    assert tree.kept([0, 3]) == [1] and tree.kept([2]) == [] and tree.kept([1, 2]) == [0]


@pytest.mark.parametrize("name", DECODER_ONLY)
def test_greedy_trees_grown_on_the_device_are_token_identical_to_greedy(name, on_device):
    target, drafter = tiny_model(name), tiny_model(name, seed=1)
    for seed in range(2):
        inputs = prompt(seed, length=8 + 9 * seed)
        reference = autoregressive_generate(inputs, target, max_gen_len=24)
        for branching, gamma in [(2, 3), (3, 6), (3, 12)]:
            stats = SpeculativeStats()
            out, _ = speculative_generate(inputs, drafter, target, gamma=gamma, max_gen_len=24, branching=branching,
                                          stats=stats)
            assert out == reference, (name, seed, branching, gamma)
            assert tree_steps(stats)
        end = reference[5]
        out, _ = speculative_generate(inputs, drafter, target, gamma=5, max_gen_len=24, branching=3, end_tokens_id=end)
        assert out == autoregressive_generate(inputs, target, max_gen_len=24, end_tokens_id=end)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_a_target_drafting_for_itself_has_its_first_children_accepted(name, on_device):
    """The drafter's cache holds exactly the accepted tokens after each step (`RowTree.kept`): with q = p the first
    child of every reached node is the target's argmax."""
    target = tiny_model(name)
    stats = SpeculativeStats()
    speculative_generate(prompt(2), target, target, gamma=6, max_gen_len=30, branching=2, stats=stats)
    assert stats.steps_without_drafts <= 1
    assert stats.accepted_by_position[0] == stats.proposed_by_position[0]
    assert stats.tau >= 2.0 and tree_steps(stats)


def test_a_row_of_a_batch_is_the_single_call(on_device):
    target, drafter = tiny_model("llama"), tiny_model("llama", seed=1)
    rows = [prompt(0), prompt(1, length=5), prompt(2, length=17)]
    alone = [autoregressive_generate(row, target, max_gen_len=16) for row in rows]
    assert [ids for ids, _ in speculative_generate(rows, drafter, target, gamma=5, max_gen_len=16, branching=3)] == alone


@pytest.mark.parametrize("share_cache", [True, False])
def test_the_self_drafters_trees_grown_on_the_device_are_plain_greedy(share_cache, on_device):
    """The target's own weights in four bits, over the target's cache or its own, one row and a batch."""
    target = tiny_model("qwen2")
    rows = [prompt(0), prompt(1, length=5), prompt(2, length=17)]
    alone = [autoregressive_generate(row, target, max_gen_len=20) for row in rows]
    stats = SpeculativeStats()
    assert speculative_generate(rows[2], "self", target, gamma=6, max_gen_len=20, branching=3, stats=stats,
                                share_cache=share_cache)[0] == alone[2]
    assert tree_steps(stats)
    batch = speculative_generate(rows, "self", target, gamma=6, max_gen_len=20, branching=3, share_cache=share_cache)
    assert [ids for ids, _ in batch] == alone


@pytest.mark.parametrize("max_gen_len,gamma,branching,name", [(2, 3, 3, "llama"), (3, 6, 2, "gpt2")],
                         ids=["depth 1", "depth 2"])
def test_sampled_trees_grown_on_the_device_follow_the_target_law(max_gen_len, gamma, branching, name, on_device):
    """The joint law of the first two tokens (`test_model_trees`'s test, children drawn on the device)."""
    test_model_trees.test_tree_sampling_follows_the_target_distribution(max_gen_len, gamma, branching, name)


def test_drafter_invariant_trees_grown_on_the_device_return_plain_samplings_tokens(on_device):
    test_model_trees.test_drafter_invariant_trees_return_the_tokens_of_plain_sampling("qwen2")


def test_seeded_sampled_trees_grown_on_the_device_reproduce_themselves_and_rows_are_single_calls(on_device):
    test_model_trees.test_seeded_tree_sampling_reproduces_itself()
    target, drafter = tiny_model("gpt2"), tiny_model("gpt2", seed=1)
    rows, seeds = [prompt(0), prompt(1, length=5), prompt(2, length=17)], [3, 4, 5]
    processor = NucleusProcessor(temperature=1.2, top_p=0.95)
    single = [speculative_generate(row, drafter, target, gamma=5, max_gen_len=16, branching=2, logits_processor=processor,
                                   generator=seeded(s))[0] for row, s in zip(rows, seeds, strict=True)]
    batch = speculative_generate(rows, drafter, target, gamma=5, max_gen_len=16, branching=2, logits_processor=processor,
                                 generator=[seeded(s) for s in seeds])
    assert [ids for ids, _ in batch] == single


ROWS = [prompt(0, length=6) * 2, prompt(1, length=5) * 2, prompt(2, length=7)]
SAMPLED = {"logits_processor": MultinomialProcessor(temperature=1.0)}
READ_CASES = {  # (rows, keyword arguments)
    "greedy": (ROWS[0], {}),
    "sampled": (ROWS[0], SAMPLED),
    "coupled": (ROWS[0], {**SAMPLED, "drafter_invariant": True}),
    "batch": (ROWS, {}),
    "batch sampled": (ROWS, SAMPLED),
}


@pytest.mark.parametrize("case", sorted(READ_CASES))
def test_a_tree_grown_on_the_device_reads_the_host_at_most_twice_a_step(case, on_device):
    """Host reads (`test_host_reads.count_reads`): at most two a step (the tree's candidates, then the verdicts of
    every row) and one a generation per row (its seeds' table of numbers, read once per 64 positions)."""
    target, drafter = tiny_model("llama"), tiny_model("llama", seed=1)
    rows, kwargs = READ_CASES[case]
    batch = rows is ROWS

    def run(policy):
        generator = [seeded(b) for b in range(len(rows))] if batch else seeded(0)
        return speculative_generate(rows, drafter, target, max_gen_len=24, branching=3, draft_policy=policy,
                                    generator=generator, **kwargs)

    run(Steps(5))  # calibrated before counting
    policy = Steps(5)
    reads = count_reads(lambda: run(policy))
    assert policy.steps > 0
    assert reads <= 2 * policy.steps + (len(rows) if batch else 1), f"{case}: {reads} host reads in {policy.steps} steps"


def test_whole_paths_are_priced_as_the_device_feeds_them():
    from sampling.policy.tree_choice import TreePlanner

    class Flat:  # every pass costs its width in one-token target passes
        prior_share = 1.0

        def __init__(self):
            self.target_costs = self

        def seconds(self, _):
            return None

        def __call__(self, extra):
            return 1.0 + extra

    costs = Flat()
    planner = TreePlanner(costs, costs, 2, TreeAcceptance())
    nodes = [(-1, 1, 0), (0, 2, 0), (0, 2, 1), (1, 3, 0), (2, 3, 0)]  # two branches under node 0, one child each
    union = planner.drafting_costs(nodes)
    planner.paths = True
    paths = planner.drafting_costs(nodes)
    # the root's pass costs 1; depth 1's pass feeds the root and node 0 (2); depth 2's, the host's: the root and
    # the union {0, 1}, then {0, 1, 2} (3, then 4); the device's: the root and whole paths, 1 x 2, then 2 x 2 (3, 5)
    assert union == [1, 3, 3, 6, 7] and paths == [1, 3, 3, 6, 8]
