"""Batches: every row of a batch gets what the single call returns for it (greedy: the same tokens;
sampling: its own law, and with one generator per row the very tokens), rows of different lengths
ending at different steps, decoded in shared passes."""

import pytest
import torch

from ngram_assisted import (
    MultiDynaGram,
    SimpleDynaGram,
    ngram_assisted_speculative_generate,
    ngram_assisted_speculative_generate_encoder_decoder,
)
from sampling import (
    SpeculativeStats,
    autoregressive_generate,
    autoregressive_generate_encoder_decoder,
    beam_search_generate,
    speculative_generate,
    speculative_generate_encoder_decoder,
)
from tests.models import DECODER_ONLY, ENCODER_DECODER, VOCAB, prompt, tiny_model
from tests.stats_helpers import (
    P_VALUE_THRESHOLD,
    ROWS_PER_CALL,
    SAMPLES,
    chi_square_p_value,
    exact_two_token_distribution,
)
from utils.logits_processors import MultinomialProcessor, NucleusProcessor

ROWS = [prompt(0, length=8), prompt(1, length=15) * 2, prompt(2, length=5)]  # ragged lengths, one repetitive


def functions(name):
    if name in ENCODER_DECODER:
        return (autoregressive_generate_encoder_decoder, speculative_generate_encoder_decoder,
                ngram_assisted_speculative_generate_encoder_decoder)
    return autoregressive_generate, speculative_generate, ngram_assisted_speculative_generate


def end_token_of(model, ar, rows) -> int:
    """A token that ends the first row early, so that rows finish at different steps."""
    return ar(rows[0], model, max_gen_len=30)[3]


@pytest.mark.parametrize("name", DECODER_ONLY + ENCODER_DECODER)
def test_every_row_gets_the_single_call_output(name):
    target, drafter = tiny_model(name, seed=0), tiny_model(name, seed=1)
    ar, sd, nasd = functions(name)
    end = end_token_of(target, ar, ROWS)
    for use_cache in (True, False):
        common = dict(max_gen_len=24, end_tokens_id=end, use_cache=use_cache)
        single = [ar(row, target, **common) for row in ROWS]
        assert len({len(out) for out in single}) > 1  # rows end at different steps
        assert ar(ROWS, target, **common) == single
        assert [out for out, _ in sd(ROWS, drafter, target, gamma=3, **common)] == single
        for branching in (1, 3, None):
            batch = nasd(ROWS, MultiDynaGram(3), target, gamma=6, branching=branching, **common)
            assert [out for out, _ in batch] == single, (branching, use_cache)
            assert all(0.0 <= alpha <= 1.0 for _, alpha in batch)


def test_beam_search_searches_a_batch_row_by_row():
    model = tiny_model("llama")
    assert beam_search_generate(ROWS, model, max_gen_len=6) == [beam_search_generate(row, model, max_gen_len=6)
                                                                 for row in ROWS]


def test_a_batch_of_one_is_the_single_call_in_a_list():
    model = tiny_model("llama")
    row = ROWS[1]
    assert autoregressive_generate([row], model, max_gen_len=12) == [autoregressive_generate(row, model, max_gen_len=12)]
    single, alpha = ngram_assisted_speculative_generate(row, MultiDynaGram(3), model, max_gen_len=12)
    [(out, alpha)] = ngram_assisted_speculative_generate([row], MultiDynaGram(3), model, max_gen_len=12)
    assert out == single and isinstance(alpha, float)  # alpha follows the measured costs: not compared


