"""The adaptive model drafter's per-token stop: confident drafts go on, doubtful ones stop, the
learned odds follow what the target accepted, and greedy identity holds whatever it stops at."""

import copy
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


def test_what_a_pair_learns_carries_over_to_its_next_generation(monkeypatch):
    """One `PairRecord` (the stop's odds, the chains' record) per drafter, target and decoding kind, moved by every
    generation of the pair and forgotten on request; another pair starts from the prior."""
    from sampling.policy.draft_confidence import forget_pair_records, pair_record

    target, drafter = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    fix_costs(monkeypatch, BF16_15B, 0.1)
    record = pair_record(drafter, target, True)
    prior = [bucket.rate for bucket in record.odds.buckets]
    speculative_generate(list(range(5, 17)), drafter, target, adaptive_gamma=True, branching=1, max_gen_len=24)
    assert pair_record(drafter, target, True) is record and [b.rate for b in record.odds.buckets] != prior
    assert record.chains.chains > 0 and record.chains.tokens > 0 and record.chains.plain > 0
    assert pair_record(drafter, target, False) is not record and pair_record(target, drafter, True) is not record
    forget_pair_records()
    fresh = pair_record(drafter, target, True)
    assert [bucket.rate for bucket in fresh.odds.buckets] == prior and fresh.chains.chains == 0


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


def test_the_chain_record_waits_for_a_few_chains_then_says_what_they_gave():
    from sampling.policy.draft_policy import ChainRecord

    record = ChainRecord()
    for _ in range(ChainRecord.WARMUP - 1):
        record.add(5.0, 1.5)
        assert record.pays() is None
    record.add(5.0, 1.5)
    assert record.pays() is True
    for _ in range(12):  # a prompt where every chain stops at its doubtful first draft: 1 token for 1.5 plain ones
        record.add(1.0, 1.5)
    assert record.pays() is False


def simulate(policy, stop, steps: int, confidence: float, accepted_run: int) -> list[int]:
    """A generation's steps through the policy and the stop as the model drafter runs them: every chain drafts at
    `confidence` while the stop lets it, the target accepts its first `accepted_run` drafts -> the budgets given."""
    budgets = []
    for _ in range(steps):
        budget = policy.budget(1)
        budgets.append(budget)
        confidences = []
        while budget and len(confidences) < budget:
            confidences.append(confidence)
            if not stop.keep_drafting(confidences, 1):
                break
        kept = stop.keep(confidences, 1) if confidences else 0
        if confidences and not kept:
            stop.on_discard()
        accepted = min(kept, accepted_run)
        if confidences:
            stop.observe_step([confidences], [kept], [accepted])
        policy.update(kept, accepted)
    return budgets


def test_a_dear_drafter_drafts_where_its_chains_pay_not_where_one_token_would():
    """The single rate starts a chain only where a one-token chain pays at the rate: with a drafted token at 0.8 of a
    target pass (1.5B, bfloat16 costs) that is a > 0.8, above its prior (0.6), and only probes of one token each,
    16 then 32 steps apart, could move it. Yet the chains the stop sizes pay there: sure drafts go on for 16 tokens.
    (Measured on HumanEval: SD with the 0.5B once drafted on 2 of 251 steps, where its chains, when they ran, made
    7.8 tokens a step.) With the chain record a pair's first chains start wherever drafting could pay at all, and what
    chains gave decides from then on: sure, accepted chains go on; doubtful ones stop being started; a probe finds
    a prompt where they pay again."""
    from sampling.policy.draft_confidence import ConfidenceStop, PairRecord
    from sampling.policy.draft_policy import CostAwareDraftLength
    from utils.cost_model import PassCosts

    target = PassCosts(relative=dict(BF16_15B), one_token_seconds=0.1, measured=True)

    def policy_and_stop(record):
        policy = CostAwareDraftLength(16, target, target, draft_seconds=lambda: 0.08, per_token_stop=True,
                                      chains=None if record is None else record.chains)
        return policy, ConfidenceStop(policy, record)

    alone = simulate(*policy_and_stop(None), 64, 0.97, 16)  # the single rate decides whether to start
    assert alone[:48].count(0) >= 46
    record = PairRecord()
    sure = simulate(*policy_and_stop(record), 64, 0.97, 16)
    assert all(sure) and record.chains.pays()
    doubtful = simulate(*policy_and_stop(record), 64, 0.3, 0)  # the next generation: a prompt it cannot draft
    assert doubtful[:3] == [16] * 3 and doubtful.count(0) > 50 and record.chains.pays() is False
    again = simulate(*policy_and_stop(record), 64, 0.97, 16)  # and one it can: a probe finds it again
    assert again.count(0) <= CostAwareDraftLength.PROBE_AFTER and all(again[CostAwareDraftLength.PROBE_AFTER + 1:])


