"""A drafter with another tokenizer (sampling/drafters/universal.py): two byte-level BPE tokenizers trained
here on a small corpus (the small one's vocabulary is the big one's first ids: BPE learns merges in
order), tiny random models with those vocabularies."""

import copy
import functools

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, RepetitionPenaltyLogitsProcessor

import sampling.drafters.model_drafter
from sampling import SpeculativeStats, autoregressive_generate, speculative_generate, speculative_generate_encoder_decoder
from sampling.drafters.universal import LOOKBEHIND, UniversalDrafter
from sampling.loop.randomness import PositionUniforms
from sampling.loop.vocabularies import intersection
from tests.models import tiny_model
from tests.stats_helpers import P_VALUE_THRESHOLD, SAMPLES, chi_square_p_value, exact_two_token_distribution, first_two_tokens
from utils.logits_processors import GreedyProcessor, MultinomialProcessor, TopKProcessor, TransformersProcessor
from utils.runners.factory import make_runner
from utils.runners.static import StaticRunner

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "for i in range(10):\n    print(i * i)\n",
    "Speculative decoding drafts tokens with a small model and verifies them with a large one.",
    "class Stack:\n    def push(self, item):\n        self.items.append(item)\n",
    "She sells sea shells by the sea shore; the shells she sells are surely sea shells.",
] * 20
PROMPTS = ["def add(a, b):\n    return", "The quick brown", "class Stack:\n    def push(self, item):\n        self."]


@functools.cache
def byte_bpe(vocab: int) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


SMALL, BIG = byte_bpe(300), byte_bpe(420)  # 300 and 413 tokens (the corpus has no more merges)


def models_for(target_family: str, drafter_family: str, big_target: bool = True):
    target_tok, drafter_tok = (BIG, SMALL) if big_target else (SMALL, BIG)
    return (tiny_model(target_family, seed=0, vocab=len(target_tok)), target_tok,
            tiny_model(drafter_family, seed=1, vocab=len(drafter_tok)), drafter_tok)


def test_the_small_vocabulary_is_the_big_ones_first_ids():
    assert len(SMALL) == 300 and len(BIG) > 400
    drafter_ids, target_ids = intersection(BIG, SMALL, len(BIG), len(SMALL))
    assert len(drafter_ids) == len(SMALL) and torch.equal(drafter_ids, target_ids)


@pytest.mark.parametrize("families, big_target", [(("llama", "qwen2"), True), (("gpt2", "mistral"), False)])
def test_greedy_is_token_identical_to_greedy_decoding(families, big_target):
    target, tok, drafter, drafter_tok = models_for(*families, big_target=big_target)
    for text in PROMPTS:
        inputs = tok.encode(text)
        free = autoregressive_generate(inputs, target, max_gen_len=30)
        for end in (free[3], None):
            reference = autoregressive_generate(inputs, target, max_gen_len=30, end_tokens_id=end)
            for gamma in (1, 4):
                out, alpha = speculative_generate(inputs, drafter, target, tokenizer=tok, drafter_tokenizer=drafter_tok,
                                                  gamma=gamma, max_gen_len=30, end_tokens_id=end)
                assert out == reference, (families, text, end, gamma)
                assert 0.0 <= alpha <= 1.0


def test_greedy_batch_rows_of_different_lengths():
    target, tok, drafter, drafter_tok = models_for("llama", "qwen2")
    inputs = [tok.encode(text) for text in PROMPTS]
    stats = SpeculativeStats()
    out = speculative_generate(inputs, drafter, target, tokenizer=tok, drafter_tokenizer=drafter_tok, gamma=3,
                               max_gen_len=25, stats=stats)
    assert [ids for ids, _ in out] == [autoregressive_generate(row, target, max_gen_len=25) for row in inputs]
    assert stats.retokenize_seconds > 0 and stats.drafter_forwards > 0


def agreeing_pair():
    """A target that only emits the tokens both vocabularies share, and as drafter its own weights
    with the embedding and head cut to the small vocabulary: where both read the same tokens, the
    drafter's argmax is the target's."""
    target = copy.deepcopy(tiny_model("llama", seed=0, vocab=len(BIG)))
    with torch.no_grad():
        target.lm_head.weight[len(SMALL):] = 0  # logit 0 < the best of 300 random logits
    drafter = copy.deepcopy(target)
    drafter.resize_token_embeddings(len(SMALL))
    return target, drafter