def count_calls(model) -> list[int]:
    calls = [0]
    model.register_forward_hook(lambda *args: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_plain_decoding_of_three_rows_shares_its_passes():
    model = tiny_model("qwen2", seed=3)
    calls = count_calls(model)
    for row in ROWS:
        autoregressive_generate(row, model, max_gen_len=20)
    one_by_one, calls[0] = calls[0], 0
    autoregressive_generate(ROWS, model, max_gen_len=20)
    assert calls[0] <= one_by_one / 2, (calls[0], one_by_one)


def test_ragged_acceptance_keeps_every_accepted_token():
    """A pool that knows row 1's continuation: row 1 accepts long drafts while the others accept
    few, and still every row's tokens are the single call's, with one pass per step for all rows."""
    model = tiny_model("llama")
    single = [autoregressive_generate(row, model, max_gen_len=24) for row in ROWS]
    pools = [MultiDynaGram(3), MultiDynaGram(3), MultiDynaGram(3)]
    pools[1].fill(ROWS[1] + single[1])
    stats, steps = SpeculativeStats(), []
    batch = ngram_assisted_speculative_generate(ROWS, pools, model, gamma=8, max_gen_len=24, stop_if_unknown=False,
                                                stats=stats, on_step=steps.append)
    assert [out for out, _ in batch] == single
    accepted = [sum(step.accepted for step in steps if step.row == row) for row in range(3)]
    assert accepted[1] >= 12 and accepted[1] > 2 * max(accepted[0], accepted[2]), accepted
    for row in range(3):  # each row's stream: its own tokens, in order
        assert [t for step in steps if step.row == row for t in step.tokens] == single[row]
    assert stats.generated_tokens == sum(map(len, single))
    steps_per_row = [sum(step.row == row for step in steps) for row in range(3)]
    # The prompts prefilled in one pass (the static buffer's: right-padded), then one pass per step for all rows.
    assert stats.target_forwards == 1 + max(steps_per_row)
    assert steps_per_row[1] < steps_per_row[0]  # row 1 finished first and left the batch
    # tau: tokens per verification of a sequence (row-steps), not per shared pass.
    assert stats.steps == len(steps) and stats.tau == stats.generated_tokens / len(steps)
    assert stats.steps_without_drafts == sum(not step.drafts for step in steps)
    assert stats.tokens_per_target_pass == stats.generated_tokens / stats.target_forwards > stats.tau


def test_a_batch_that_drafts_nothing_has_tau_one_and_says_so():
    """One token per row: no room to draft. Tokens per shared pass would be 3 / 2 (the prefill
    included) or 3 (a pass for 3 rows); tau, per sequence and step, is exactly 1."""
    model = tiny_model("llama")
    stats = SpeculativeStats()
    ngram_assisted_speculative_generate(ROWS, MultiDynaGram(3), model, max_gen_len=1, stats=stats)
    assert stats.tau == 1.0 and stats.steps == stats.steps_without_drafts == len(ROWS) and stats.alpha == 0.0
    assert stats.target_forwards == 2 and stats.tokens_per_target_pass == len(ROWS) / 2


def test_one_pool_shared_by_every_row_learns_from_all_of_them():
    model = tiny_model("gpt2")
    pool = SimpleDynaGram(2, max_continuations=VOCAB)  # no continuation evicted: the top-k fills vary with the drafts
    ngram_assisted_speculative_generate(ROWS, pool, model, max_gen_len=10)
    for row in ROWS:
        assert tuple(row[-2:]) in pool  # every row's prompt went into the shared pool


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_sampling_with_one_generator_per_row_gives_the_single_calls_tokens(name):
    model = tiny_model(name)
    ar, _, nasd = functions(name)
    processor = NucleusProcessor(temperature=1.2, top_p=0.95)
    seeds = [3, 4, 5]
    single = [ar(row, model, max_gen_len=16, logits_processor=processor, generator=torch.Generator().manual_seed(s))
              for row, s in zip(ROWS, seeds, strict=True)]
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    assert ar(ROWS, model, max_gen_len=16, logits_processor=processor, generator=generators) == single
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    batch = nasd(ROWS, MultiDynaGram(3), model, max_gen_len=16, logits_processor=processor, generator=generators,
                 stop_if_unknown=False)
    assert [out for out, _ in batch] == single  # coupled sampling, row by row
    for branching in (1, 3):  # one pool per row, as each single call has its own: chains, then trees
        seeded = [torch.Generator().manual_seed(s) for s in seeds]
        batch = nasd(ROWS, [MultiDynaGram(3) for _ in ROWS], model, max_gen_len=16, logits_processor=processor,
                     generator=seeded, stop_if_unknown=False, branching=branching)
        assert [out for out, _ in batch] == single, branching


@pytest.mark.parametrize("name", ["llama", "t5"])
@pytest.mark.parametrize("drafter_invariant", [False, True])
def test_a_row_of_a_batch_drafted_by_a_model_is_the_single_call_with_its_seed(name, drafter_invariant):
    """The statistical tests draw their samples as rows of batches (tests/stats_helpers.py): a row is
    the single call with its seed, so the law they check is the single call's."""
    target, drafter = tiny_model(name), tiny_model(name, seed=1)
    _, sd, _ = functions(name)
    processor = NucleusProcessor(temperature=1.2, top_p=0.95)
    seeds = [3, 4, 5]
    common = dict(gamma=3, max_gen_len=16, logits_processor=processor, drafter_invariant=drafter_invariant)
    single = [sd(row, drafter, target, generator=torch.Generator().manual_seed(s), **common)[0]
              for row, s in zip(ROWS, seeds, strict=True)]
    batch = sd(ROWS, drafter, target, generator=[torch.Generator().manual_seed(s) for s in seeds], **common)
    assert [out for out, _ in batch] == single


TWO_ROWS = [[3, 4, 5, 3], [6, 2, 7]]


@pytest.mark.slow
def test_each_row_of_a_sampled_batch_follows_its_own_law():
    target = tiny_model("llama", vocab=8)
    drafter = tiny_model("llama", seed=1, vocab=8)
    processor = MultinomialProcessor(temperature=2.0)
    generator = torch.Generator().manual_seed(0)  # one generator: each row gets a stream derived from it
    pairs = {"nasd": ([], []), "speculative": ([], [])}
    stats = {"nasd": SpeculativeStats(), "speculative": SpeculativeStats()}
    rows = TWO_ROWS * (ROWS_PER_CALL // 2)  # the two prompts alternate, every row its own stream
    for _ in range(SAMPLES * 2 // len(rows)):
        nasd = ngram_assisted_speculative_generate(rows, MultiDynaGram(2), target, gamma=2, max_gen_len=2,
                                                   logits_processor=processor, generator=generator,
                                                   stop_if_unknown=False, stats=stats["nasd"])
        spec = speculative_generate(rows, drafter, target, gamma=2, max_gen_len=2, logits_processor=processor,
                                    generator=generator, stats=stats["speculative"])
        for method, batch in (("nasd", nasd), ("speculative", spec)):
            for row, (out, _) in enumerate(batch):
                pairs[method][row % 2].append(tuple(out))
    assert all(method_stats.drafts_proposed >= SAMPLES for method_stats in stats.values())  # rows drafted
    for row, inputs in enumerate(TWO_ROWS):
        assert len(pairs["nasd"][row]) == len(pairs["speculative"][row]) == SAMPLES
        joint = exact_two_token_distribution(target, inputs, processor)
        for method in pairs:
            assert chi_square_p_value(pairs[method][row], joint) > P_VALUE_THRESHOLD, (method, row)


def test_bad_batches_are_refused_before_any_model_runs(monkeypatch):
    from utils.runners.passes import ModelPasses

    def forbidden(*args, **kwargs):
        raise AssertionError("a model ran")

    monkeypatch.setattr(ModelPasses, "run", forbidden)  # every pass of every runner, batches included
    model = tiny_model("llama")
    cases = [
        ([[3, 4], []], ValueError, r"inputs\[1\] must hold at least one token id"),
        ([[3, 4], [5, "a"]], TypeError, r"inputs\[1\] must be a list of token ids"),
        ([[3, 4], [5, VOCAB + 3]], ValueError, r"inputs\[1\] holds token id"),
        ([[3, 4], 5], TypeError, r"inputs\[1\] must be a list of token ids"),
    ]
    for inputs, error, message in cases:
        with pytest.raises(error, match=message):
            autoregressive_generate(inputs, model)
        with pytest.raises(error, match=message):
            ngram_assisted_speculative_generate(inputs, MultiDynaGram(3), model)
    with pytest.raises(ValueError, match="empty list"):
        autoregressive_generate([], model)
    with pytest.raises(ValueError, match="ngram is a list of 2 items, but the batch has 3 rows"):
        ngram_assisted_speculative_generate(ROWS, [MultiDynaGram(3)] * 2, model)
    with pytest.raises(ValueError, match="generator is a list of 1 items, but the batch has 3 rows"):
        autoregressive_generate(ROWS, model, generator=[torch.Generator()])
    with pytest.raises(TypeError, match="a list of pools is for a batch"):
        ngram_assisted_speculative_generate(ROWS[0], [MultiDynaGram(3)], model)
    with pytest.raises(ValueError, match=r"inputs\[1\] must hold at least one token id"):
        beam_search_generate([[3, 4], []], model)


@pytest.mark.parametrize("name", ["mistral", "gpt2"])
def test_the_shared_cache_keeps_rows_apart_through_rollbacks_compaction_and_dropped_rows(name):
    """Runner level: after ragged rollbacks, a compaction and a dropped row, each row's logits are
    those of a one-row runner fed the row's tokens (Mistral: the sliding window counts positions)."""
    from utils.runners import SequenceRunner, SharedBatchRunner, make_runner

    model = tiny_model(name)
    rows = [prompt(10 + b, length=6 + 7 * b) for b in range(3)]
    batch = make_runner(model, rows=3)
    assert isinstance(batch, SharedBatchRunner)
    batch.forward_rows([(row, None) for row in rows], [1, 1, 1])
    for step in range(6):  # each row feeds 4 tokens and keeps 1, 2 or 3 of them: holes everywhere
        new = [prompt(20 + step + b, length=4) for b in range(3)]
        batch.forward_rows([(tokens, None) for tokens in new], [4, 4, 4])
        for b in range(3):
            batch.rollback_row(b, len(rows[b]) + 1 + (b + step) % 3)
            rows[b] += new[b][: 1 + (b + step) % 3]
    assert batch._live.shape[1] > max(map(len, rows))  # dead slots in the cache
    batch._compact()
    batch = batch.select_rows([0, 2])
    rows = [rows[0], rows[2]]
    tail = [[5, 6, 7], [8, 9]]
    logits = batch.forward_rows([(t, None) for t in tail], [3, 2])
    for row, extra, mine in zip(rows, tail, logits, strict=True):
        alone = SequenceRunner(model).forward(row + extra, num_logits=len(extra))
        # Llama-style eager attention takes its softmax in float32: padding keys change the last bits.
        torch.testing.assert_close(mine, alone, rtol=1e-5, atol=1e-5)
    one = batch.select_rows([1])  # one row left: a one-sequence runner over the compacted cache, no dead slots
    assert isinstance(one, SequenceRunner) and one.tokens == rows[1] + tail[1]
    assert one._cache.get_seq_length() == len(one.tokens)


# Greedy fixed points of the tiny models: after these prompts the continuation repeats the last
# token for ever, so each row's continuation is a copy of its prompt (checked in the test).
COPY_ROWS = {"llama": (50, [[3] + [50] * 12, [14] + [50] * 16, [20] + [50] * 12]),
             "gpt2": (14, [[7] + [14] * 12, [9] + [14] * 16, [12] + [14] * 12])}


@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize("stop_if_unknown", [False, True])
def test_rows_that_copy_their_prompts_speculate_in_a_batch(name, stop_if_unknown):
    """stop_if_unknown=False asks for drafts: every row drafts gamma tokens as alone; True: the
    batch rule drafts where the wider pass pays. Either way copyable rows take far fewer target
    passes than tokens, and each row's tokens are the single call's."""
    model = tiny_model(name)
    token, rows = COPY_ROWS[name]
    single = [autoregressive_generate(row, model, max_gen_len=30) for row in rows]
    assert single == [[token] * 30] * 3
    stats = SpeculativeStats()
    batch = ngram_assisted_speculative_generate(rows, MultiDynaGram(3), model, gamma=8, max_gen_len=30,
                                                stop_if_unknown=stop_if_unknown, stats=stats)
    assert [out for out, _ in batch] == single
    assert stats.target_forwards <= 0.5 * 30, stats


class FlatCosts:
    """Batched passes over 2 or 3 tokens a row cost about a plain pass; wider ones cost much more."""

    def __init__(self, share: float) -> None:
        self.share = share

    def batch_ratio(self, rows: int, width: int) -> float:
        return {1: 1.0, 2: 1.0, 3: 1.03}.get(width, 2.0 + width)

    def row_ratio(self, rows: int) -> float:
        return 1.0 - self.share


def test_the_batch_rule_sees_short_drafts_that_cost_about_a_plain_pass():
    from ngram_assisted.drafter import batch_width

    sure, unsure, none = [0.9, 0.8, 0.7, 0.6, 0.5], [0.3], []
    assert batch_width(FlatCosts(0.0), [sure, sure, sure]) == 3  # long drafts would not pay, short ones do
    # A row with nothing to draft: the others still draft where a row that leaves earlier saves work...
    assert batch_width(FlatCosts(0.2), [sure, none, unsure]) == 3
    # ...not where the batch ends with its slowest row whatever the others do (memory-bound).
    assert batch_width(FlatCosts(0.0), [sure, none, unsure]) == 1
    assert batch_width(FlatCosts(0.3), [none, none, none]) == 1  # nothing drafted: a plain step
