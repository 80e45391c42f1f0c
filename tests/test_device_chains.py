"""Chains judged once drafted (`ModelDrafter.DEVICE`: where a host read waits for the drafter's device): the per-token
stop is not asked draft by draft; each chain drafts the stop's planned length with its drafts and their confidences
kept on the device, read in one transfer, and the stop keeps the best prefix then. Checked here: the length it
plans (the cost model's best for the acceptance learned at each position), greedy output
token-identical to plain greedy (four families, the self-drafter, a batch), sampling in law, the cascade off by
default there, and at most two host reads a step where the host-judged chain reads every draft."""

import copy

import pytest
import torch

from sampling import SpeculativeStats, autoregressive_generate, speculative_generate
from sampling.drafters.model_drafter import ModelDrafter
from sampling.policy.draft_confidence import ConfidenceStop
from tests.cost_tables import BF16_15B, fix_costs
from tests.models import DECODER_ONLY, prompt, tiny_model
from tests.stats_helpers import P_VALUE_THRESHOLD, chi_square_p_value, exact_two_token_distribution, first_two_tokens
from tests.test_draft_confidence import linear_cost, prices
from tests.test_host_reads import count_reads
from tests.test_model_trees import seeded
from utils.logits_processors import MultinomialProcessor

ROWS = [prompt(0, length=6) * 2, prompt(1, length=5) * 2, prompt(2, length=7)]
ROWS_A_CALL = 4


@pytest.fixture
def on_device(monkeypatch):
    monkeypatch.setattr(ModelDrafter, "DEVICE", True)
    fix_costs(monkeypatch, BF16_15B, 0.1)  # a cheap drafter: it drafts chains


def sure_pair(name: str = "llama"):
    """A target whose next tokens are near-certain and a drafter close to it: long chains, most drafts accepted."""
    target = copy.deepcopy(tiny_model(name))  # the suite's models are shared (conftest.py): read only
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(8.0)
    drafter = copy.deepcopy(target)
    with torch.no_grad():
        weight = drafter.get_output_embeddings().weight
        weight.add_(0.3 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(0)))
    return target, drafter


def test_the_planned_length_is_the_cost_models_best_for_the_recent_acceptance_at_each_position():
    cost, verify = linear_cost(0.05)
    stop = ConfidenceStop(prices(cost, verify, max_budget=16))
    assert stop.planned_length(1) == 2  # the prior, a half at every position: two drafts pay best
    lengths = []
    for _ in range(30):  # chains accepted whole: longer ones pay
        k = stop.planned_length(1)
        stop.observe_step([[0.9] * k], [k], [k])
        lengths.append(stop.planned_length(1))
    assert lengths == sorted(lengths) and lengths[3] == 16  # fast: a position no chain reached is as likely as the last
    lengths = []
    for _ in range(30):  # then every chain's second draft is rejected: one draft pays best
        lengths.append(stop.planned_length(1))
        stop.observe_step([[0.9] * lengths[-1]], [lengths[-1]], [1])
    # within a few chains at most two (a second draft, priced near the break-even point, is still tried)
    assert lengths[0] == 16 and max(lengths[8:]) <= 2 and 1 in lengths
    dear, dear_verify = linear_cost(1.0)  # nothing pays, but the policy started a chain: one draft
    assert ConfidenceStop(prices(dear, dear_verify, 16)).planned_length(1) == 1


@pytest.mark.parametrize("name", DECODER_ONLY)
def test_greedy_chains_judged_once_drafted_are_token_identical_to_greedy(name, on_device):
    target, drafter = sure_pair(name)
    for inputs in (ROWS[0], ROWS[2]):
        reference = autoregressive_generate(inputs, target, max_gen_len=24)
        stats = SpeculativeStats()
        out, _ = speculative_generate(inputs, drafter, target, adaptive_gamma=True, branching=1, max_gen_len=24,
                                      stats=stats)
        assert out == reference and stats.drafts_accepted > 0 and stats.cascade_proposed == 0
        self_drafted, _ = speculative_generate(inputs, target, target, adaptive_gamma=True, branching=1, max_gen_len=24)
        assert self_drafted == reference
    batch = speculative_generate(ROWS, drafter, target, adaptive_gamma=True, branching=1, max_gen_len=24)
    assert [ids for ids, _ in batch] == [autoregressive_generate(row, target, max_gen_len=24) for row in ROWS]


