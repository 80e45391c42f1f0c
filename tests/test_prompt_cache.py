"""A conversation's keys kept for its next turn (`PromptCache`, `utils/runners/prompt_cache.py`): a turn reads only
what the conversation added, and gives the tokens it gives without the cache (float64: far from any tie)."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

from ngram_assisted import MultiDynaGram, ngram_assisted_speculative_generate
from sampling import PromptCache, autoregressive_generate, speculative_generate
from sampling.drafters.model_drafter import ModelDrafter
from tests.models import prompt, tiny_model
from utils.logits_processors import NucleusProcessor

NEW = dict(max_gen_len=12, end_tokens_id=None)


def _plain(ids, target, **options):
    return autoregressive_generate(ids, target, **NEW, **options)


def _methods(target, drafter):
    """name -> a call (ids, **options) -> generated ids, for every decoding function."""
    return {
        "plain": lambda ids, **o: _plain(ids, target, **o),
        "drafter model": lambda ids, **o: speculative_generate(ids, drafter, target, gamma=3, **NEW, **o)[0],
        "self": lambda ids, **o: speculative_generate(ids, "self", target, adaptive_gamma=True, **NEW, **o)[0],
        "nasd": lambda ids, **o: ngram_assisted_speculative_generate(ids, MultiDynaGram(3), target, **NEW, **o)[0],
    }


@pytest.mark.parametrize("method", ["plain", "drafter model", "self", "nasd"])
@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_each_turn_reads_only_what_the_conversation_added_and_gives_the_same_tokens(family, method):
    target, drafter = tiny_model(family), tiny_model(family, seed=1)
    run, cache = _methods(target, drafter)[method], PromptCache()
    models = [target, drafter] if method == "drafter model" else [target]  # a drafter model keeps its own keys
    conversation, read_before = prompt(0, 20), 0
    for turn in range(3):
        kept = cache.kept_tokens(target)
        held = [cache.reusable(model, conversation[:-1]) for model in models]
        reply = run(conversation, prompt_cache=cache)
        assert reply == _plain(conversation, target)  # without the cache
        # The last turn's prompt and reply but its last token were kept; this turn read the rest of its prompt.
        assert len(kept) == held[0] == (0 if turn == 0 else len(conversation) - 4 - 1)
        assert cache.read_tokens - read_before == sum(len(conversation) - 1 - h for h in held)
        assert cache.kept_tokens(target) == (conversation + reply)[:-1]
        if method == "drafter model":  # what it read of the prompt and of the accepted tokens
            drafters = cache.kept_tokens(drafter)
            assert len(drafters) >= len(conversation) - 1 and drafters == (conversation + reply)[: len(drafters)]
        read_before = cache.read_tokens
        conversation = conversation + reply + prompt(turn + 1, 4)
    assert cache.reused_tokens > cache.read_tokens


def test_a_prompt_that_parts_from_the_kept_tokens_reuses_them_up_to_there():
    target, cache = tiny_model("llama"), PromptCache()
    first = prompt(0, 30)
    _plain(first, target, prompt_cache=cache)
    other = first[:17] + [(first[17] + 1) % 90 + 3] + first[18:]
    assert cache.reusable(target, other[:-1]) == 17
    reused = cache.reused_tokens
    assert _plain(other, target, prompt_cache=cache) == _plain(other, target)
    assert cache.reused_tokens - reused == 17
    again = cache.reused_tokens  # the same prompt again: all of it but its last token, which the first step feeds
    assert _plain(other, target, prompt_cache=cache) == _plain(other, target)
    assert cache.reused_tokens - again == len(other) - 1


def test_seeded_sampling_draws_the_same_tokens_from_kept_keys():
    target, drafter = tiny_model("qwen2"), tiny_model("qwen2", seed=1)
    processor, cache = NucleusProcessor(temperature=0.9, top_p=0.95), PromptCache()
    conversation = prompt(3, 16)
    for turn in range(2):
        seeded = dict(logits_processor=processor, generator=torch.Generator().manual_seed(turn))
        fresh = _plain(conversation, target, logits_processor=processor, generator=torch.Generator().manual_seed(turn))
        reply, _ = speculative_generate(conversation, drafter, target, gamma=3, adaptive_gamma=True, prompt_cache=cache,
                                        **NEW, **seeded)
        assert reply == fresh
        conversation = conversation + reply + prompt(turn + 7, 5)
    assert cache.reused_tokens > 0


def test_drafts_kept_on_the_device_are_read_once_kept(monkeypatch):
    """Where a host read waits for the drafter's device, the runner's tokens hold 0-d tensors: kept as ids."""
    monkeypatch.setattr(ModelDrafter, "DEVICE", True)
    target, cache = tiny_model("qwen2"), PromptCache()
    conversation = prompt(5, 18)
    reply, _ = speculative_generate(conversation, "self", target, adaptive_gamma=True, prompt_cache=cache, **NEW)
    assert cache.kept_tokens(target) == (conversation + reply)[:-1]
    assert all(isinstance(token, int) for token in cache.kept_tokens(target))


def test_a_batch_reads_its_prompts_whole_and_leaves_the_kept_tokens():
    target, cache = tiny_model("qwen2"), PromptCache()
    first = prompt(0, 20)
    _plain(first, target, prompt_cache=cache)
    kept = cache.kept_tokens(target)
    batch = [first + [5, 6], prompt(1, 9)]
    assert _plain(batch, target, prompt_cache=cache) == _plain(batch, target)
    assert cache.kept_tokens(target) == kept and cache.reused_tokens == 0


def test_a_model_whose_weights_changed_or_that_our_forward_does_not_run_reads_its_prompt_whole():
    target, cache = copy.deepcopy(tiny_model("qwen2")), PromptCache()  # the suite's tiny models are shared: a copy
    ids = prompt(0, 20)
    _plain(ids, target, prompt_cache=cache)
    target.load_state_dict(tiny_model("qwen2", seed=2).state_dict())  # its forward is rebuilt
    assert cache.reusable(target, ids) == 0
    assert _plain(ids, target, prompt_cache=cache) == _plain(ids, target)
    gpt2 = tiny_model("gpt2")  # transformers' own caches
    _plain(ids, gpt2, prompt_cache=cache)
    assert cache.kept_tokens(gpt2) == [] and _plain(ids, gpt2, prompt_cache=cache) == _plain(ids, gpt2)


def test_another_object_is_refused_by_name_before_the_model_runs():
    with pytest.raises(TypeError, match="prompt_cache must be a PromptCache"):
        _plain(prompt(0, 5), tiny_model("qwen2"), prompt_cache={})


@pytest.mark.parametrize("method", ["drafter model", "self", "nasd"])
def test_in_bfloat16_speculation_from_kept_keys_gives_plain_decodings_tokens_from_its_own(method):
    """Each method keeps its own conversation's keys: turn after turn it gives plain decoding's tokens (with the
    plain call's own cache), to the bit of bfloat16, as without a cache."""
    target, drafter = (tiny_model("qwen2", seed=seed, dtype=torch.bfloat16) for seed in (0, 1))
    run, plain_cache, cache = _methods(target, drafter)[method], PromptCache(), PromptCache()
    conversation = prompt(4, 24)
    for turn in range(3):
        reply = run(conversation, prompt_cache=cache)
        assert reply == _plain(conversation, target, prompt_cache=plain_cache)
        conversation = conversation + reply + prompt(turn + 9, 6)
    assert cache.reused_tokens >= plain_cache.reused_tokens > 0  # a drafter model's own kept keys besides


def test_the_cache_keeps_no_model_alive():
    model, cache = copy.deepcopy(tiny_model("qwen2")), PromptCache()
    _plain(prompt(0, 10), model, prompt_cache=cache)
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None and not cache._kept