def test_a_drafter_that_agrees_with_the_target_gets_its_drafts_accepted():
    target, drafter = agreeing_pair()
    for text in PROMPTS:
        inputs = SMALL.encode(text)  # ids the target shares
        stats = SpeculativeStats()
        out, alpha = speculative_generate(inputs, drafter, target, tokenizer=BIG, drafter_tokenizer=SMALL, gamma=4,
                                          max_gen_len=40, stats=stats)
        assert out == autoregressive_generate(inputs, target, max_gen_len=40)
        assert alpha > 0.5 and stats.tau > 2.0, (text, alpha, stats.tau)


def test_greedy_with_transformers_processors_and_adaptive_gamma():
    target, tok, drafter, drafter_tok = models_for("qwen2", "llama")
    processor = TransformersProcessor([RepetitionPenaltyLogitsProcessor(1.3)], do_sample=False)
    inputs = tok.encode(PROMPTS[0])
    reference = autoregressive_generate(inputs, target, logits_processor=processor, max_gen_len=25)
    for adaptive in (False, True):
        out, _ = speculative_generate(inputs, drafter, target, tokenizer=tok, drafter_tokenizer=drafter_tok, gamma=3,
                                      logits_processor=processor, max_gen_len=25, adaptive_gamma=adaptive)
        assert out == reference


def test_the_drafter_does_not_reread_the_prompt(monkeypatch):
    target, drafter = agreeing_pair()
    inputs = SMALL.encode(" ".join(PROMPTS) * 2)
    drafter_tokens = []  # the widest block of each of the drafter's passes, whichever runner runs them

    def counting_runner(*args, **kwargs):
        runner = make_runner(*args, **kwargs)
        forward_rows = runner.forward_rows

        def counting(blocks, num_logits):
            drafter_tokens.append(max(len(tokens) for tokens, _ in blocks))
            return forward_rows(blocks, num_logits)

        runner.forward_rows = counting
        return runner

    monkeypatch.setattr(sampling.drafters.model_drafter, "make_runner", counting_runner)
    speculative_generate(inputs, drafter, target, tokenizer=BIG, drafter_tokenizer=SMALL, gamma=4, max_gen_len=30)
    assert drafter_tokens[0] >= len(inputs) - 1  # the prompt, once
    assert max(drafter_tokens[1:]) <= 4 + LOOKBEHIND  # then only the tail that moved



def universal_drafter(drafter, rows: list[list[int]], max_tokens: int | None) -> UniversalDrafter:
    """The greedy drafter a call builds over `rows` (`build_model_drafter`), told the target's `max_tokens`."""
    return UniversalDrafter(drafter, GreedyProcessor(), tokenizer=BIG, drafter_tokenizer=SMALL, target_vocab_size=len(BIG),
                            uniforms=[PositionUniforms(prefix_length=len(row)) for row in rows], max_tokens=max_tokens)


def test_a_drafter_our_forward_runs_drafts_over_a_static_buffer_with_greedy_identity():
    target, drafter = agreeing_pair()  # llama: our own forward runs it
    rows = [SMALL.encode(text) for text in PROMPTS]
    for batch in (rows[:1], rows):  # one row, and a batch (its passes padded to the widest row)
        static = universal_drafter(drafter, batch, max(map(len, batch)) + 40)
        unsized = universal_drafter(drafter, batch, None)  # no bound known: transformers' cache, as before
        out = speculative_generate(batch, static, target, gamma=4, max_gen_len=40)
        assert isinstance(static.chain.runner, StaticRunner) and not isinstance(unsized.chain.runner, StaticRunner)
        assert [ids for ids, _ in out] == [autoregressive_generate(row, target, max_gen_len=40) for row in batch]
        assert out == speculative_generate(batch, unsized, target, gamma=4, max_gen_len=40)  # the same drafts taken
        assert min(alpha for _, alpha in out) > 0.3


def test_a_text_past_the_drafters_budget_ends_its_drafts_not_the_run():
    target, drafter = agreeing_pair()
    drafter.config.max_position_embeddings = 16  # the budget: its context, 16 drafter tokens with the drafts
    inputs = SMALL.encode(PROMPTS[1])
    static, steps = universal_drafter(drafter, [inputs], len(inputs) + 40), []
    out, _ = speculative_generate(inputs, static, target, gamma=4, max_gen_len=40, on_step=steps.append)
    assert out == autoregressive_generate(inputs, target, max_gen_len=40)
    assert static.budget == 16 and static.chain.runner.row_length(0) <= 16
    assert steps[0].drafts and not steps[-1].drafts  # drafts while the text fits, plain steps after

# Sampling: the law of the first two tokens, and seeds.

INPUTS_TEXT = "def add(a, b):\n    return"


