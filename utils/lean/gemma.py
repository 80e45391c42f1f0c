"""Our own forward pass for the Gemma family (Gemma, Gemma 2, Gemma 3's text model: Gemma 3 270M), `llama.py`'s
over the Hugging Face model's own tensors, with what Gemma does otherwise, each step as transformers does it:

- RMSNorm with the weight as (1 + weight), normalised and multiplied in float32, cast back afterwards;
- the embeddings scaled by sqrt(hidden_size) in the model's dtype (the model's own embedding module runs);
- gelu (tanh approximation) in the MLP, a head size of its own, Gemma 2 and 3's query scale
  (`query_pre_attn_scalar`) and their norms after the attention and around the MLP;
- Gemma 2's caps on the attention logits (the eager attention mirrored: torch's kernel has no cap) and on the
  final logits; Gemma 3's q/k norms;
- layers of two kinds (`config.layer_types`, Gemma 2 and 3): a sliding layer attends within the window
  through the runner's second mask (`PassSlots.sliding_mask`), and in Gemma 3 takes the rotary table of its own
  kind (`rope_local_base_freq`'s).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from utils.lean.llama import ACTIVATIONS, STATIC_ROPE, Layer, LeanLlama, activation, contiguous, rope_type
from utils.lean.spec import LAYER_TYPES, LayerSpec

FAMILIES = ("gemma", "gemma2", "gemma3_text")  # config.model_type this file serves


def rope_types(config) -> list[str]:
    """Every rope type the model's rotary module computes (Gemma 3: one table per kind of layer)."""
    parameters = getattr(config, "rope_parameters", None) or {}
    if config.model_type == "gemma3_text" and all(kind in parameters for kind in set(config.layer_types)):
        return [(parameters[kind] or {}).get("rope_type", "default") for kind in set(config.layer_types)]
    return [rope_type(config)]


def unsupported(model) -> str | None:
    """Why this file cannot run `model`'s passes, None when it can."""
    config = model.config
    if config.model_type not in FAMILIES:
        return f"model type {config.model_type!r} is not one of {FAMILIES}"
    if activation(config) not in ACTIVATIONS:
        return f"activation {activation(config)!r}"
    dynamic = [kind for kind in rope_types(config) if kind not in STATIC_ROPE]
    if dynamic:
        return f"rope type {dynamic[0]!r} (its table changes with the length)"
    if not set(getattr(config, "layer_types", None) or []) <= set(LAYER_TYPES):
        return f"layer types {sorted(set(config.layer_types) - set(LAYER_TYPES))}"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention"
    if getattr(config, "_attn_implementation", None) not in ("eager", "sdpa"):
        return f"attention implementation {config._attn_implementation!r}"
    return None


def gemma_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The model's RMSNorm: normalised and multiplied by (1 + weight) in float32, cast back to the input's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).type_as(x)


def layer_type(layer) -> str | None:
    """A decoder layer's kind (`LAYER_TYPES`), None where the model has one kind (Gemma)."""
    return getattr(layer.self_attn, "layer_type", None) or getattr(layer, "attention_type", None)  # 5.x, 4.x


class GemmaLayer(Layer):
    """`Layer` with Gemma 2 and 3's norms after the attention and after the MLP where the spec says so
    (`sandwich_norms`; None: Gemma's, Llama's order)."""

    def __init__(self, layer, spec: LayerSpec) -> None:
        super().__init__(layer, spec)
        sandwich = spec.sandwich_norms
        self.post_attention_norm = contiguous(layer.post_attention_layernorm.weight) if sandwich else None
        self.post_mlp_norm = contiguous(layer.post_feedforward_layernorm.weight) if sandwich else None
        if sandwich:
            self.mlp_norm = contiguous(layer.pre_feedforward_layernorm.weight)


class LeanGemma(LeanLlama):
    """The passes of a Gemma-family model (`unsupported(model)` is None) over a static KV buffer."""

    layer_class = GemmaLayer
    reference_norm = staticmethod(gemma_norm)

    @classmethod
    def spec_of(cls, model) -> LayerSpec:
        """The Llama family's spec with Gemma's norm, query scale, caps and kinds of layer. transformers 4.x: Gemma and
        Gemma 2 scale the embeddings in the model's forward, not in a module of their own (5.x: `embed_scale`)."""
        config, layers = model.config, model.model.layers
        scalar = getattr(config, "query_pre_attn_scalar", None)
        types = tuple(layer_type(layer) for layer in layers)
        llama = super().spec_of(model)
        return replace(llama, norm_plus_one=True,
                       scaling=scalar**-0.5 if config.model_type != "gemma" and scalar is not None else llama.scaling,
                       sandwich_norms=hasattr(layers[0], "pre_feedforward_layernorm"),
                       softcap=getattr(config, "attn_logit_softcapping", None),
                       final_softcap=getattr(config, "final_logit_softcapping", None),
                       embed_scale=None if hasattr(model.model.embed_tokens, "embed_scale") else config.hidden_size**0.5,
                       layer_types=types if all(types) else (), rope_by_type=config.model_type == "gemma3_text")

    def __init__(self, model) -> None:
        super().__init__(model)
        # transformers 4.x: Gemma 3 has a rotary module per kind of layer (5.x: one, asked by kind).
        local = getattr(model.model, "rotary_emb_local", None)
        self._rotaries = None if local is None else {"sliding_attention": local, "full_attention": self._rotary}

    def _embed(self, ids: Tensor) -> Tensor:
        h = self.embed(ids)
        return h if self.spec.embed_scale is None else h * torch.tensor(self.spec.embed_scale, dtype=h.dtype)

    def _rotary_at(self, probe: Tensor, positions: Tensor, kind: str | None) -> tuple[Tensor, Tensor]:
        if self._rotaries is None:
            return super()._rotary_at(probe, positions, kind)
        return self._rotaries[kind](probe, positions)

    def _block(self, layer: GemmaLayer, h: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor, slots, kv,
               index: int) -> Tensor:
        out = self._attention(layer, self._norm(h, layer.attention_norm), rope, mask, slots, kv, index)
        out = out if layer.post_attention_norm is None else self._norm(out, layer.post_attention_norm)
        h, x = self._add_norm(h, out, layer.mlp_norm)
        out = self._mlp(layer, x)
        return h + (out if layer.post_mlp_norm is None else self._norm(out, layer.post_mlp_norm))

    @torch.no_grad()
    def forward(self, ids: Tensor, slots, kv, num_logits: int) -> Tensor:
        logits = super().forward(ids, slots, kv, num_logits)
        cap = self.spec.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
