"""Our own forward pass for the Llama family (Llama and SmolLM2, Qwen2, Qwen3, Mistral, Phi-3), gpt-fast's `model.py`
way, over the Hugging Face model's own tensors: q/k/v in one GEMM and gate/up in one (`linear.py`; Phi-3 holds them
fused already), the rotary table computed once by the model's own rotary module (every rope type it knows but the
dynamic ones; longrope's per position, `LeanLlama._table`), keys and
values written in place into the runner's static buffer (`utils/lean/static_kv.py`) and read up to the
longest row, nothing built per layer per pass. Where our kernels run every step of a layer at a pass's width, all
the layers run in one native call (`decoder.py`), step for step the Python layers below.

The Hugging Face model is the reference: each step below is its step, in its order and dtypes (RMSNorm in float32,
the weight applied in the model's dtype; eager attention's softmax in float32 when the model runs "eager", torch's
scaled-dot-product kernel when it runs "sdpa"), so the logits are its logits to the dtype's rounding
(`tests/test_lean.py`, float64, every family covered).

Shapes: ids, positions, write_index (rows, width); mask (rows, 1, width, used) float, 0 where a query sees a slot and
the dtype's minimum elsewhere; the buffer's keys and values (rows, kv_heads, slots, head_dim).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from utils.lean import flash, layer_ops, native
from utils.lean.decoder import NativeStack
from utils.lean.linear import Linear, numerics
from utils.lean.spec import LayerSpec
from utils.lean.static_kv import PassSlots, StaticKV

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "phi3")  # config.model_type this file serves
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}  # transformers' names
QUERY_BLOCK = 16  # width-invariant attention pads a pass's queries to a multiple of this
KV_BLOCK = 512  # and reads the keys in whole blocks of torch's CPU attention kernel
STATIC_ROPE = ("default", "linear", "llama3", "yarn", "longrope")  # one table for every position


def rope_type(config) -> str:
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return parameters.get("rope_type", parameters.get("type", "default"))


def longrope_original(config) -> int | None:
    """Where a longrope model's rotary module switches from its short factors to its long ones (the original
    context), None for any other rope type."""
    if rope_type(config) != "longrope":
        return None
    parameters = getattr(config, "rope_parameters", None) or {}
    if "original_max_position_embeddings" in parameters:  # transformers 5.x's module reads it there
        return parameters["original_max_position_embeddings"]
    # 4.x's reads the config's attribute (never rope_scaling's key), else the model's context
    return getattr(config, "original_max_position_embeddings", None) or config.max_position_embeddings


def activation(config) -> str:
    """The MLP's activation's name (Gemma 2 and 3 call it `hidden_activation`)."""
    return getattr(config, "hidden_activation", None) or config.hidden_act


def unsupported(model) -> str | None:
    """Why this file cannot run `model`'s passes, None when it can."""
    config = model.config
    if config.model_type not in FAMILIES:
        return f"model type {config.model_type!r} is not one of {FAMILIES}"
    if getattr(config, "hidden_act", None) not in ACTIVATIONS:
        return f"activation {config.hidden_act!r}"
    if rope_type(config) not in STATIC_ROPE:
        return f"rope type {rope_type(config)!r} (its table changes with the length)"
    if len(set(getattr(config, "layer_types", None) or [])) > 1:
        return "sliding and full attention layers mixed"
    if getattr(config, "_attn_implementation", None) not in ("eager", "sdpa"):
        return f"attention implementation {config._attn_implementation!r}"
    return None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The model's RMSNorm: normalised in float32, the weight applied in the input's dtype."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def contiguous(parameter: Tensor) -> Tensor:
    """`parameter` (a model's norm weight), its data made contiguous in place where it is not (the same values; the
    model keeps using it): our kernels read it by its data pointer."""
    if not parameter.is_contiguous():
        parameter.data = parameter.data.contiguous()
    return parameter


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding, the model's `apply_rotary_pos_emb` for one tensor: x (rows, heads, width, d); tables narrower
    than a head turn its first dimensions only, the rest passing as they are (a partial rotary step: Phi-4-mini's)."""
    turned = cos.shape[-1]
    if turned < x.shape[-1]:
        return torch.cat((rotate(x[..., :turned], cos, sin), x[..., turned:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def side_by_side(owner: nn.Module, fused: str, parts: tuple[str, ...], widths: list[int]) -> Linear:
    """One product of the modules `parts` of `owner`, or of the one module computing them side by side where the model
    has it (Phi-3's qkv_proj and gate_up_proj: their outputs in the same order, of `widths`)."""
    if hasattr(owner, fused):
        return Linear([getattr(owner, fused)], parts=widths)
    return Linear([getattr(owner, name) for name in parts])


class Layer:
    """One decoder layer's tensors: attention (q/k/v fused), its norms, the MLP (gate/up fused); how it computes
    is the model's `LayerSpec`, which says which norms it has (`qk_norms`: Qwen3's, Gemma 3's)."""

    def __init__(self, layer, spec: LayerSpec) -> None:
        attention, mlp = layer.self_attn, layer.mlp
        config = attention.config
        q, kv = config.num_attention_heads * head_dim(config), config.num_key_value_heads * head_dim(config)
        self.qkv = side_by_side(attention, "qkv_proj", ("q_proj", "k_proj", "v_proj"), [q, kv, kv])
        self.o = Linear([attention.o_proj])
        self.gate_up = side_by_side(mlp, "gate_up_proj", ("gate_proj", "up_proj"), [config.intermediate_size] * 2)
        self.down = Linear([mlp.down_proj])
        self.linears = [self.qkv, self.o, self.gate_up, self.down]
        self.attention_norm = contiguous(layer.input_layernorm.weight)
        self.mlp_norm = contiguous(layer.post_attention_layernorm.weight)
        self.qk_norms = ((contiguous(attention.q_norm.weight), contiguous(attention.k_norm.weight)) if spec.qk_norms
                         else None)  # RMSNorm of each head's q and k


class LeanLlama(nn.Module):
    """The passes of a Llama-family model (`unsupported(model)` is None) over a static KV buffer. A module (it
    holds the model's embedding and rotary modules, no parameter of its own) so that a pass's hooks see it, as
    they see the Hugging Face model's (`benchmarks/breakdown.py` counts passes so). How its layers compute is its
    `spec` (`utils/lean/spec.py`: `spec_of` states it once per family; decoder.c reads it too); another family's
    forward (`gemma.py`) changes its spec, its layers' tensors (`layer_class`) and its `_block`."""

    layer_class = Layer
    reference_norm = staticmethod(rms_norm)  # the model's RMSNorm in torch's steps, where ours do not run

    @classmethod
    def spec_of(cls, model) -> LayerSpec:
        """How this family's layers compute: the Llama family's (Qwen3's q/k norms where its attention has them)."""
        config = model.config
        return LayerSpec(eps=config.rms_norm_eps, scaling=head_dim(config)**-0.5, activation=activation(config),
                         qk_norms=hasattr(model.model.layers[0].self_attn, "q_norm"))

    def __init__(self, model) -> None:
        super().__init__()
        config = model.config
        self.spec = self.spec_of(model)
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = head_dim(config)
        self.eager = config._attn_implementation == "eager"
        self.activation = ACTIVATIONS[self.spec.activation]
        decoder = model.model
        self.embed = decoder.embed_tokens
        self.layers = [self.layer_class(layer, self.spec) for layer in decoder.layers]
        self._rope_kinds = self.spec.rope_kinds(len(self.layers))
        self.norm = contiguous(decoder.norm.weight)
        self.head = Linear([model.lm_head])
        # The head's rows in the wider of the pass's dtype and its weight's (a float32 head over a bfloat16 model:
        # float32 logits, the head never read as another dtype).
        # What a pass computes in (the buffer, the masks and the logits too) and whether its rows' bits are the same
        # whatever its width (up to 32 tokens, our GEMMs' and attention's limit).
        self.dtype, self.invariant = numerics(self.layers[0].linears + [self.head], self.norm.dtype,
                                              [len(self.layers)] * len(self.layers[0].linears) + [1])
        # Our own norms, rotary step and attention (`norm.c`, `rope.c`: a partial rotary step too) where they run: one
        # call each for several eager operations, the attention width-invariant by construction (q's and k's norms,
        # Qwen3's and Gemma 3's, are ours too, before our rotary step). Where ours do not run, invariance pads
        # torch's attention's queries (`_sdpa`) and reads the keys in whole blocks of its CPU kernel (512), so that
        # a row's bits do not depend on how far the others reach.
        self._head_dtype = self.dtype if self.head.weight is None else torch.promote_types(self.dtype,
                                                                                             self.head.weight.dtype)
        self.native = layer_ops.runs(self.dtype, config.hidden_size, self.head_dim)
        padded = self.invariant and not self.native  # torch's attention, padded for invariance (`_sdpa`)
        self.kv_step = KV_BLOCK if padded else 64  # the buffer's slots a pass reads: the longest row's, rounded up
        self._rotary = decoder.rotary_emb
        self._longrope = longrope_original(config)
        self._tables: dict[str | None, tuple[Tensor, Tensor]] = {}
        # Every layer in one native call where our kernels run each of its steps (`decoder.py`), else in Python.
        self.stack = NativeStack.build(self) if self.native else None

    def _rope(self, positions: Tensor, slots: int, kind: str | None = None) -> tuple[Tensor, Tensor]:
        """cos and sin at `positions` (rows, width) -> each (rows, 1, width, R), from a table computed once by the
        model's rotary module for a buffer's `slots` positions (a position never passes them); R: the dimensions of a
        head it turns (head_dim, or fewer: a partial rotary step); `kind`: the layer type a rotary module of several
        tables is asked for (Gemma 3's), None: its only one. Where our rotary step runs (`native`), the tables
        themselves, (positions, R): it reads them."""
        if kind not in self._tables or slots > self._tables[kind][0].shape[0]:
            self._tables[kind] = self._table(slots, kind)
        cos, sin = self._tables[kind]
        if self.native:
            return cos, sin
        return cos[positions][:, None], sin[positions][:, None]

    def _table(self, slots: int, kind: str | None) -> tuple[Tensor, Tensor]:
        """cos and sin (slots, R: `_rope`) of positions 0..slots - 1 by the model's rotary module. A longrope module
        turns a whole pass by its long factors once the pass reaches past the original context, by its short ones
        before: a pass's width would then change its rows. Here each position takes what a pass ending at it takes
        (the short table before the original context, the long one from it), as decoding token by token gets them:
        the model's logits for prompts within the original context; a longer prompt, which the model's own pass
        turns by the long factors throughout, differs at its positions before it."""
        probe = torch.empty(0, dtype=self.dtype, device=self.norm.device)
        positions = torch.arange(slots, device=self.norm.device)[None]
        cos, sin = self._rotary_at(probe, positions, kind)
        original = self._longrope if kind is None else None
        if original is not None and slots > original:
            short_cos, short_sin = self._rotary_at(probe, positions[:, :original], kind)
            cos, sin = torch.cat((short_cos, cos[:, original:]), 1), torch.cat((short_sin, sin[:, original:]), 1)
        return cos[0].contiguous(), sin[0].contiguous()

    def _rotary_at(self, probe: Tensor, positions: Tensor, kind: str | None) -> tuple[Tensor, Tensor]:
        """The model's rotary module's cos and sin at `positions` (1, n), in `probe`'s dtype."""
        return self._rotary(probe, positions, *(() if kind is None else (kind,)))

    def _embed(self, ids: Tensor) -> Tensor:
        return self.embed(ids)

    def _norm(self, x: Tensor, weight: Tensor) -> Tensor:
        if self.native:
            return layer_ops.rms_norm(x, weight, self.spec.eps, plus_one=self.spec.norm_plus_one)
        return self.reference_norm(x, weight, self.spec.eps)

    def _add_norm(self, h: Tensor, delta: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
        """(h + delta, its norm): the residual addition and the next norm, one call where ours run."""
        if self.native:
            return layer_ops.add_rms_norm(h, delta, weight, self.spec.eps, plus_one=self.spec.norm_plus_one)
        h = h + delta
        return h, self._norm(h, weight)

    @torch.no_grad()
    def forward(self, ids: Tensor, slots: PassSlots, kv: StaticKV, num_logits: int) -> Tensor:
        """The logits of each row's last `num_logits` new tokens, (rows, num_logits, vocab); `kv`: the
        runner's buffer, written and read where `slots` says."""
        # Every slot and position within the buffer, once a pass (our rotary step writes the buffer where they say;
        # the rotary tables hold the buffer's positions).
        layer_ops.check_slots(slots.positions, slots.write_index, kv.slots, kv.slots, tuple(ids.shape), slots.bounds)
        ropes = {kind: self._rope(slots.positions, kv.slots, kind) for kind in self._rope_kinds}
        h = self._embed(ids).to(self.dtype)
        if self.stack is not None and self.stack.runs(ids.numel()):
            h = self.stack(h, ropes, slots, kv)
        else:
            for index, layer in enumerate(self.layers):
                sliding = self.spec.sliding(index) and slots.sliding_mask is not None
                h = self._block(layer, h, ropes[self.spec.rope(index)], slots.sliding_mask if sliding else slots.mask,
                                slots, kv, index)
        h = self._norm(h[:, h.shape[1] - num_logits :], self.norm)
        return self.head(h.to(self._head_dtype))

    def _block(self, layer: Layer, h: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor, slots: PassSlots,
               kv: StaticKV, index: int) -> Tensor:
        """One decoder layer: `h` after it."""
        out = self._attention(layer, self._norm(h, layer.attention_norm), rope, mask, slots, kv, index)
        h, x = self._add_norm(h, out, layer.mlp_norm)
        return h + self._mlp(layer, x)

    def _mlp(self, layer: Layer, x: Tensor) -> Tensor:
        gate, up = layer.gate_up.split(layer.gate_up(x))
        return layer.down(self.activation(gate) * up)

    def _attention(self, layer: Layer, x: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor, slots: PassSlots,
                   kv: StaticKV, index: int) -> Tensor:
        rows, width, _ = x.shape
        if self.native:  # rotated and written in one call
            qkv = layer.qkv(x)
            if layer.qk_norms is not None:  # each head of q and of k normalised first
                q, k, v = layer.qkv.split(qkv)
                q, k = (self._norm(part.reshape(rows, width, -1, self.head_dim), norm).reshape(part.shape)
                        for part, norm in zip((q, k), layer.qk_norms, strict=True))
                qkv = torch.cat([q, k, v], dim=-1)
            keys, values = kv.layer(index, qkv.new_empty(rows, self.kv_heads, 0, self.head_dim))
            q = layer_ops.rope_write(qkv, *rope, slots.positions, slots.write_index, keys, values, self.heads,
                                  indices_checked=True)  # by `forward`
            causal = slots.causal and mask is slots.mask
            return layer.o(self._attend(q.transpose(1, 2), keys, values, mask, causal))
        q, k, v = layer.qkv.split(layer.qkv(x))
        q = q.view(rows, width, self.heads, self.head_dim)
        k = k.view(rows, width, self.kv_heads, self.head_dim)
        if layer.qk_norms is not None:
            q, k = self._norm(q, layer.qk_norms[0]), self._norm(k, layer.qk_norms[1])
        q = rotate(q.transpose(1, 2), *rope)
        k = rotate(k.transpose(1, 2), *rope)
        v = v.view(rows, width, self.kv_heads, self.head_dim).transpose(1, 2)
        keys, values = kv.write(index, k, v, slots.write_index, slots.start)
        return layer.o(self._attend(q, keys, values, mask, slots.causal and mask is slots.mask))

    def _attend(self, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, causal: bool = False) -> Tensor:
        """Attention of q (rows, heads, width, head_dim) over the buffer's first `mask.shape[-1]` slots ->
        (rows, width, heads * head_dim): ours where it runs, up to `native.MAX_ROWS` queries as our GEMMs (scores in
        float32, capped where the spec caps them); else the model's eager one mirrored when it runs "eager" or caps
        the logits (torch's kernel cannot), else torch's. `causal`: `mask` is the causal mask over the pass's
        own tokens from slot 0 (one row's prompt, `PassSlots.causal`): past `native.MAX_ROWS` queries it is then
        ours blocked (`flash.c`, in bfloat16 where it was measured faster here: `flash.chosen`) or torch's kernel told
        so, either skipping the hidden half of the scores instead of adding a mask to all of them (a prompt's pass of
        2,048 tokens: torch's attention 1.7x faster so, docs/results.md, nineteenth round)."""
        rows, _, width, _ = q.shape
        if self.native and width <= native.MAX_ROWS:  # a prompt's wider pass: a blocked kernel is faster
            return layer_ops.attention(q, keys, values, mask, self.spec.scaling, self.spec.softcap)
        if self.eager or self.spec.softcap is not None:
            used = mask.shape[-1]
            out = self._eager_attention(q, keys[:, :, :used], values[:, :, :used], mask, self.spec.softcap)
        elif causal and width > native.MAX_ROWS:
            if rows == 1 and self._flash(q.dtype):
                return layer_ops.flash_attention(q, keys, values, 0, self.spec.scaling)
            out = F.scaled_dot_product_attention(q, keys[:, :, :width], values[:, :, :width], is_causal=True,
                                                 scale=self.spec.scaling, enable_gqa=self.heads != self.kv_heads)
        else:
            used = mask.shape[-1]
            out = self._sdpa(q, keys[:, :, :used], values[:, :, :used], mask)
        return out.transpose(1, 2).reshape(rows, width, self.heads * self.head_dim)

    def _flash(self, dtype: torch.dtype) -> bool:
        """Whether one row's prompt past `native.MAX_ROWS` queries, computed in `dtype`, takes our blocked attention
        (`flash.c`) here: ours run, the pass is bfloat16, and it was measured faster than torch's (`flash.chosen`)."""
        return self.native and dtype == torch.bfloat16 and flash.chosen(self.heads, self.kv_heads, self.head_dim)

    def prompt_attention(self) -> str:
        """Which kernel takes one row's prompt's attention over itself here, in a few words (for reports)."""
        if self.eager or self.spec.softcap is not None:
            return "the model's eager attention, mirrored"
        if self._flash(self.dtype):
            return "ours, blocked (flash.c: measured faster than torch's here)"
        return "torch's scaled_dot_product_attention, told it is causal"

    def _sdpa(self, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
        """torch's attention kernel. Width-invariant (`kernels.INVARIANT_ENV`): its CPU kernel blocks the queries
        by their count, so that one query alone and the same query among five get other bits (bfloat16, measured);
        padded to a multiple of `QUERY_BLOCK` with copies of the first, every count is blocked alike."""
        width = q.shape[2]
        padded = -(-width // QUERY_BLOCK) * QUERY_BLOCK if self.invariant else width
        if padded > width:
            q = torch.cat([q, q[:, :, :1].expand(-1, -1, padded - width, -1)], dim=2)
            mask = torch.cat([mask, mask[:, :, :1].expand(-1, -1, padded - width, -1)], dim=2)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.spec.scaling,
                                             enable_gqa=self.heads != self.kv_heads)
        return out[:, :, :width]

    def _eager_attention(self, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor,
                         softcap: float | None = None) -> Tensor:
        """The model's eager attention: scores in its dtype (capped at `softcap` by a tanh, Gemma 2's), softmax in
        float32."""
        groups = self.heads // self.kv_heads
        keys = keys.repeat_interleave(groups, dim=1) if groups > 1 else keys
        values = values.repeat_interleave(groups, dim=1) if groups > 1 else values
        scores = torch.matmul(q, keys.transpose(2, 3)) * self.spec.scaling
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores + mask
        weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(weights, values)