def sampling_pair():
    """A target over the big vocabulary (mass on tokens the drafter lacks) and a drafter close to it."""
    target = tiny_model("llama", seed=0, vocab=len(BIG))
    drafter = copy.deepcopy(target)
    drafter.resize_token_embeddings(len(SMALL))
    with torch.no_grad():
        drafter.lm_head.weight.add_(0.3 * torch.randn(drafter.lm_head.weight.shape, generator=torch.Generator().manual_seed(0)))
    return target, drafter


@pytest.mark.slow
@pytest.mark.parametrize("processor", [TopKProcessor(temperature=1.5, top_k=6), MultinomialProcessor(temperature=0.7)], ids=repr)
def test_sampling_follows_the_target_distribution(processor):
    target, drafter = sampling_pair()
    inputs = BIG.encode(INPUTS_TEXT)
    joint = exact_two_token_distribution(target, inputs, processor)
    stats = SpeculativeStats()
    pairs = first_two_tokens(lambda rows, generator: speculative_generate(
        rows, drafter, target, tokenizer=BIG, drafter_tokenizer=SMALL, gamma=2, max_gen_len=2, logits_processor=processor,
        generator=generator, stats=stats), inputs)
    assert stats.drafts_proposed >= SAMPLES  # every row drafted
    assert chi_square_p_value(pairs, joint) > P_VALUE_THRESHOLD


def test_seeds_reproduce_single_and_batch():
    target, drafter = sampling_pair()
    processor = TopKProcessor(temperature=1.5, top_k=6)
    inputs = [BIG.encode(text) for text in PROMPTS]

    def run(rows, seeds, **kwargs):  # a batch with one generator per row, or one sequence (seeds: one seed)
        generators = [torch.Generator().manual_seed(seed) for seed in seeds]
        return speculative_generate(rows, drafter, target, tokenizer=BIG, drafter_tokenizer=SMALL, gamma=3,
                                    max_gen_len=20, logits_processor=processor,
                                    generator=generators if isinstance(rows[0], list) else generators[0], **kwargs)

    stats = SpeculativeStats()
    first = run(inputs, [1, 2, 3], stats=stats)
    assert first == run(inputs, [1, 2, 3])
    assert stats.drafts_accepted > 0
    for row, seed, (ids, _) in zip(inputs, [1, 2, 3], first, strict=True):
        assert run(row, [seed])[0] == ids  # a row of a batch: the single call's tokens


# Bad input, refused before any model runs.

def test_different_vocabularies_without_drafter_tokenizer_say_what_to_pass():
    target, tok, drafter, drafter_tok = models_for("llama", "qwen2")
    with pytest.raises(ValueError, match="tokenizer=.*drafter_tokenizer="):
        speculative_generate(tok.encode("def"), drafter, target)
    with pytest.raises(ValueError, match="tokenizer="):
        speculative_generate(tok.encode("def"), drafter, target, drafter_tokenizer=drafter_tok)


def test_a_tokenizer_that_is_not_its_models_is_refused():
    target, tok, drafter, drafter_tok = models_for("llama", "qwen2")
    with pytest.raises(ValueError, match="drafter_tokenizer has 413 tokens but the drafter has 300"):
        speculative_generate(tok.encode("def"), drafter, target, tokenizer=tok, drafter_tokenizer=tok)
    with pytest.raises(TypeError, match="drafter_tokenizer must be a transformers tokenizer"):
        speculative_generate(tok.encode("def"), drafter, target, tokenizer=tok, drafter_tokenizer="gpt2")


def test_a_tokenizer_that_cannot_round_trip_the_prompt_gives_plain_decoding_for_that_row():
    target, tok, _, _ = models_for("llama", "qwen2")
    lossy = Tokenizer(models.BPE(unk_token="<unk>"))
    lossy.pre_tokenizer = pre_tokenizers.Whitespace()  # spaces are lost
    lossy.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"], show_progress=False))
    lossy = PreTrainedTokenizerFast(tokenizer_object=lossy, unk_token="<unk>")
    drafter = tiny_model("qwen2", seed=1, vocab=len(lossy))
    inputs = tok.encode(PROMPTS[0])
    stats = SpeculativeStats()
    out, alpha = speculative_generate(inputs, drafter, target, tokenizer=tok, drafter_tokenizer=lossy, gamma=3,
                                      max_gen_len=12, stats=stats)
    assert out == autoregressive_generate(inputs, target, max_gen_len=12)
    assert stats.lossy_text_rows == 1 and stats.drafts_proposed == 0 and alpha == 0.0


