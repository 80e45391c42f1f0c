"""A swappable draft policy: `draft_policy=` takes your own (`budget`, `update`: the whole
`DraftPolicy` protocol), the loop drafts within its budget for every kind of drafter, and the output
stays exact (greedy identity with plain decoding, batches included)."""

import pytest

from ngram_assisted import MultiDynaGram, ngram_assisted_speculative_generate
from sampling import SpeculativeStats, autoregressive_generate, speculative_generate
from tests.models import prompt, tiny_model
from tests.test_public_drafter import PromptLookupDrafter


class EveryOtherStep:
    """Drafts up to `width` nodes per row on odd steps, nothing on even ones; keeps what it is told."""

    def __init__(self, width: int) -> None:
        self.width, self.steps, self.outcomes = width, 0, []

    def budget(self, num_rows: int) -> int:
        self.steps += 1
        return self.width if self.steps % 2 else 0

    def update(self, num_drafts: int, num_accepted: int) -> None:
        self.outcomes.append((num_drafts, num_accepted))


def run(method, rows, target, policy, stats):
    if method == "model":
        return speculative_generate(rows, tiny_model("llama", seed=1), target, max_gen_len=12, draft_policy=policy,
                                    stats=stats)
    if method == "model adaptive":
        return speculative_generate(rows, tiny_model("llama", seed=1), target, max_gen_len=12, draft_policy=policy,
                                    adaptive_gamma=True, stats=stats)
    if method == "own drafter":
        return speculative_generate(rows, PromptLookupDrafter(), target, max_gen_len=12, draft_policy=policy,
                                    stats=stats)
    return ngram_assisted_speculative_generate(rows, MultiDynaGram(2), target, max_gen_len=12, draft_policy=policy,
                                               stats=stats)


@pytest.mark.parametrize("method", ["model", "model adaptive", "own drafter", "nasd"])
@pytest.mark.parametrize("batch", [False, True])
def test_the_loop_drafts_within_your_policys_budget_and_stays_exact(method, batch):
    target = tiny_model("llama")
    rows = [prompt(0, length=6) * 2, prompt(1, length=5) * 2] if batch else prompt(0, length=6) * 2
    policy, stats = EveryOtherStep(3), SpeculativeStats()
    out = run(method, rows, target, policy, stats)
    expected = autoregressive_generate(rows, target, max_gen_len=12)
    assert ([ids for ids, _ in out] if batch else out[0]) == expected
    assert len(policy.outcomes) == stats.steps  # one outcome per row and step
    assert all(drafts <= 3 and accepted <= drafts for drafts, accepted in policy.outcomes)
    assert stats.steps_without_drafts >= len(policy.outcomes) // 3  # the even steps drafted nothing
    if not batch:  # one row: its even steps are the policy's even steps
        assert all(drafts == 0 for drafts, _ in policy.outcomes[1::2])


def test_a_policy_without_the_protocol_is_refused_by_name():
    target = tiny_model("llama")
    with pytest.raises(TypeError, match=r"draft_policy must be an object with the DraftPolicy protocol.*lacks update\(\)"):
        speculative_generate(prompt(0), target, target, draft_policy=type("Half", (), {"budget": lambda s, n: 1})())


@pytest.mark.parametrize("budget", [2.5, -1, None, True])
def test_a_policy_whose_budget_is_no_count_is_refused_by_name(budget):
    target = tiny_model("llama")
    policy = type("Odd", (), {"budget": lambda self, n: budget, "update": lambda self, drafts, accepted: None})()
    with pytest.raises(TypeError, match=rf"draft_policy.budget\(1\) must return an int >= 0 .*got {budget!r} from Odd"):
        speculative_generate(prompt(0), target, target, draft_policy=policy, max_gen_len=4)
