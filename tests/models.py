"""Tiny random Hugging Face models built from configs (no downloads), in float64 so that a pass over
several tokens and the same tokens one at a time agree to the last bit that matters."""

from __future__ import annotations

import torch
import transformers
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GemmaConfig,
    GemmaForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)

VOCAB = 96
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)


def _config(name: str, vocab: int):
    common = dict(vocab_size=vocab, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if name == "llama":
        return LlamaConfig(**SMALL, num_key_value_heads=2, max_position_embeddings=256, **common)
    if name == "qwen2":
        return Qwen2Config(**SMALL, num_key_value_heads=2, max_position_embeddings=256, **common)
    if name == "mistral":  # sliding window of 8 positions: rollback must keep the full history
        return MistralConfig(**SMALL, num_key_value_heads=2, max_position_embeddings=256, sliding_window=8, **common)
    if name == "gpt2":
        return GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=128, **common)
    if name == "t5":
        return T5Config(d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4, decoder_start_token_id=0, initializer_factor=8.0, **common)
    if name == "bart":
        return BartConfig(
            d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=128, decoder_start_token_id=2, init_std=0.3,
            forced_eos_token_id=None, **common,
        )
    raise KeyError(name)


_CLASSES = {
    "llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "mistral": MistralForCausalLM,
    "gpt2": GPT2LMHeadModel, "t5": T5ForConditionalGeneration, "bart": BartForConditionalGeneration,
}
DECODER_ONLY = ["llama", "gpt2", "qwen2", "mistral"]
ENCODER_DECODER = ["t5", "bart"]


def tiny_model(name: str, seed: int = 0, vocab: int = VOCAB, dtype: torch.dtype = torch.float64, attention: str = "eager"):
    """A tiny random model of family `name`, deterministic in `seed`, in eval mode."""
    torch.manual_seed(seed)
    config = _config(name, vocab)
    config._attn_implementation = attention
    config.initializer_range = 0.3  # large weights: peaked, varied distributions, no near-ties
    model = _CLASSES[name](config).to(dtype).eval()
    model.generation_config.pad_token_id = 0
    # No end token in the generation config: `end_tokens_id` left out means the model's eos, and the
    # suite's properties are about max_gen_len tokens of random text, where token 2 would cut them short.
    # The config keeps eos 2 (padding evidence); tests/test_habits.py decodes with it set.
    model.generation_config.eos_token_id = None
    return model


def gemma_config(name: str, common: dict):
    """A tiny Gemma-family config and model class (`name`: gemma, gemma2 or gemma3) over the `common` options, with
    Gemma's own: a head size of its own; Gemma 2 and 3 three layers, sliding ones around a full one with a
    window of 6 positions, a query scale of their own; Gemma 2's caps on the attention and final logits; Gemma 3's
    two rotary tables."""
    common = {**common, "head_dim": 16}
    if name == "gemma":
        return GemmaConfig(**common), GemmaForCausalLM
    mixed = dict(num_hidden_layers=3, query_pre_attn_scalar=24, sliding_window=6,
                 layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    common = {**common, **mixed}
    if name == "gemma2":
        return Gemma2Config(attn_logit_softcapping=5.0, final_logit_softcapping=3.0, **common), Gemma2ForCausalLM
    rope = {"full_attention": {"rope_type": "default", "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}}
    return Gemma3TextConfig(rope_parameters=rope, **common), Gemma3ForCausalLM


def phi3_rope(turned: float = 1.0, longrope: dict | None = None) -> dict:
    """Phi3Config's keyword arguments for a rotary step turning `turned` of each head, with longrope's factors where
    given ({"short_factor": ..., "long_factor": ...}), as the installed transformers takes them: 5.x one
    `rope_parameters`, 4.x `rope_theta`, `partial_rotary_factor` and `rope_scaling` (a 4.x config keeps an unknown
    `rope_parameters` without reading it: the model would turn whole heads by the default table)."""
    if int(transformers.__version__.split(".")[0]) >= 5:
        return {"rope_parameters": {"rope_type": "default" if longrope is None else "longrope", "rope_theta": 10000.0,
                                    "partial_rotary_factor": turned, **(longrope or {})}}
    scaling = None if longrope is None else {"type": "longrope", **longrope}  # 4.x: these three fields exactly
    return {"rope_theta": 10000.0, "partial_rotary_factor": turned, "rope_scaling": scaling}


def prompt(seed: int, length: int = 12, vocab: int = VOCAB) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=g).tolist()