# Judged on the texts in play, not on a fixed probe: a tokenizer without an emoji's bytes.

@functools.cache
def corpus_bpe(vocab: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE whose alphabet is the corpus's bytes only: lossless on the corpus's text, lossy
    on an emoji or CJK (their bytes are dropped), as many a real tokenizer is on some script."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


PROBE = "déjà vu, 東京 🙂"  # the fixed probe's hard part, once refused for every pair


def corpus_pair():
    """A target over BIG that only emits tokens the corpus tokenizer shares (its other rows' logits are
    0, below the best of the shared ones), and a drafter over the corpus tokenizer."""
    drafter_tok = corpus_bpe(300)
    target = copy.deepcopy(tiny_model("llama", seed=0, vocab=len(BIG)))
    _, shared = intersection(BIG, drafter_tok, len(BIG), len(drafter_tok))
    with torch.no_grad():
        keep = torch.zeros(len(BIG), dtype=torch.bool)
        keep[shared] = True
        target.lm_head.weight[~keep] = 0
    return target, tiny_model("qwen2", seed=1, vocab=len(drafter_tok)), drafter_tok


def test_a_pair_lossy_on_the_probe_but_lossless_on_the_text_drafts_with_greedy_identity():
    target, drafter, drafter_tok = corpus_pair()
    assert drafter_tok.decode(drafter_tok.encode(PROBE)) != PROBE  # the old probe refused this pair
    for text in PROMPTS:
        inputs = BIG.encode(text)
        stats = SpeculativeStats()
        out, _ = speculative_generate(inputs, drafter, target, tokenizer=BIG, drafter_tokenizer=drafter_tok, gamma=3,
                                      max_gen_len=20, stats=stats)
        assert out == autoregressive_generate(inputs, target, max_gen_len=20), text
        assert stats.lossy_text_rows == 0 and stats.drafts_proposed > 0, text


def test_a_text_one_tokenizer_cannot_round_trip_falls_back_to_plain_decoding_for_that_row():
    target, drafter, drafter_tok = corpus_pair()
    rows = [BIG.encode(PROMPTS[0] + " # " + PROBE), BIG.encode(PROMPTS[1])]  # the first: CJK and an emoji
    assert BIG.decode(rows[0]) == PROMPTS[0] + " # " + PROBE  # the target's tokenizer is lossless on it
    for processor in (GreedyProcessor(), TopKProcessor(temperature=1.5, top_k=6)):
        stats = SpeculativeStats()
        out = speculative_generate(rows, drafter, target, tokenizer=BIG, drafter_tokenizer=drafter_tok, gamma=3,
                                   max_gen_len=15, stats=stats, logits_processor=processor,
                                   generator=[torch.Generator().manual_seed(i) for i in (1, 2)], drafter_invariant=True)
        plain = autoregressive_generate(rows, target, max_gen_len=15, logits_processor=processor,
                                        generator=[torch.Generator().manual_seed(i) for i in (1, 2)])
        assert [ids for ids, _ in out] == plain  # greedy; sampling: coupled, plain seeded sampling's tokens
        assert stats.lossy_text_rows == 1 and stats.drafts_proposed > 0  # the other row still drafts
        single = SpeculativeStats()
        ids, alpha = speculative_generate(rows[0], drafter, target, tokenizer=BIG, drafter_tokenizer=drafter_tok,
                                          gamma=3, max_gen_len=15, stats=single, logits_processor=processor,
                                          generator=torch.Generator().manual_seed(1), drafter_invariant=True)
        assert ids == plain[0] and single.lossy_text_rows == 1 and single.drafts_proposed == 0


def test_encoder_decoder_with_another_tokenizer_is_refused():
    target, drafter = tiny_model("t5", seed=0, vocab=len(BIG)), tiny_model("bart", seed=1, vocab=len(SMALL))
    with pytest.raises(ValueError, match="decoder-only"):
        speculative_generate_encoder_decoder(BIG.encode("def"), drafter, target, tokenizer=BIG, drafter_tokenizer=SMALL)


def test_the_same_tokenizer_twice_is_the_ordinary_path():
    target, drafter = tiny_model("llama", seed=0, vocab=len(BIG)), tiny_model("llama", seed=1, vocab=len(BIG))
    inputs = BIG.encode(PROMPTS[0])
    stats = SpeculativeStats()
    out, _ = speculative_generate(inputs, drafter, target, tokenizer=BIG, drafter_tokenizer=BIG, max_gen_len=20, stats=stats)
    assert out == autoregressive_generate(inputs, target, max_gen_len=20) and stats.retokenize_seconds == 0.0
