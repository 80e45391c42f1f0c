"""Your own drafter through the public door: a drafter written outside the library (the PLD example
of examples/pld.py, a tree drafter, a drafter that samples its drafts) decodes through
`speculative_generate` with greedy identity, seeded sampling that returns plain sampling's tokens
(deterministic drafts: the coupled rule), batches equal to single calls, and the target's exact law."""

import importlib.util
from pathlib import Path

import pytest
import torch

from sampling import (
    DraftTree,
    SpeculativeStats,
    autoregressive_generate,
    autoregressive_generate_encoder_decoder,
    speculative_generate,
    speculative_generate_encoder_decoder,
)
from sampling.drafters.custom_drafters import first_branch
from tests.models import DECODER_ONLY, VOCAB, prompt, tiny_model
from tests.stats_helpers import P_VALUE_THRESHOLD, chi_square_p_value, exact_two_token_distribution
from utils.logits_processors import MultinomialProcessor, NucleusProcessor, TopKProcessor

_spec = importlib.util.spec_from_file_location("pld", Path(__file__).resolve().parent.parent / "examples" / "pld.py")
pld = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pld)
PromptLookupDrafter = pld.PromptLookupDrafter

ROWS = [prompt(0, length=6) * 2, prompt(1, length=15), prompt(2, length=4) * 3]  # ragged, two repetitive
PROCESSORS = [MultinomialProcessor(temperature=0.8), TopKProcessor(temperature=0.9, top_k=5),
              NucleusProcessor(temperature=0.9, top_p=0.8)]


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class TreeDrafter(PromptLookupDrafter):
    """PLD's chain c0 c1 ... plus, at the root, a second candidate c0 + 1 (mod V): a tree."""

    def __init__(self, vocab: int = VOCAB) -> None:
        super().__init__()
        self.vocab = vocab

    def draft(self, sequences, max_drafts, max_depths):
        out = []
        for chain, _ in super().draft(sequences, max_drafts - 1, max_depths):
            c = chain.tokens
            if not c:
                out.append((chain, None))
                continue
            parents = [-1, -1] + [0 if i == 1 else i for i in range(1, len(c))]  # c_i sits at node i + 1
            out.append((DraftTree([c[0], (c[0] + 1) % self.vocab, *c[1:]], parents), None))
        return out


class SampledDrafter:
    """Drafts sampled from a fixed q (a softmax of random scores), returned with their q: the
    standard rule of speculative sampling decides them."""

    forward_passes = 0

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.q = torch.randn(vocab, generator=self.generator, dtype=torch.float64).softmax(-1)

    def start(self, sequences):
        pass

    def draft(self, sequences, max_drafts, max_depths):
        out = []
        for depth in max_depths:
            k = max(0, min(max_drafts, depth))
            tokens = torch.multinomial(self.q, k, replacement=True, generator=self.generator).tolist() if k else []
            out.append((DraftTree.chain(tokens), self.q.expand(k, -1) if k else None))
        return out

    def update(self, sequences, paths, target_logits, p):
        pass

    def select_rows(self, keep):
        pass


def test_the_examples_drafter_has_the_protocol_and_finds_the_latest_match():
    drafter = PromptLookupDrafter(max_ngram=2)
    assert drafter.lookup([5, 6, 7, 5, 6, 8, 5, 6], 3) == [8, 5, 6]  # "5 6" last seen before 8
    assert drafter.lookup([1, 2, 3], 3) == []
    assert drafter.lookup([4, 9, 4], 0) == []
    assert first_branch(DraftTree([1, 2, 3, 4], [-1, -1, 0, 2])) == DraftTree.chain([1, 3, 4])


