import pytest
import torch

import sampling.loop.acceptance
from ngram_assisted import (
    MultiDynaGram,
    NgramOptions,
    SimpleDynaGram,
    ngram_assisted_speculative_generate,
    ngram_assisted_speculative_generate_encoder_decoder,
)
from ngram_assisted.drafter import MATCH_LENGTH_PRIOR, AcceptanceModel, NgramDrafter, ScoredKind, TextKind
from ngram_assisted.dynagram import Prediction
from ngram_assisted.matching import CopyIndex
from sampling import SpeculativeStats, autoregressive_generate, autoregressive_generate_encoder_decoder
from sampling.loop.randomness import ACCEPT, TARGET, inverse_cdf
from sampling.policy.tree_choice import AUTO_BRANCHING
from tests.models import DECODER_ONLY, ENCODER_DECODER, prompt, tiny_model
from tests.stats_helpers import P_VALUE_THRESHOLD, SAMPLES, chi_square_p_value, exact_two_token_distribution, first_two_tokens
from utils.cost_model import prior_cost
from utils.logits_processors import MultinomialProcessor, NucleusProcessor, TopKProcessor

# The pools, on hand-written histories


def test_simple_dynagram_proposes_the_most_frequent_then_most_recent():
    pool = SimpleDynaGram(3)
    pool.fill([1, 2, 3, 9, 1, 2, 4, 1, 2, 3])
    assert pool.predict([7, 1, 2]).token == 3  # seen twice after (1, 2), 4 once
    assert pool.predict([1, 2]).count == 2 and pool.predict([1, 2]).total == 3
    assert pool.predict([5, 2]) is None  # unknown context: a miss, never a random token
    assert pool.predict([2]) is None  # too short for a 3-gram
    pool.fill([1, 2, 4, 1, 2, 4])
    assert pool.predict([1, 2]).token == 4  # now 3 times against 2


def test_ties_go_to_the_most_recent():
    pool = SimpleDynaGram(2)
    pool.fill([5, 6, 0, 5, 7])
    assert pool.predict([5]).token == 7


def test_multi_dynagram_uses_the_longest_match_and_keeps_bigrams():
    pool = MultiDynaGram(3)
    pool.fill([1, 2, 3, 8, 2, 4, 8, 2, 4])
    assert pool.predict([1, 2]).token == 3 and pool.predict([1, 2]).match_length == 2
    assert pool.predict([9, 2]).token == 4 and pool.predict([9, 2]).match_length == 1
    assert [2, 4] in pool and [1, 2, 3] in pool and [1, 2, 4] not in pool
    two = MultiDynaGram(2)  # the original produced nothing for n = 2
    two.fill([1, 2])
    assert two.predict([1]).token == 2


def test_short_prompts_are_fine():
    pool = MultiDynaGram(5)
    pool.fill([7])  # shorter than n: the original raised KeyError
    assert pool.predict([7]) is None
    pool.fill([7, 8])
    assert pool.predict([7]).token == 8


def test_memory_is_bounded():
    pool = SimpleDynaGram(2, max_contexts=50, max_continuations=3)
    pool.fill(list(range(1000)))
    assert len(pool) == 50
    assert pool.predict([998]).token == 999 and pool.predict([3]) is None  # oldest evicted
    for token in range(10):
        pool.add([1], token)
    assert len(pool._table[(1,)]) == 3


def test_a_chat_prompt_repeating_earlier_turns_is_not_counted_again():
    pool = SimpleDynaGram(2)
    conversation = [1, 2, 3]
    pool.learn(conversation)
    conversation += [1, 2]  # decoding appends to the same list
    pool.learn(conversation)
    assert pool.predict([1]).count == 2
    next_prompt = [*conversation, 5, 1, 2]  # the chat template repeats the conversation, then more
    pool.learn(next_prompt)
    assert pool.predict([1]).count == 3  # not 5: only the new positions were added
    assert [5, 1] in pool
    pool.learn([7, 1, 2])  # shares no prefix: learned whole
    assert pool.predict([1]).count == 4 and [7, 1] in pool
    pool.reset()
    pool.learn([1, 2])
    assert pool.predict([1]).count == 1


def test_top_k_filler_adds_the_targets_alternatives():
    pool = SimpleDynaGram(2)
    drafter = NgramDrafter(pool, NgramOptions(top_k_filler=3), vocab_size=10)
    drafter.start([1, 2])
    drafter.draft([1, 2], 0)
    logits = torch.tensor([[0.0, 0, 0, 5, 4, 3, 0, 0, 0, 0]])  # target's top 3 after (.., 2): 3, 4, 5
    drafter.update([1, 2, 4], [], logits, None)  # it generated 4 (nothing was drafted: one row)
    assert [2, 3] in pool and [2, 4] in pool and [2, 5] in pool
    assert pool.predict([2]).token == 4  # the generated token wins the tie: most recent
    assert pool.predict([2]).count == 1  # counted once, not once more as a filler
    expected = logits.softmax(dim=-1)[0]
    assert {c.token: c.probability for c in pool.candidates([2], 3)} == pytest.approx(
        {t: expected[t].item() for t in (3, 4, 5)})  # with the target's probabilities


