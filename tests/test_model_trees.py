"""Token trees drafted by the drafter model (`speculative_generate(..., branching=)`, sampling/drafters/model_tree.py):
greedy output token-identical to plain greedy decoding and to chains, the target's law under recursive
rejection sampling at depth 1 and 2, plain sampling's very tokens under the drafter-invariant rule, seeded
identity, batch rows equal to single calls, the cost model's choice of tree or chain, the argument check."""

import pytest
import torch

from ngram_assisted import MultiDynaGram
from sampling import SpeculativeStats, autoregressive_generate, speculative_generate, speculative_generate_encoder_decoder
from sampling.loop.drafts import DraftTree
from sampling.loop.tree_sampling import recursive_rejection_walk
from sampling.policy.tree_choice import ShapeRecord
from tests.cost_tables import AVX2_FP32, fix_costs
from tests.models import DECODER_ONLY, prompt, tiny_model
from tests.stats_helpers import P_VALUE_THRESHOLD, chi_square_p_value, exact_two_token_distribution, first_two_tokens
from tests.test_drafter_invariant import near_copy
from utils.logits_processors import MultinomialProcessor, NucleusProcessor, TopKProcessor, inverse_cdf

FLAT = {0: 1.0, 8: 1.0, 16: 1.05, 31: 1.2}  # a pass over 32 tokens costs about one (an accelerator)


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def tree_steps(stats: SpeculativeStats) -> bool:
    """Whether some step verified a tree that was not a chain (more nodes than its depth)."""
    return stats.drafts_proposed > sum(stats.proposed_by_position)


def test_recursive_rejection_of_children_drawn_without_replacement_emits_p_and_changes_no_input():
    """The rule alone (`sampling/loop/tree_sampling.py`), no model: three children of the root drawn from q
    without replacement, 20000 draws, the emitted token's law against p (chi-square, fixed seed)."""
    from scipy.stats import chisquare

    generator = torch.Generator().manual_seed(0)
    p_root = torch.tensor([0.05, 0.3, 0.1, 0.4, 0.15], dtype=torch.float64)
    q_root = torch.tensor([0.4, 0.1, 0.3, 0.1, 0.1], dtype=torch.float64)
    p = torch.stack([p_root] + [torch.full((5,), 0.2, dtype=torch.float64)] * 3)  # rows after the children: unused
    q = q_root.expand(3, 5).clone()
    p_before, q_before = p.clone(), q.clone()
    counts = [0] * 5
    for _ in range(20000):
        u = torch.rand(8, generator=generator, dtype=torch.float64).tolist()  # 3 draws, 3 coins, 2 residuals
        remaining, children = q_root, []
        for i in range(3):
            children.append(int(inverse_cdf(remaining, u[i])))
            remaining = remaining.index_fill(0, torch.tensor([children[-1]]), 0.0)
        path, token = recursive_rejection_walk(p, q, DraftTree(children, [-1, -1, -1]), u[3:6], u[6:])
        counts[children[path[0]] if path else token] += 1
    assert chisquare(counts, [20000 * float(x) for x in p_root]).pvalue > P_VALUE_THRESHOLD
    assert torch.equal(p, p_before) and torch.equal(q, q_before)