@pytest.mark.parametrize("name", DECODER_ONLY)
def test_greedy_pld_returns_greedy_decoding(name):
    model = tiny_model(name)
    for drafter in (PromptLookupDrafter(), TreeDrafter(), SampledDrafter(VOCAB)):
        for use_cache in (True, False):
            for row in ROWS:
                stats = SpeculativeStats()
                out, alpha = speculative_generate(row, drafter, model, gamma=5, max_gen_len=30, use_cache=use_cache,
                                                  stats=stats)
                assert out == autoregressive_generate(row, model, max_gen_len=30, use_cache=use_cache), (name, drafter)
                assert 0.0 <= alpha <= 1.0 and stats.drafts_proposed > 0 and stats.drafter_forwards == 0


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_encoder_decoder_targets_take_a_drafter_object_and_cut_trees_to_chains(name):
    model = tiny_model(name)
    source = prompt(3, length=10)
    plain = autoregressive_generate_encoder_decoder(source, model, max_gen_len=20)
    for drafter in (PromptLookupDrafter(), TreeDrafter()):
        out, _ = speculative_generate_encoder_decoder(source, drafter, model, gamma=4, max_gen_len=20)
        assert out == plain
        [(out, _)] = speculative_generate_encoder_decoder([source], drafter, model, gamma=4, max_gen_len=20)
        assert out == plain  # a batch of one row


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_seeded_pld_sampling_returns_the_tokens_of_plain_sampling(name):
    model = tiny_model(name)
    for seed, processor in enumerate(PROCESSORS):
        for row in ROWS:
            plain = autoregressive_generate(row, model, max_gen_len=24, logits_processor=processor, generator=seeded(seed))
            for drafter in (PromptLookupDrafter(), TreeDrafter()):
                out, _ = speculative_generate(row, drafter, model, gamma=6, max_gen_len=24, logits_processor=processor,
                                              generator=seeded(seed))
                assert out == plain, (processor, drafter)


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_a_batch_of_rows_of_different_lengths_equals_the_single_calls(name):
    model = tiny_model(name)
    end = autoregressive_generate(ROWS[0], model, max_gen_len=30)[4]  # the first row ends early
    common = dict(max_gen_len=24, end_tokens_id=end)
    single = [speculative_generate(row, PromptLookupDrafter(), model, gamma=5, **common) for row in ROWS]
    assert len({len(out) for out, _ in single}) > 1
    assert speculative_generate(ROWS, PromptLookupDrafter(), model, gamma=5, **common) == single
    trees = speculative_generate(ROWS, TreeDrafter(), model, gamma=5, **common)
    assert [out for out, _ in trees] == [out for out, _ in single]
    # Sampling with one generator per row: each row gets the very tokens of its single call.
    processor = NucleusProcessor(temperature=0.9, top_p=0.9)
    single = [speculative_generate(row, PromptLookupDrafter(), model, gamma=5, logits_processor=processor,
                                   generator=seeded(b), **common) for b, row in enumerate(ROWS)]
    steps = []
    batch = speculative_generate(ROWS, PromptLookupDrafter(), model, gamma=5, logits_processor=processor,
                                 generator=[seeded(b) for b in range(len(ROWS))], on_step=steps.append, **common)
    assert batch == single
    for b, (out, _) in enumerate(batch):
        assert [token for step in steps if step.row == b for token in step.tokens] == out


def test_a_drafter_object_is_checked_before_any_model_runs(monkeypatch):
    from utils.runners.passes import ModelPasses

    def forbidden(*args, **kwargs):
        raise AssertionError("a model ran")

    monkeypatch.setattr(ModelPasses, "run", forbidden)  # every pass of every runner
    model = tiny_model("llama")

    class Incomplete:
        def start(self, sequences):
            pass

        def draft(self, sequences, max_drafts, max_depths):
            return []

    with pytest.raises(TypeError, match=r"Incomplete lacks update\(\), select_rows\(\), forward_passes"):
        speculative_generate(ROWS[0], Incomplete(), model)
    with pytest.raises(TypeError, match="drafter must be a transformers PreTrainedModel or .*an object with the Drafter"):
        speculative_generate(ROWS[0], "a drafter", model)
    with pytest.raises(TypeError, match="adaptive_gamma must be a bool, got 'yes'"):
        speculative_generate(ROWS[0], PromptLookupDrafter(), model, adaptive_gamma="yes")
    with pytest.raises(ValueError, match="cascade=True is not taken with an object with the Drafter protocol"):
        speculative_generate(ROWS[0], PromptLookupDrafter(), model, cascade=True)
    with pytest.raises(TypeError, match="got an unexpected keyword argument 'no_kind_takes_this'"):
        speculative_generate(ROWS[0], PromptLookupDrafter(), model, no_kind_takes_this=1)
    with pytest.raises(ValueError, match="gamma must be an int >= 1"):
        speculative_generate(ROWS[0], PromptLookupDrafter(), model, gamma=0)
    with pytest.raises(ValueError, match="a Drafter object proposes the target's token ids"):
        speculative_generate(ROWS[0], PromptLookupDrafter(), model, drafter_tokenizer=object())