def test_the_targets_confidence_sets_a_proposals_estimate():
    sampling_model = AcceptanceModel()
    sampling_model.greedy = False  # sampling accepts x with probability p(x): about that probability
    for probability in (0.03, 0.2, 0.5, 0.95):  # before any draft is judged
        scored = Prediction(5, count=1, total=1, match_length=2, probability=probability, target_rank=0)
        assert sampling_model.estimate(sampling_model.kind(scored)) == pytest.approx(probability, abs=0.06)
    # Greedy accepts the argmax: the target's top choice at a long match is accepted again whatever
    # its probability was, a runner-up seldom, and a one-token match is weak evidence.
    model = AcceptanceModel()
    unsure_argmax = Prediction(5, count=1, total=1, match_length=2, probability=0.3, target_rank=0)
    assert model.estimate(model.kind(unsure_argmax, copied=12)) > 0.8
    assert model.estimate(model.kind(unsure_argmax)) < model.estimate(model.kind(unsure_argmax, copied=12))
    runner_up = Prediction(5, count=0, total=1, match_length=2, probability=0.3, target_rank=1)
    assert model.estimate(model.kind(runner_up, copied=12)) < 0.2
    seen_in_text = Prediction(5, count=1, total=1, match_length=2)  # no score: the match-length prior
    assert model.estimate(model.kind(seen_in_text)) == pytest.approx(MATCH_LENGTH_PRIOR[1])
    assert model.estimate(model.kind(seen_in_text, copied=20)) == pytest.approx(MATCH_LENGTH_PRIOR[-1])


def test_kinds_name_their_fields_and_text_never_passes_for_scored():
    seen_in_text = AcceptanceModel.kind(Prediction(5, count=2, total=3, match_length=2), rank=1)
    assert seen_in_text == TextKind(match_length=2, count=2, majority=True, rank=1)
    scored = AcceptanceModel.kind(Prediction(5, count=1, total=1, match_length=9, probability=0.5, target_rank=0))
    assert scored == ScoredKind(match_length=6, top_choice=True, runner_up=False, bucket=5)
    assert TextKind(1, 1, True, 0) != ScoredKind(1, 1, True, 0)  # same numbers, other kinds: other counts
    assert len({TextKind(1, 1, True, 0), ScoredKind(1, 1, True, 0)}) == 2


def test_a_long_copy_is_drafted_past_prompt_lookups_ten_tokens_where_passes_cost_the_same():
    # Prompt lookup proposes the 10 tokens after an earlier occurrence of the last tokens; NASD's
    # pool holds the same copy and, where a wide pass costs a plain one, drafts it as far as gamma.
    passage = list(range(10, 40))
    sequence = [1, 2, *passage, 3, 4, *passage[:3]]
    def cost(k):  # Qwen2.5-Coder-1.5B in bfloat16 on a Zen 5 CPU (issue 34): flat to 8 drafts, 1.19 at 16
        return 1.0 + 0.024 * max(0, k - 8)

    drafter = NgramDrafter(MultiDynaGram(8), NgramOptions(draft_cost=cost, branching=1), vocab_size=50)
    drafter.start(sequence)
    tree, _ = drafter.draft(sequence, 16)
    # The copy, at least as far as prompt lookup's, before anything was judged (the priors alone).
    assert len(tree) >= 10 and tree.tokens == passage[3 : 3 + len(tree)]
    drafter.acceptance.accepted = drafter.acceptance.predicted = 0.0  # once longer copies were judged:
    for _ in range(20):
        drafter.acceptance.record(drafter.acceptance.kind(Prediction(5, 1, 1, 7), copied=16), 1.0, 0.9)
    assert drafter.draft(sequence, 16)[0].tokens == passage[3:19]  # as far as gamma


def test_the_copy_index_measures_how_far_back_a_proposal_matches():
    index = CopyIndex()
    index.extend([1, 2, 3, 4, 5, 6, 9, 9, 4, 5, 7])
    assert index.match_length([0, 3, 4, 5], 6) == 3  # "3 4 5" then 6, earlier in the text
    assert index.match_length([0, 9, 4, 5], 7) == 3  # "9 4 5" then 7
    assert index.match_length([0, 8, 4, 5], 6) == 2  # only "4 5" agrees
    assert index.match_length([4, 5], 8) == 0  # 8 never followed "4 5"
    assert index.match_length([5], 6) == 0  # too short a history
    index.extend([1, 2, 3, 4, 5])
    assert index.match_length([9, 1, 2, 3, 4, 5], 6) == 5  # the whole earlier passage