@pytest.mark.parametrize("name", DECODER_ONLY)
def test_greedy_trees_are_token_identical_to_greedy_and_to_chains(name):
    target, drafter = tiny_model(name), tiny_model(name, seed=1)
    for seed in range(2):
        inputs = prompt(seed, length=8 + 9 * seed)
        reference = autoregressive_generate(inputs, target, max_gen_len=24)
        chain, _ = speculative_generate(inputs, drafter, target, gamma=4, max_gen_len=24, branching=1)
        assert chain == reference
        for branching, gamma in [(2, 3), (3, 6), (2, 9)]:
            stats = SpeculativeStats()
            out, alpha = speculative_generate(inputs, drafter, target, gamma=gamma, max_gen_len=24, branching=branching,
                                              stats=stats)
            assert out == reference, (name, seed, branching, gamma)
            assert tree_steps(stats) and 0.0 <= alpha <= 1.0
        end = reference[5]  # an end token inside a tree step
        out, _ = speculative_generate(inputs, drafter, target, gamma=5, max_gen_len=24, branching=3, end_tokens_id=end)
        assert out == autoregressive_generate(inputs, target, max_gen_len=24, end_tokens_id=end)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_a_drafter_that_is_the_target_has_its_first_children_accepted(name):
    """The drafter's cache after every tree step holds exactly the accepted tokens: with the target
    as its own drafter, q = p, so the first child of every reached node is accepted (greedy: it is
    the argmax; recursive rejection sampling: p / q = 1), whatever the tree held."""
    target = tiny_model(name)
    for processor in (None, MultinomialProcessor(temperature=1.0)):
        stats = SpeculativeStats()
        kwargs = {} if processor is None else {"logits_processor": processor, "generator": seeded(1)}
        speculative_generate(prompt(2), target, target, gamma=6, max_gen_len=30, branching=2, stats=stats, **kwargs)
        assert stats.steps_without_drafts <= 1  # the last step may have no room left
        assert stats.accepted_by_position[0] == stats.proposed_by_position[0]
        assert stats.tau >= 2.0 and tree_steps(stats)


@pytest.mark.parametrize("max_gen_len,gamma,branching,name", [(2, 3, 3, "llama"), (3, 6, 2, "gpt2")],
                         ids=["depth 1", "depth 2"])
def test_tree_sampling_follows_the_target_distribution(max_gen_len, gamma, branching, name):
    """Recursive rejection sampling of children drawn without replacement: the joint law of the first
    two tokens is the target's. max_gen_len=2 leaves the first step one level of room (three children
    at the root); 3 leaves two levels, so both tokens can come from the tree. Fixed seed, p > 1e-3."""
    target, drafter = tiny_model(name, seed=0, vocab=8), tiny_model(name, seed=1, vocab=8)
    inputs = [3, 4, 3, 5, 3, 6, 3]
    processor = MultinomialProcessor(temperature=1.5)
    stats = SpeculativeStats()

    def generate(rows, generator):
        return speculative_generate(rows, drafter, target, gamma=gamma, max_gen_len=max_gen_len, branching=branching,
                                    logits_processor=processor, generator=generator, stats=stats)

    pairs = first_two_tokens(generate, inputs)
    assert len(stats.proposed_by_position) == max_gen_len - 1 and tree_steps(stats)
    assert chi_square_p_value(pairs, exact_two_token_distribution(target, inputs, processor)) > P_VALUE_THRESHOLD


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral"])
def test_drafter_invariant_trees_return_the_tokens_of_plain_sampling(name):
    target = tiny_model(name)
    drafter = near_copy(target)
    for seed, processor in enumerate([MultinomialProcessor(temperature=0.9), TopKProcessor(temperature=1.0, top_k=8),
                                      NucleusProcessor(temperature=0.8, top_p=0.9)]):
        inputs = prompt(seed)
        plain = autoregressive_generate(inputs, target, max_gen_len=20, logits_processor=processor, generator=seeded(seed))
        stats = SpeculativeStats()
        out, _ = speculative_generate(inputs, drafter, target, gamma=5, max_gen_len=20, branching=3,
                                      logits_processor=processor, generator=seeded(seed), drafter_invariant=True,
                                      stats=stats)
        assert out == plain and tree_steps(stats)