class Counting(PromptLookupDrafter):
    """Prompt lookup with a counter of its own, which the stats take in."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def draft(self, sequences, max_drafts, max_depths):
        self.calls += 1
        return super().draft(sequences, max_drafts, max_depths)

    def counters(self):
        return {"lookup_calls": self.calls}


@pytest.mark.parametrize("name", DECODER_ONLY[:2])
def test_your_own_drafter_takes_adaptive_gamma_and_brings_its_counters(name):
    model = tiny_model(name)
    stats = SpeculativeStats()
    rows = [ROWS[0], ROWS[1]]
    out = speculative_generate(rows, Counting(), model, adaptive_gamma=True, max_gen_len=12, stats=stats)
    assert [ids for ids, _ in out] == autoregressive_generate(rows, model, max_gen_len=12)
    assert stats.counters["lookup_calls"] > 0 and stats.steps > 0


class Fixed(PromptLookupDrafter):
    """Returns the same (tree, q) for every row, whatever it is."""

    def __init__(self, tree, q=None) -> None:
        super().__init__()
        self.tree, self.q = tree, q

    def draft(self, sequences, max_drafts, max_depths):
        return [(self.tree, self.q) for _ in sequences]


@pytest.mark.parametrize("tree, q, error, message", [
    (DraftTree.chain([3] * 6), None, ValueError, r"6 nodes, more than max_drafts = 5"),
    (DraftTree.chain([VOCAB]), None, ValueError, r"token 96 is outside the target's vocabulary"),
    (DraftTree.chain([torch.tensor(3)]), None, TypeError, r"tokens must be Python ints"),
    (DraftTree([3, 4], [-1, 1]), None, ValueError, r"parents\[1\] must be -1"),
    (DraftTree([3, 3], [-1, -1]), None, ValueError, r"siblings must differ"),
    (DraftTree([3, 4], [-1, -1]), torch.ones(2, VOCAB) / VOCAB, ValueError, r"a tree must be deterministic"),
    (DraftTree.chain([3, 4]), torch.ones(1, VOCAB), ValueError, r"q must have shape \(len\(tree\), V\) = \(2, 96\)"),
    ([3, 4], None, TypeError, r"must be a \(DraftTree, q or None\) pair"),
])
def test_a_wrong_draft_raises_naming_the_row(tree, q, error, message):
    model = tiny_model("llama")
    with pytest.raises(error, match=r"drafter\.draft\(\.\.\.\)\[0\].*" + message):
        speculative_generate(ROWS[1], Fixed(tree, q), model, gamma=5, max_gen_len=10)


def test_a_draft_deeper_than_the_room_left_is_refused():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"deeper than max_depths\[0\]"):
        speculative_generate(ROWS[1], Fixed(DraftTree.chain([3, 4, 5])), model, gamma=5, max_gen_len=2)


TWO_TOKEN_PROMPT = [3, 4, 5, 3]  # PLD proposes 4, 5 after the last 3
SAMPLES, ROWS_PER_CALL = 1000, 100  # each call: a batch of the same prompt, every row its own random stream


@pytest.mark.slow
def test_pld_and_sampled_drafts_follow_the_targets_law():
    """Chi-square of the first two tokens' joint law, fixed seed, P_VALUE_THRESHOLD = 1e-3 (a correct
    sampler fails once in a thousand seeds)."""
    target = tiny_model("llama", vocab=8)
    processor = MultinomialProcessor(temperature=2.0)
    generator = torch.Generator().manual_seed(0)
    joint = exact_two_token_distribution(target, TWO_TOKEN_PROMPT, processor)
    for drafter in (PromptLookupDrafter(), TreeDrafter(vocab=8), SampledDrafter(8)):
        stats, pairs = SpeculativeStats(), []
        for _ in range(SAMPLES // ROWS_PER_CALL):
            batch = speculative_generate([TWO_TOKEN_PROMPT] * ROWS_PER_CALL, drafter, target, gamma=2, max_gen_len=2,
                                         logits_processor=processor, generator=generator, stats=stats)
            pairs += [tuple(out) for out, _ in batch]
        assert stats.drafts_proposed > SAMPLES / 2, type(drafter).__name__
        assert chi_square_p_value(pairs, joint) > P_VALUE_THRESHOLD, type(drafter).__name__