def test_rejected_branches_are_recycled_into_the_pool():
    pool = SimpleDynaGram(2)
    drafter = NgramDrafter(pool, NgramOptions(top_k_filler=1, branching=2, stop_if_unknown=False), vocab_size=10)
    drafter.start([1, 2, 3, 2, 4])  # after 2: 3 or 4
    tree, _ = drafter.draft([1, 2, 3, 2, 4, 2], 2)
    assert sorted(tree.tokens) == [3, 4] and tree.parents == [-1, -1]
    rejected = tree.tokens.index(4)
    logits = torch.zeros(3, 10)
    logits[0, 3] = logits[1 + tree.tokens.index(3), 7] = logits[1 + rejected, 8] = 5.0
    drafter.update([1, 2, 3, 2, 4, 2, 3, 7], [tree.tokens.index(3)], logits, None)  # accepted 3, then 7
    after_4 = {c.token: c.probability for c in pool.candidates([4], 3)}  # the rejected branch's context
    assert after_4[8] == pytest.approx(logits[1 + rejected].softmax(-1)[8].item())  # the target's choice there
    assert pool.predict([3]).token == 7 and pool.predict([3]).count == 1


# NASD generation

FAMILIES = DECODER_ONLY + ENCODER_DECODER


def run(name, inputs, pool, **kwargs):
    model = tiny_model(name)
    if name in ENCODER_DECODER:
        return autoregressive_generate_encoder_decoder(inputs, model, max_gen_len=kwargs["max_gen_len"],
                                                       end_tokens_id=kwargs.get("end_tokens_id")), \
            ngram_assisted_speculative_generate_encoder_decoder(inputs, pool, model, **kwargs)
    return autoregressive_generate(inputs, model, max_gen_len=kwargs["max_gen_len"],
                                   end_tokens_id=kwargs.get("end_tokens_id")), \
        ngram_assisted_speculative_generate(inputs, pool, model, **kwargs)


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_nasd_is_token_identical_to_greedy(name):
    for seed in range(2):
        inputs = prompt(seed, length=40)
        for pool in (SimpleDynaGram(2), MultiDynaGram(4)):
            for stop_if_unknown in (True, False):
                for end in (None, 5):
                    stats = SpeculativeStats()
                    reference, (out, alpha) = run(name, inputs, pool, gamma=4, max_gen_len=40, end_tokens_id=end,
                                                  stop_if_unknown=stop_if_unknown, stats=stats)
                    assert out == reference, (name, seed, pool, stop_if_unknown, end)
                    assert alpha == stats.alpha


def test_nasd_drafts_copied_text_and_accepts_it():
    # A model that repeats itself: once the pool has seen the loop, drafts are accepted.
    stats = SpeculativeStats()
    reference, (out, alpha) = run("gpt2", prompt(0), MultiDynaGram(3), gamma=5, max_gen_len=60,
                                  stats=stats, stop_if_unknown=False)
    assert out == reference
    assert stats.drafts_accepted > 0 and stats.tau > 1.0


def test_first_generated_token_may_be_an_end_token():
    model = tiny_model("llama")
    first = autoregressive_generate(prompt(1), model, max_gen_len=1)[0]
    out, _ = ngram_assisted_speculative_generate(prompt(1), MultiDynaGram(3), model, end_tokens_id=first)
    assert out == [first]


def test_the_pool_lives_across_calls_until_reset():
    pool = MultiDynaGram(3)
    model = tiny_model("llama")
    ngram_assisted_speculative_generate(prompt(1), pool, model, max_gen_len=20)
    size = len(pool)
    assert size > 0
    ngram_assisted_speculative_generate(prompt(2), pool, model, max_gen_len=20)
    assert len(pool) > size
    pool.reset()
    assert len(pool) == 0


def test_anpd_settings_run_and_stay_exact():
    inputs = prompt(3, length=40)
    reference, (out, _) = run("qwen2", inputs, SimpleDynaGram(3), gamma=5, top_k_filler=1, stop_if_unknown=False,
                              max_gen_len=30)
    assert out == reference


# Exactness of NASD sampling (q one-hot at each draft)

INPUTS = [3, 4, 5, 3]  # the pool proposes 4 after 3, then 5 after 4: both first tokens are drafted


def sample_pairs(target, processor, seed=0):
    """Every row with a fresh pool of its own, as a single call with a new pool."""
    stats = SpeculativeStats()
    pairs = first_two_tokens(lambda rows, generator: ngram_assisted_speculative_generate(
        rows, [SimpleDynaGram(2) for _ in rows], target, gamma=2, max_gen_len=2, stop_if_unknown=False,
        logits_processor=processor, generator=generator, stats=stats), INPUTS, seed=seed)
    assert stats.drafts_proposed >= SAMPLES  # every row drafted (the pool knows what follows the last 3)
    return pairs