def test_seeded_tree_sampling_reproduces_itself():
    target, drafter = tiny_model("qwen2"), tiny_model("qwen2", seed=1)
    processor = TopKProcessor(temperature=1.0, top_k=20)
    runs = [speculative_generate(prompt(4), drafter, target, gamma=5, max_gen_len=24, branching=3,
                                 logits_processor=processor, generator=seeded(9))[0] for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    other = speculative_generate(prompt(4), drafter, target, gamma=5, max_gen_len=24, branching=3,
                                 logits_processor=processor, generator=seeded(10))[0]
    assert other != runs[0]


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_a_row_of_a_batch_is_the_single_call(name):
    target, drafter = tiny_model(name), tiny_model(name, seed=1)
    rows = [prompt(0), prompt(1, length=5), prompt(2, length=17)]
    greedy = [speculative_generate(row, drafter, target, gamma=5, max_gen_len=16, branching=3)[0] for row in rows]
    assert greedy == [autoregressive_generate(row, target, max_gen_len=16) for row in rows]
    assert [ids for ids, _ in speculative_generate(rows, drafter, target, gamma=5, max_gen_len=16, branching=3)] == greedy
    processor = NucleusProcessor(temperature=1.2, top_p=0.95)
    seeds = [3, 4, 5]
    single = [speculative_generate(row, drafter, target, gamma=5, max_gen_len=16, branching=2, logits_processor=processor,
                                   generator=seeded(s))[0] for row, s in zip(rows, seeds, strict=True)]
    batch = speculative_generate(rows, drafter, target, gamma=5, max_gen_len=16, branching=2, logits_processor=processor,
                                 generator=[seeded(s) for s in seeds])
    assert [ids for ids, _ in batch] == single


def test_the_cost_table_chooses_trees_where_they_pay_and_chains_where_they_do_not(monkeypatch):
    """branching=None with adaptive_gamma, the planner: trees under a flat table, only chains under a steep one
    (a pass over 9 tokens 2.08x a one-token pass: with a drafter this good, a chain's next node adds more
    than a second child would), and the greedy output is plain greedy's either way."""
    target = tiny_model("llama")
    drafter = near_copy(target)
    inputs = prompt(6)
    reference = autoregressive_generate(inputs, target, max_gen_len=30)
    chose = {}
    for name, table in (("flat", FLAT), ("steep", AVX2_FP32)):
        with monkeypatch.context() as patch:
            fix_costs(patch, table, 0.05)
            # The planner's choice alone: the record (tests/test_tree_choice.py) lets its trees run.
            patch.setattr(ShapeRecord, "choose", lambda self: True)
            stats = SpeculativeStats()
            out, _ = speculative_generate(inputs, drafter, target, adaptive_gamma=True, max_gen_len=30, stats=stats)
            assert out == reference, name
            chose[name] = tree_steps(stats)
    assert chose == {"flat": True, "steep": False}


def test_the_hybrid_the_cascade_and_the_encoder_decoder_keep_working_with_branching():
    target = tiny_model("qwen2")
    drafter = near_copy(target)
    inputs = prompt(3) * 2
    reference = autoregressive_generate(inputs, target, max_gen_len=20)
    for options in (dict(ngram=MultiDynaGram(8)), dict(adaptive_gamma=True, cascade=True), dict(use_cache=False)):
        out, _ = speculative_generate(inputs, drafter, target, gamma=4, max_gen_len=20, branching=3, **options)
        assert out == reference, options
    t5, t5_drafter = tiny_model("t5"), tiny_model("t5", seed=1)
    from sampling import autoregressive_generate_encoder_decoder
    out, _ = speculative_generate_encoder_decoder(prompt(1), t5_drafter, t5, gamma=4, max_gen_len=12, branching=3)
    assert out == autoregressive_generate_encoder_decoder(prompt(1), t5, max_gen_len=12)


def test_bad_branching_is_explained_before_any_model_runs():
    target, drafter = tiny_model("llama"), tiny_model("llama", seed=1)
    with pytest.raises(ValueError, match="branching must be an int >= 1, got 0"):
        speculative_generate(prompt(0), drafter, target, branching=0)
    for bad in (1.5, True, "3"):
        with pytest.raises(TypeError, match="branching"):
            speculative_generate(prompt(0), drafter, target, branching=bad)

    class Mine:  # your own Drafter shapes its own drafts
        forward_passes = 0

    with pytest.raises(ValueError, match="branching=3"):
        speculative_generate(prompt(0), Mine(), target, branching=3)
