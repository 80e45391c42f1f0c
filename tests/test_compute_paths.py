"""Exactness on every compute path the engine has, not only this CPU's: every speculative method (a drafter model,
the self-drafter over the target's cache, NASD) gives plain greedy decoding's tokens to the bit, for tiny models of
every family our own forward covers, after a short prompt and a 600-token one, for one row and a batch.

The paths: bfloat16 arithmetic (AVX512_BF16, AMX: the passes compute in bfloat16), float32 arithmetic over bfloat16
weights (AVX2-only CPUs and AVX-512 ones before BF16: `native.bfloat16_arithmetic()` False, our kernels read the
weights in bfloat16 and sum in float32) and a float32 model. Each is taken here by saying what the CPU can do, so
that a machine of one kind checks them all; the kernels built for other ISAs are `tests/test_c_kernels.py`'s.
The self-drafter's greedy output once parted from plain greedy decoding from the second token on the float32-over-
bfloat16 path: it computed in bfloat16 over its target's float32 buffer."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from ngram_assisted import MultiDynaGram, ngram_assisted_speculative_generate
from sampling import autoregressive_generate, quantized_drafter, speculative_generate
from tests.models import gemma_config, prompt
from utils.lean import forward_path, lean_decoder, native
from utils.logits_processors import GreedyProcessor

VOCAB = 128
TOKENS = 12
LLAMAS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
          "qwen3": (Qwen3Config, Qwen3ForCausalLM), "mistral": (MistralConfig, MistralForCausalLM),
          "phi3": (Phi3Config, Phi3ForCausalLM)}
FAMILIES = [*LLAMAS, "gemma", "gemma2", "gemma3"]
PATHS = {"bfloat16 arithmetic": (torch.bfloat16, True), "float32 over bfloat16": (torch.bfloat16, False),
         "float32": (torch.float32, False)}  # the model's dtype, and whether the CPU is said to compute in bfloat16


def _model(family: str, dtype: torch.dtype, seed: int = 0):
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, initializer_range=0.1,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family in LLAMAS:
        config_class, model_class = LLAMAS[family]
        config = config_class(**common, **({"sliding_window": 64} if family == "mistral" else {}))
    else:
        config, model_class = gemma_config(family, common)
    config._attn_implementation = "eager" if family == "gemma2" else "sdpa"
    model = model_class(config).to(dtype).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(params=list(PATHS))
def path(request, monkeypatch):
    dtype, bfloat16_arithmetic = PATHS[request.param]
    monkeypatch.setattr(native, "bfloat16_arithmetic", lambda: bfloat16_arithmetic)
    return dtype


def _greedy(**options) -> dict:
    return dict(max_gen_len=TOKENS, logits_processor=GreedyProcessor(), **options)


def _tokens(result):
    """The generated tokens of a speculative call: (tokens, rate) for one row, one such pair per row for a batch."""
    return result[0] if isinstance(result, tuple) else [tokens for tokens, _ in result]


def _methods(target, drafter) -> dict:
    """Each speculative method's generate, over `inputs`."""
    self_drafter = quantized_drafter(target, cache=False)
    if lean_decoder(target) is not None:  # it drafts over the target's buffer: in the target's dtype
        assert lean_decoder(self_drafter).dtype == lean_decoder(target).dtype
    return {
        "drafter model": lambda inputs: speculative_generate(inputs, drafter, target, gamma=4, **_greedy()),
        "self-drafter": lambda inputs: speculative_generate(inputs, self_drafter, target, gamma=5, **_greedy()),
        "nasd": lambda inputs: ngram_assisted_speculative_generate(inputs, MultiDynaGram(3), target, gamma=4,
                                                                   **_greedy()),
    }