def test_a_drafter_that_could_never_pay_starts_no_chain_even_before_its_record_is_warm():
    from sampling.policy.draft_confidence import ConfidenceStop, PairRecord
    from sampling.policy.draft_policy import CostAwareDraftLength

    record = PairRecord()
    policy = CostAwareDraftLength(16, FlatCosts(), FlatCosts(), draft_seconds=lambda: 1.2, per_token_stop=True,
                                  chains=record.chains)
    assert set(simulate(policy, ConfidenceStop(policy, record), 3 * CostAwareDraftLength.PROBE_AFTER, 0.99, 16)) == {0}


def test_a_steps_record_prices_every_drafter_pass_and_the_verification_of_what_was_kept():
    """Rows 0 and 1 drafted 5 and 2 tokens (one drafter pass each, side by side: 5 passes), the stop kept 3 and 0, the
    target accepted 2: 2 + 1 tokens for row 0, 1 for row 1, against the plain steps the same cost would have made."""
    from sampling.policy.draft_confidence import ConfidenceStop, PairRecord

    def cost(k, rows):
        return rows * (1.0 + 0.1 * k) + 0.4 * k  # a drafted token: 0.4 of a one-token pass

    def verify_cost(k, rows):
        return rows * (1.0 + 0.1 * k)

    policy = SimpleNamespace(cost=cost, verify_cost=verify_cost, max_budget=16, discard=lambda: None)
    record = PairRecord()
    ConfidenceStop(policy, record).observe_step([[0.9] * 5, [0.5, 0.2]], [3, 0], [2, 0])
    step = verify_cost(3, 2) + 5 * 0.4  # the verification over 1 + 3 tokens per row, five drafter passes
    assert record.chains.tokens == 4 and abs(record.chains.plain - 2 * step / cost(0, 2)) < 1e-12
    judged = ConfidenceAcceptance()  # the odds learn row 0's kept drafts only: two accepted, the third rejected
    judged.update([0.9] * 3, 2)
    assert [b.rate for b in record.odds.buckets] == [b.rate for b in judged.buckets]


def test_a_drafter_whose_pass_is_unmeasured_is_priced_by_its_share_of_the_bytes():
    """A calibration too noisy to keep leaves the drafter's pass unmeasured (the prior costs). Priced then at one
    target pass per drafted token, no chain could pay even at 0.99: SD with the 0.5B drafted on no step of a whole
    benchmark run (0.93x our plain decoding, sixteenth round) and was never timed to learn better. Priced by its share
    of the weight bytes a pass reads, it starts chains, and its timed drafting takes over once there is some."""
    from sampling.policy.draft_policy import ChainRecord, CostAwareDraftLength
    from utils.cost_model import PassCosts, prior_costs

    target = PassCosts(relative=dict(BF16_15B), one_token_seconds=0.1, measured=True)

    def policy(**options):
        return CostAwareDraftLength(16, target, prior_costs(), per_token_stop=True, chains=ChainRecord(), **options)

    assert policy().budget(1) == 0  # a drafted token at a target pass: never started, so never timed
    shared = policy(prior_share=lambda: 0.32)
    assert shared.drafter_step_cost() == 0.32 and shared.budget(1) == 16
    timed = policy(prior_share=lambda: 0.32, draft_seconds=lambda: 0.1)  # once timed: what it costs, here a target pass
    assert timed.drafter_step_cost() == 1.0 and timed.budget(1) == 0


def test_the_bytes_a_pass_reads_count_each_weight_once_and_one_row_of_an_untied_embedding():
    from sampling.drafters.model_kind import prior_share
    from utils.runners.model_info import pass_bytes

    def weight_bytes(model, skip=()):
        return sum(p.numel() * p.element_size() for name, p in model.named_parameters() if name not in skip)

    tied, untied = tiny_model("gpt2"), tiny_model("llama")
    assert tied.config.tie_word_embeddings and not untied.config.tie_word_embeddings
    assert pass_bytes(tied) == weight_bytes(tied) + sum(b.untyped_storage().nbytes() for b in tied.buffers())
    assert pass_bytes(untied) == weight_bytes(untied, skip={"model.embed_tokens.weight"}) + sum(
        b.untyped_storage().nbytes() for b in untied.buffers())
    smaller = copy.deepcopy(untied)  # the suite's tiny models are shared: cut a copy
    smaller.model.layers = smaller.model.layers[:1]
    assert 0.5 < prior_share(smaller, untied) < 1.0 and prior_share(untied, untied) == 1.0
