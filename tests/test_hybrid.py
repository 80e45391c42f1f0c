"""Hybrid drafting (`speculative_generate(..., ngram=pool)`): the pool's draft or the model's per step
and row, exact either way: greedy identity (one row and batches), seeded identity with plain
sampling under the drafter-invariant rule, the sampling law under the standard rule, and both
drafters really used."""

import pytest

from ngram_assisted import MultiDynaGram
from sampling import SpeculativeStats, autoregressive_generate, speculative_generate
from tests.cost_tables import BF16_15B, fix_costs
from tests.models import prompt, tiny_model
from tests.stats_helpers import P_VALUE_THRESHOLD, chi_square_p_value, exact_two_token_distribution
from tests.test_drafter_invariant import near_copy, seeded
from utils.logits_processors import NucleusProcessor


def repeating_prompt(target, length: int = 12) -> list[int]:
    """A prompt holding the target's own greedy continuation twice: the pool can copy it."""
    start = prompt(3)
    continuation = autoregressive_generate(start, target, max_gen_len=length)
    return start + continuation + start + continuation[: length // 2]


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_identity_one_row_and_a_batch(name, adaptive):
    target = tiny_model(name)
    drafter = near_copy(target)
    rows = [prompt(0), repeating_prompt(target), prompt(1)[:5]]
    references = [autoregressive_generate(row, target, max_gen_len=20) for row in rows]
    for row, reference in zip(rows, references, strict=True):
        out, _ = speculative_generate(row, drafter, target, gamma=4, adaptive_gamma=adaptive, max_gen_len=20,
                                      ngram=MultiDynaGram(8))
        assert out == reference
    batch = speculative_generate(rows, drafter, target, gamma=4, adaptive_gamma=adaptive, max_gen_len=20,
                                 ngram=MultiDynaGram(8))
    assert [ids for ids, _ in batch] == references


def test_both_drafters_are_used_and_accepted(monkeypatch):
    target = tiny_model("llama")
    drafter = near_copy(target)
    chosen = {"pool": 0, "model": 0}
    from sampling.drafters import hybrid

    original = hybrid.HybridDrafter.update

    def counting(self, sequences, paths, target_logits, p):
        for model, logits in zip(self._chose_model or [False] * len(paths), target_logits, strict=True):
            if len(logits) > 1:
                chosen["model" if model else "pool"] += 1
        original(self, sequences, paths, target_logits, p)

    monkeypatch.setattr(hybrid.HybridDrafter, "update", counting)
    # The choice follows the costs: fixed ones (a real table, no timing moves it), so that the test
    # says the same on a quiet machine and a busy one. A tiny drafter costs what its tiny target costs:
    # price its token as a real 0.5B drafting for a 1.5B does (a tenth of a target pass), or the model
    # could never pay and never be chosen.
    fix_costs(monkeypatch, BF16_15B, 0.1)
    stats = SpeculativeStats()
    for row in (repeating_prompt(target), prompt(5)):
        speculative_generate(row, drafter, target, gamma=4, max_gen_len=24, ngram=MultiDynaGram(8), stats=stats)
    assert chosen["pool"] > 0 and chosen["model"] > 0
    assert stats.drafts_accepted > 0


def test_seeded_hybrid_sampling_is_plain_sampling_under_the_invariant_rule():
    target = tiny_model("qwen2")
    drafter = near_copy(target)
    processor = NucleusProcessor(temperature=0.7, top_p=0.9)
    for seed, row in enumerate([repeating_prompt(target), prompt(2)]):
        plain = autoregressive_generate(row, target, max_gen_len=20, logits_processor=processor, generator=seeded(seed))
        for adaptive in (False, True):
            out, _ = speculative_generate(row, drafter, target, gamma=3, adaptive_gamma=adaptive, max_gen_len=20,
                                          logits_processor=processor, generator=seeded(seed), drafter_invariant=True,
                                          ngram=MultiDynaGram(8))
            assert out == plain


@pytest.mark.slow
def test_the_first_two_tokens_follow_the_target_law_under_the_standard_rule():
    """Chi-square on the joint law of the first two tokens, p-value above P_VALUE_THRESHOLD (seeded)."""
    target = tiny_model("llama", vocab=12)
    drafter = near_copy(target, scale=0.3)
    processor = NucleusProcessor(temperature=1.0, top_p=0.95)
    row = [1, 2, 3, 1, 2, 3, 1, 2]
    expected = exact_two_token_distribution(target, row, processor)
    generator = seeded(0)
    pool = MultiDynaGram(3)  # shared by every sample: it learns the row's continuations, so it drafts
    samples = [tuple(speculative_generate(row, drafter, target, gamma=2, max_gen_len=2, logits_processor=processor,
                                          generator=generator, drafter_invariant=False, ngram=pool)[0])
               for _ in range(1000)]
    assert chi_square_p_value(samples, expected) > P_VALUE_THRESHOLD