@pytest.mark.parametrize("length", [12, 600])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_method_gives_plain_greedy_tokens_on_every_compute_path(family, length, path):
    target, drafter = _model(family, path), _model(family, path, seed=1)
    if native.unavailable() is None:  # then our own forward, its layers in one native call, runs every pass
        assert forward_path(target).startswith("lean forward")
        expected = torch.float32 if path == torch.float32 or not native.bfloat16_arithmetic() else torch.bfloat16
        assert lean_decoder(target).dtype == expected
    one, batch = prompt(3, length, VOCAB), [prompt(4, length, VOCAB), prompt(5, length // 2, VOCAB)]
    plain = autoregressive_generate(one, target, **_greedy())
    plain_batch = autoregressive_generate(batch, target, **_greedy())
    for name, generate in _methods(target, drafter).items():
        assert _tokens(generate(one)) == plain, name
        assert _tokens(generate(batch)) == plain_batch, name


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_rows_prompt_in_a_batch_gets_the_bits_it_gets_alone(family, path):
    """A batch's prompt pass past our kernels' width runs each row alone (`StaticRunner._prompts_alone`): torch's
    products of a padded batch's wider pass round otherwise, so a row's tokens would depend on its batch-mates at
    near-ties in bfloat16. Each row's logits are its logits alone, to the bit, and so are its greedy tokens."""
    from utils.runners.static import StaticRunner

    target = _model(family, path)
    prompts = [prompt(6, 40, VOCAB), prompt(7, 25, VOCAB), prompt(8, 57, VOCAB)]
    batch = StaticRunner(target, rows=len(prompts), slots=128)
    together = batch.forward_rows([(ids, None) for ids in prompts], [3] * len(prompts))
    assert batch.forward_passes == 1  # one prompt pass, in pieces
    for ids, logits in zip(prompts, together, strict=True):
        alone = StaticRunner(target, rows=1, slots=128).forward_rows([(ids, None)], [3])[0]
        assert torch.equal(logits, alone)
    rows = [autoregressive_generate(ids, target, **_greedy()) for ids in prompts]
    assert autoregressive_generate(prompts, target, **_greedy()) == rows


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_rows_later_pass_in_a_wide_batch_gets_the_bits_it_gets_alone(family, path, monkeypatch):
    """A batch's later pass over more tokens than our kernels take at once (4 rows of 9-token trees: 36) runs in
    groups of rows of at most 32 tokens (`StaticRunner._in_groups`), each width-invariant (in one native call where
    our kernels run every step): each row's logits are its logits alone, to the bit. Invariance asked for at any
    price here (the tiny models' tables may find it too dear); the 1.5B's bfloat16 tables take it on their own on a
    Zen 4 (docs/results.md, twentieth round)."""
    from utils.runners.static import StaticRunner

    monkeypatch.setenv("SPECDEC_WIDTH_INVARIANT", "1")
    target = _model(family, path)
    assert lean_decoder(target).invariant
    prompts = [prompt(9 + row, 6 + row, VOCAB) for row in range(4)]
    trees = [(prompt(20 + row, 9, VOCAB), [-1, 0, 0, 1, 1, 2, 3, 4, 5]) for row in range(4)]
    batch = StaticRunner(target, rows=len(prompts), slots=128)
    batch.forward_rows([(ids, None) for ids in prompts], [1] * len(prompts))
    passes = batch.forward_passes
    together = batch.forward_rows(trees, [9] * len(trees))
    assert batch.forward_passes == passes + 1 and [len(row) for row in batch.rows] == [15, 16, 17, 18]
    for ids, tree, logits in zip(prompts, trees, together, strict=True):
        alone = StaticRunner(target, rows=1, slots=128)
        alone.forward_rows([(ids, None)], [1])
        assert torch.equal(logits, alone.forward_rows([tree], [9])[0])


def test_a_group_of_rows_fed_nothing_in_a_wide_pass_gets_no_logits(monkeypatch):
    """Rows fed nothing (finished, in a batch) may fill a whole group of a pass run in groups: they get no logits,
    and the other rows their logits alone."""
    from utils.runners.static import StaticRunner

    monkeypatch.setenv("SPECDEC_WIDTH_INVARIANT", "1")
    target = _model("llama", torch.bfloat16)
    prompts = [prompt(30 + row, 5, VOCAB) for row in range(4)]
    batch = StaticRunner(target, rows=4, slots=64)
    batch.forward_rows([(ids, None) for ids in prompts], [1] * 4)
    tree = prompt(40, 17, VOCAB)
    out = batch.forward_rows([([], None), ([], None), (tree, None), (tree, None)], [0, 0, 17, 17])
    assert [o.numel() for o in out[:2]] == [0, 0] and out[2].shape == out[3].shape == (17, VOCAB)
    alone = StaticRunner(target, rows=1, slots=64)
    alone.forward_rows([(prompts[2], None)], [1])
    assert torch.equal(out[2], alone.forward_rows([(tree, None)], [17])[0])