@pytest.mark.slow
@pytest.mark.parametrize(
    "processor",
    [MultinomialProcessor(temperature=2.0), TopKProcessor(temperature=2.0, top_k=4),
     NucleusProcessor(temperature=2.0, top_p=0.8)],
    ids=repr,
)
def test_nasd_sampling_follows_the_target_distribution(processor):
    target = tiny_model("llama", vocab=8)
    joint = exact_two_token_distribution(target, INPUTS, processor)
    assert chi_square_p_value(sample_pairs(target, processor), joint) > P_VALUE_THRESHOLD


@pytest.mark.slow
def test_the_statistical_test_catches_the_original_rule(monkeypatch):
    """The original drew a fresh sample from p after a rejected n-gram draft: it over-produces the draft."""

    def original_rule(p, starts, trees, uniforms, positions):  # per row: its first child's draft x
        choices = []
        for start, tree, u, t in zip(starts, trees, uniforms, positions, strict=True):
            for row in range(1 + len(tree)):
                depth = len(tree.path_to(row - 1))
                x = next((tree.tokens[node] for node, parent in enumerate(tree.parents) if parent == row - 1), None)
                kept = x is not None and u(t + depth, ACCEPT) < float(p[start + row, x])
                choices.append(x if kept else int(inverse_cdf(p[start + row], u(t + depth, TARGET))))
        return torch.tensor(choices)

    monkeypatch.setattr(sampling.loop.acceptance, "coupled_choices", original_rule)
    target = tiny_model("llama", vocab=8)
    processor = MultinomialProcessor(temperature=2.0)
    joint = exact_two_token_distribution(target, INPUTS, processor)
    assert chi_square_p_value(sample_pairs(target, processor), joint) < P_VALUE_THRESHOLD


class PlainThenDrafts:
    """A draft cost under which the policy drafts nothing at odd steps and pays for drafts at even
    ones (`best_draft_length` asks for cost(0) once per step)."""

    def __init__(self) -> None:
        self.steps = 0

    def __call__(self, num_drafts: int) -> float:
        self.steps += num_drafts == 0
        return 1.0 if num_drafts == 0 or self.steps % 2 == 0 else 1e9


@pytest.mark.slow
def test_sampling_stays_exact_when_the_policy_stops_and_resumes_drafting():
    target = tiny_model("llama", vocab=8)
    processor = MultinomialProcessor(temperature=2.0)
    generator = torch.Generator().manual_seed(1)
    pairs, drafted = [], 0
    for _ in range(SAMPLES):
        steps = []
        out, _ = ngram_assisted_speculative_generate(INPUTS, MultiDynaGram(2), target, gamma=2, max_gen_len=3,
                                                     logits_processor=processor, generator=generator,
                                                     draft_cost=PlainThenDrafts(), on_step=steps.append)
        assert steps[0].drafts == ()  # the first step is a plain one
        drafted += len(steps) > 1 and steps[1].drafts != ()
        pairs.append(tuple(out[:2]))
    assert drafted > SAMPLES // 4  # the second step drafted often, after a plain first step
    joint = exact_two_token_distribution(target, INPUTS, processor)
    assert chi_square_p_value(pairs, joint) > P_VALUE_THRESHOLD


@pytest.mark.parametrize("arguments,needle,error", [  # the options' own fields: tests/test_options.py
    ({"pool": {}}, "pool must be a SimpleDynaGram or MultiDynaGram, got dict", TypeError),
    ({"options": {"top_k_filler": 3}}, r"options must be an NgramOptions \(ngram_assisted.NgramOptions\(", TypeError),
    ({"vocab_size": 0}, "vocab_size must be an int >= 1, got 0", ValueError),
    ({"options": NgramOptions(top_k_filler=11)}, "top_k_filler must be at most the vocabulary size 10, got 11", ValueError),
    ({"greedy": None}, "greedy must be a bool, got None", TypeError),
])
def test_the_ngram_drafter_checks_its_constructor_arguments(arguments, needle, error):
    given = {"pool": MultiDynaGram(3), "options": NgramOptions(), "vocab_size": 10, **arguments}
    with pytest.raises(error, match=needle):
        NgramDrafter(given.pop("pool"), **given)


def test_a_drafter_built_by_hand_reads_its_options_as_nasd_does():
    drafter = NgramDrafter(MultiDynaGram(3), vocab_size=10)  # NASD's defaults: trees cut to what pays
    assert drafter.branching == AUTO_BRANCHING and drafter.draft_cost is prior_cost  # no target: the prior
    assert NgramDrafter(MultiDynaGram(3), NgramOptions(stop_if_unknown=False), vocab_size=10).branching == 1