def test_the_cascade_stays_when_asked_for_and_the_chain_is_then_judged_draft_by_draft(on_device):
    target, drafter = sure_pair()
    stats = SpeculativeStats()
    out, _ = speculative_generate(ROWS[0], drafter, target, adaptive_gamma=True, branching=1, max_gen_len=24,
                                  cascade=True, stats=stats)
    assert out == autoregressive_generate(ROWS[0], target, max_gen_len=24) and stats.cascade_proposed > 0


@pytest.mark.slow
def test_sampled_chains_judged_once_drafted_follow_the_target_law(on_device):
    """The joint law of the first two tokens under the standard rule (drafts of the first position judged once
    drafted), on a pair whose drafts are often accepted."""
    target, drafter = sure_pair()
    with torch.no_grad():
        for model in (target, drafter):
            model.get_output_embeddings().weight.div_(4.0)  # less sure: both tokens vary
    inputs, processor, stats = prompt(3, length=6), MultinomialProcessor(temperature=1.0), SpeculativeStats()
    joint = exact_two_token_distribution(target, inputs, processor)

    def generate(rows, generator):  # a few rows a call: a hundred would price every draft out
        return [out for start in range(0, len(rows), ROWS_A_CALL) for out in speculative_generate(
            rows[start : start + ROWS_A_CALL], drafter, target, adaptive_gamma=True, branching=1,
            drafter_invariant=False, max_gen_len=2, logits_processor=processor, generator=generator, stats=stats)]

    pairs = first_two_tokens(generate, inputs)
    assert stats.drafts_proposed > 0
    assert chi_square_p_value(pairs, joint) > P_VALUE_THRESHOLD


@pytest.mark.parametrize("case", ["greedy", "sampled", "batch", "chains or trees"])
def test_an_adaptive_chain_judged_once_drafted_reads_the_host_at_most_twice_a_step(case, monkeypatch):
    """On the host (a CPU) the same generation reads each draft and its confidence (57 reads in 3 steps when this
    test was written); judged once drafted, its drafts and confidences in one transfer, then the verdict. "chains or
    trees": the defaults (`branching=None`: chains, and trees where they measure better, grown on the device)."""
    rows = ROWS if case == "batch" else ROWS[0]
    kwargs = {"logits_processor": MultinomialProcessor(temperature=1.0), "drafter_invariant": False} \
        if case == "sampled" else {"branching": None} if case == "chains or trees" else {}

    def reads(device: bool) -> tuple[int, SpeculativeStats]:
        monkeypatch.setattr(ModelDrafter, "DEVICE", device)
        target, drafter = sure_pair()

        def run(stats):
            generator = [seeded(b) for b in range(len(rows))] if case == "batch" else seeded(0)
            speculative_generate(rows, drafter, target, adaptive_gamma=True, max_gen_len=24, generator=generator,
                                 stats=stats, **{"branching": 1, **kwargs})

        run(SpeculativeStats())  # calibrated before counting
        stats = SpeculativeStats()
        return count_reads(lambda: run(stats)), stats

    fix_costs(monkeypatch, BF16_15B, 0.1)
    on_host, host_stats = reads(False)
    on_device, stats = reads(True)
    assert stats.drafts_accepted > 0 and host_stats.drafts_accepted > 0
    assert on_host > 3 * host_stats.target_forwards  # what it saves: a read per draft
    assert on_device <= 2 * stats.target_forwards, f"{case}: {on_device} host reads in {stats.target_forwards} passes"
