"""The adaptive model drafter's per-token stop: confident drafts go on, doubtful ones stop, the
learned odds follow what the target accepted, and greedy identity holds whatever it stops at."""

from types import SimpleNamespace

from sampling import SpeculativeStats, autoregressive_generate, speculative_generate
from sampling.policy.draft_confidence import ConfidenceAcceptance, ConfidenceStop
from tests.cost_tables import BF16_15B, fix_costs
from tests.models import tiny_model


def linear_cost(slope: float, drafter: float = 0.1):
    return (lambda k: 1.0 + slope * k + drafter * k), (lambda k: 1.0 + slope * k)


def prices(cost, verify_cost, max_budget):
    """The members of a `CostAwarePolicy` the stop reads, and nothing else, priced for one row."""

    def one_row(price):
        def priced(k, rows):
            assert rows == 1
            return price(k)
        return priced

    return SimpleNamespace(cost=one_row(cost), verify_cost=one_row(verify_cost), max_budget=max_budget,
                           discard=lambda: None)


def test_the_prior_is_the_drafters_own_confidence_and_learning_moves_it():
    acceptance = ConfidenceAcceptance()
    assert 0.9 < acceptance(0.97) < 0.99 and 0.0 < acceptance(0.05) < 0.1
    for _ in range(200):  # drafts at c = 0.97 that the target always rejects
        acceptance.update([0.97], 0)
    assert acceptance(0.97) < 0.1


def test_confident_drafts_go_on_and_doubtful_ones_stop():
    cost, verify = linear_cost(0.05)
    stop = ConfidenceStop(prices(cost, verify, max_budget=16))
    assert stop.keep_drafting([0.99, 0.99, 0.99], 1)
    assert not stop.keep_drafting([0.99, 0.05], 1)
    assert not stop.keep_drafting([0.99] * 16, 1)  # the budget
    assert stop.keep([0.99, 0.99, 0.05], 1) == 2  # the doubtful last draft is not worth verifying
    dear, dear_verify = linear_cost(1.0)  # every token costs a full pass: drafting cannot pay
    assert not ConfidenceStop(prices(dear, dear_verify, 16)).keep_drafting([0.7], 1)


def test_a_flat_step_after_a_dear_one_is_seen():
    table = {0: 1.0, 1: 1.0, 2: 1.0, 3: 2.0, 4: 2.0, 5: 2.0, 6: 2.0, 7: 2.0, 8: 2.0}
    stop = ConfidenceStop(prices(lambda k: table[min(k, 8)], lambda k: table[min(k, 8)], max_budget=8))
    assert stop.keep_drafting([0.999, 0.999, 0.999], 1)  # the step 2 -> 3 pays over eight drafts


def test_greedy_identity_with_the_per_token_stop():
    target, drafter = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    prompt = list(range(5, 17))
    reference = autoregressive_generate(prompt, target, max_gen_len=24)
    stats = SpeculativeStats()
    out, _ = speculative_generate(prompt, drafter, target, adaptive_gamma=True, max_gen_len=24, stats=stats)
    assert out == reference
    self_drafted, _ = speculative_generate(prompt, target, target, adaptive_gamma=True, max_gen_len=24)
    assert self_drafted == reference
    batch = speculative_generate([prompt, prompt[:7]], drafter, target, adaptive_gamma=True, max_gen_len=24)
    assert [ids for ids, _ in batch] == [reference, autoregressive_generate(prompt[:7], target, max_gen_len=24)]


def test_greedy_drafts_are_judged_by_the_drafters_softmax_not_its_one_hot_q(monkeypatch):
    """Under greedy decoding q is one-hot: read there, every draft had confidence 1.0 and the stop drafted as long
    after a guess as after a sure token (a real translation prompt drafted 12 tokens at "1.0", all rejected). The
    stop reads the softmax of the drafter's scores instead, the confidence its own logits give each draft."""
    import torch

    from sampling.drafters.model_drafter import ModelDrafter

    target, drafter = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    prompt, seen = list(range(5, 17)), []
    original = ModelDrafter._confidence

    def recorded(self, logits, q, draft, history):
        confidence = original(self, logits, q, draft, history)
        seen.append((confidence, float(torch.softmax(logits.double(), dim=-1)[draft]), float(q[draft])))
        return confidence

    monkeypatch.setattr(ModelDrafter, "_confidence", recorded)
    fix_costs(monkeypatch, BF16_15B, 0.1)  # a cheap drafter: it drafts chains
    out, _ = speculative_generate(prompt, drafter, target, adaptive_gamma=True, branching=1, max_gen_len=24)
    assert out == autoregressive_generate(prompt, target, max_gen_len=24) and seen
    assert all(abs(confidence - softmax) < 1e-6 and one_hot == 1.0 for confidence, softmax, one_hot in seen)
    assert min(confidence for confidence, _, _ in seen) < 0.5  # a random drafter is unsure of some drafts


def test_the_odds_a_pair_learns_carry_over_to_its_next_generation(monkeypatch):
    """One `ConfidenceAcceptance` per drafter, target and decoding kind, moved by every generation of the pair and
    forgotten on request; another pair starts from the prior."""
    from sampling.policy.draft_confidence import forget_learned_acceptance, learned_acceptance

    target, drafter = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    fix_costs(monkeypatch, BF16_15B, 0.1)
    odds = learned_acceptance(drafter, target, True)
    prior = [bucket.rate for bucket in odds.buckets]
    speculative_generate(list(range(5, 17)), drafter, target, adaptive_gamma=True, branching=1, max_gen_len=24)
    assert learned_acceptance(drafter, target, True) is odds and [b.rate for b in odds.buckets] != prior
    assert learned_acceptance(drafter, target, False) is not odds and learned_acceptance(target, drafter, True) is not odds
    forget_learned_acceptance()
    assert [bucket.rate for bucket in learned_acceptance(drafter, target, True).buckets] == prior


class FlatCosts:
    """A target whose passes cost 1.1x a one-token pass, whatever the tokens; one-token pass 1 s."""

    def __call__(self, k: int) -> float:
        return 1.0 if k == 0 else 1.1

    def seconds(self, k: int) -> float:
        return 1.0


def test_one_cold_probe_per_generation_breaks_a_prior_that_says_no():
    from sampling.policy.draft_policy import CostAwareDraftLength

    # A drafted token costs 0.8 of a target pass: at the prior acceptance (0.6) drafting does not pay,
    # at 0.99 it would. Before the drafter has drafted (warm() False), one probe is allowed.
    policy = CostAwareDraftLength(16, FlatCosts(), FlatCosts(), draft_seconds=lambda: 0.8, warm=lambda: False,
                                  per_token_stop=True)
    gammas = []
    for _ in range(3 * CostAwareDraftLength.PROBE_AFTER):
        gammas.append(policy.budget(1))
        policy.update(gammas[-1], 0)
    assert gammas.count(1) == 1 and set(gammas) == {0, 1}
    whole_chain = CostAwareDraftLength(16, FlatCosts(), FlatCosts(), draft_seconds=lambda: 0.8, warm=lambda: False)
    gammas = []
    for _ in range(3 * CostAwareDraftLength.PROBE_AFTER):  # without the per-token stop: no cold probe
        gammas.append(whole_chain.budget(1))
        whole_chain.update(gammas[-1], 0)
    assert set(gammas) == {0}
