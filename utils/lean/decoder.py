"""A lean forward's whole stack of layers in one native call (`decoder.c`): each layer step for step the lean
forward's own (`llama.py`'s and `gemma.py`'s `_block`, with our kernels for every step), without the Python between
the steps: about twelve calls a layer, each allocating its tensors and converting its arguments.

    stack = NativeStack.build(lean)    None where it cannot run that model (`NativeStack.unsupported` says why)
    stack.runs(tokens)                 whether it runs a pass over that many tokens (rows x width)
    h = stack(h, ropes, slots, kv)     the embeddings (rows, width, hidden) -> the last layer's output

It runs a pass where our kernels run every step of every layer at that width: a pass of at most `native.MAX_ROWS`
tokens whose linears are our bfloat16 kernel (float32 activations over bfloat16 weights, or bfloat16 ones where the
kernel table takes ours: `kernels.py`) or our 4-bit one (a quantized target, the self-drafter), with our norms (q's
and k's too: Qwen3, Gemma 3), rotary step and attention, and silu or gelu's tanh approximation. Elsewhere (a
prompt's wider pass) the layers run in Python. Its one step of its own is act(gate) * up (`gated.c`'s
`specdec_gated`: its e^x is ours, so a value can sit a bfloat16 step from torch's at a rounding's edge), taken at
every width it runs: a row's bits stay the same whatever the pass's width.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from utils.lean import boundary as check
from utils.lean import layer_ops, native
from utils.lean.spec import SECOND_ROPE, SLIDING, LayerSpec
from utils.lean.static_kv import PassSlots, StaticKV

__all__ = ["NativeStack"]

LINEARS = ("qkv", "o", "gate_up", "down")  # decoder.c's order
BFLOAT16, FOUR_BITS = 0, 1  # decoder.c's kernel kinds


class Shape(ctypes.Structure):
    """decoder.c's `specdec_shape_t` (`specdec.h`), field for field: checked against its compiled layout before a
    stack is built (`_shape_mismatch`)."""

    _fields_ = [*((name, ctypes.c_int64) for name in ("rows", "width", "used", "slots", "hidden", "intermediate",
                                                       "heads", "kv_heads", "head_dim", "mask_row", "mask_token")),
                ("kinds", ctypes.c_int64 * 4), ("outs", ctypes.c_int64 * 4), ("groups", ctypes.c_int64 * 4),
                *((name, ctypes.c_int64) for name in ("bf16", "norm_bf16", "threads", "plus_one", "activation",
                                                       "sliding_row", "sliding_token", "table_rows", "rotary")),
                *((name, ctypes.c_float) for name in ("eps", "scale", "cap"))]


NORMS = 6  # a layer's norm pointers before its linears' (`_norms`' order, specdec.h's)


def _shape_mismatch() -> str | None:
    """Why `Shape` is not decoder.c's `specdec_shape_t` as its compiler laid it out (the size, then each field's
    offset), or the numbers a spec is told in are not its own (`LayerSpec.kind_bits`, the activation kinds, a layer's
    pointers), None when both agree: a field or a number changed on one side only would have every pass read the
    wrong numbers."""
    ours = [ctypes.sizeof(Shape), *(getattr(Shape, name).offset for name, _ in Shape._fields_)]
    theirs = layer_ops.shape_layout()
    if ours != theirs:
        return f"decoder.py's Shape (size and offsets {ours}) is not decoder.c's specdec_shape_t ({theirs})"
    ours = [SLIDING, SECOND_ROPE, layer_ops.ACTIVATION_KINDS["silu"], layer_ops.ACTIVATION_KINDS["gelu_pytorch_tanh"],
            NORMS + 3 * len(LINEARS)]
    theirs = layer_ops.spec_numbers()
    if ours != theirs:
        return f"the spec's numbers {ours} (kind bits, activations, a layer's pointers) are not decoder.c's {theirs}"
    return None


def _kind(linear) -> int | None:
    """Which of our kernels runs `linear` (a `linear.Linear`), None where neither can."""
    if linear.q4 is not None:
        return FOUR_BITS
    weight = linear.weight
    if weight is not None and native.supports(tuple(weight.shape), weight.dtype):
        return BFLOAT16
    return None


class NativeStack:
    """The layers of a `LeanLlama` (`llama.py`) in one call of `decoder.c`."""

    @staticmethod
    def unsupported(lean) -> str | None:
        """Why `NativeStack` cannot run `lean`'s layers (`unreadable` included), None when it can."""
        if not lean.native:
            dtype = str(lean.dtype).removeprefix("torch.")
            return native.unavailable() or (f"our norms, rotary step and attention do not run a {dtype} pass over "
                                             f"{lean.layers[0].attention_norm.shape[-1]} features, heads of "
                                             f"{lean.head_dim} (float32 or bfloat16, multiples of {layer_ops.LANES})")
        mismatch = _shape_mismatch()
        if mismatch is not None:
            return mismatch
        if lean.spec.activation not in layer_ops.ACTIVATION_KINDS:
            return f"activation {lean.spec.activation!r}"
        if len(lean._rope_kinds) > 2:
            return "layers of more than two rotary tables"
        kinds = {tuple((_kind(linear), linear.q4 and native.q4_group(*linear.q4)) for linear in layer.linears)
                 for layer in lean.layers}
        if len(kinds) != 1 or None in (kind for kind, _ in next(iter(kinds))):
            return "a linear our kernels do not run (int8, torch's int4, hooked or another dtype)"
        if lean.layers[0].gate_up.widths[0] % layer_ops.LANES:
            return f"an MLP width not a multiple of {layer_ops.LANES}"
        return NativeStack.unreadable(lean)

    @staticmethod
    def unreadable(lean) -> str | None:
        """Why decoder.c could not read `lean`'s tensors as its arguments say (checked once, at build time: what
        a pointer names must be contiguous, in the dtype and of the shape decoder.c takes), None when it can."""
        first = lean.layers[0]
        hidden, attended = first.mlp_norm.shape[0], lean.heads * lean.head_dim
        intermediate = first.gate_up.widths[0]
        if lean.norm.dtype not in check.READABLE:
            return f"norms in {lean.norm.dtype}"
        widths = ([attended, lean.kv_heads * lean.head_dim, lean.kv_heads * lean.head_dim], [hidden],
                  [intermediate, intermediate], [hidden])
        inputs = (hidden, attended, hidden, intermediate)
        kinds = [_kind(linear) for linear in first.linears]  # decoder.c runs every layer's by the first's kernels
        for index, layer in enumerate(lean.layers):
            for name, norm, size in _norms(layer, hidden, lean.head_dim):
                if norm is not None and (norm.dtype != lean.norm.dtype or tuple(norm.shape) != (size,)
                                         or not norm.is_contiguous() or norm.device.type != "cpu"):
                    return (f"layer {index}'s {name} norm: {tuple(norm.shape)} {norm.dtype}, strides {norm.stride()}"
                            f" (({size},) {lean.norm.dtype}, contiguous expected)")
            for name, linear, width, in_features, kind in zip(LINEARS, layer.linears, widths, inputs, kinds,
                                                             strict=True):
                reason = _unreadable_linear(linear, width, in_features, kind)
                if reason is not None:
                    return f"layer {index}'s {name} linear: {reason}"
        return None

    @classmethod
    def build(cls, lean) -> NativeStack | None:
        return None if cls.unsupported(lean) else cls(lean)

    def __init__(self, lean) -> None:
        self._lean = lean
        first = lean.layers[0]
        self._kinds = [_kind(linear) for linear in first.linears]
        self._outs = [sum(linear.widths) for linear in first.linears]
        self._groups = [0 if linear.q4 is None else native.q4_group(*linear.q4) for linear in first.linears]
        self._intermediate = first.gate_up.widths[0]
        self._keep = []  # every tensor whose memory a pointer below names, alive while the pointers are
        pointers = []
        for layer in lean.layers:
            q_norm, k_norm = layer.qk_norms or (None, None)
            norms = [norm if norm is None else norm.detach()  # decoder.c's order
                     for norm in (layer.attention_norm, layer.mlp_norm, q_norm, k_norm,
                                  getattr(layer, "post_attention_norm", None), getattr(layer, "post_mlp_norm", None))]
            pointers += [None if norm is None else norm.data_ptr() for norm in norms]
            self._keep += norms
            for linear in layer.linears:
                bias = None if linear.bias is None else linear.bias.to(lean.dtype).contiguous()
                weight, scales = linear.q4 if linear.q4 is not None else (linear.weight, None)
                self._keep += [bias, weight, scales]
                pointers += [weight.data_ptr(), None if scales is None else scales.data_ptr(),
                             None if bias is None else bias.data_ptr()]
        count = len(lean.layers)
        self._layer_kinds = (ctypes.c_int64 * count)(*(lean.spec.kind_bits(index, count) for index in range(count)))
        self._pointers = (ctypes.c_void_p * len(pointers))(*pointers)
        hidden, attended = first.mlp_norm.shape[0], lean.heads * lean.head_dim
        self._work = 2 * hidden + self._outs[0] + 2 * attended + 3 * self._intermediate  # values a token (decoder.c)

    def runs(self, tokens: int) -> bool:
        """Whether our kernels run every linear of a pass over `tokens` tokens (`Linear.ours_at`: the kernel tables'
        choice, asked at every pass, since a table shared by shape can change its family when another model's passes
        are priced)."""
        return all(linear.ours_at(tokens, self._lean.dtype) for linear in self._lean.layers[0].linears)

    def __call__(self, h: Tensor, ropes: dict, slots: PassSlots, kv: StaticKV) -> Tensor:
        """h (rows, width, hidden), the embeddings -> the last layer's output (rows, width, hidden); `ropes`: the
        rotary tables by kind of layer (`LeanLlama._rope`). Every tensor decoder.c reads or writes is checked first
        (a ValueError naming it): its shape, dtype and layout, each slot and position in range."""
        lean = self._lean
        check.shape(check.tensor(h, "h"), "h", (None, None, lean.layers[0].mlp_norm.shape[0]))
        check.dtype(h, "h", (lean.dtype,))
        rows, width, hidden = h.shape
        check.c_int(rows * width, "the tokens")
        if not 1 <= rows * width <= native.MAX_ROWS:
            raise ValueError(f"the stack runs 1 to {native.MAX_ROWS} tokens a pass, got {rows} x {width}")
        h = h.contiguous()
        like = h.new_empty(rows, lean.kv_heads, 0, lean.head_dim)
        layers = [kv.layer(index, like) for index in range(len(lean.layers))]
        for keys, values in layers:
            for name, tensor in (("keys", keys), ("values", values)):
                check.shape(tensor, name, (rows, lean.kv_heads, kv.slots, lean.head_dim))
                check.written(tensor, name)
        buffers = [tensor.data_ptr() for pair in layers for tensor in pair]
        mask = layer_ops.readable_mask(slots.mask, h.dtype)
        sliding = mask if slots.sliding_mask is None else layer_ops.readable_mask(slots.sliding_mask, h.dtype)
        check.shape(mask, "mask", (rows, 1, width, None))
        check.shape(sliding, "sliding_mask", tuple(mask.shape))
        if mask.shape[-1] > kv.slots:
            raise ValueError(f"mask covers {mask.shape[-1]} slots, the buffer holds {kv.slots}")
        tables = [ropes[kind] for kind in lean._rope_kinds]
        rotary = layer_ops.rotary_width(check.tensor(tables[0][0], "a rotary table"), lean.head_dim)
        for table in (table for pair in tables for table in pair):
            check.shape(table, "a rotary table", (None, rotary))
            check.dtype(table, "a rotary table", (h.dtype,))
            if not table.is_contiguous():
                raise ValueError(f"a rotary table must be contiguous, got strides {table.stride()}")
        layer_ops.check_slots(slots.positions, slots.write_index, kv.slots,
                              min(table.shape[0] for pair in tables for table in pair), (rows, width), slots.bounds)
        second = tables[1] if len(tables) > 1 else (None, None)
        positions = slots.positions.to(torch.int64).contiguous()
        write_index = slots.write_index.to(torch.int64).contiguous()
        work = h.new_empty(rows * width * self._work)
        bf16 = int(h.dtype == torch.bfloat16)
        per_linear = [(ctypes.c_int64 * 4)(*values) for values in (self._kinds, self._outs, self._groups)]
        spec: LayerSpec = lean.spec  # the family's fields of specdec_shape_t
        shape = Shape(rows, width, mask.shape[-1], kv.slots, hidden, self._intermediate, lean.heads, lean.kv_heads,
                      lean.head_dim, mask.stride(0), mask.stride(2), *per_linear, bf16,
                      int(lean.norm.dtype == torch.bfloat16), torch.get_num_threads(), int(spec.norm_plus_one),
                      layer_ops.ACTIVATION_KINDS[spec.activation], sliding.stride(0), sliding.stride(2),
                      min(table.shape[0] for pair in tables for table in pair), rotary, spec.eps, spec.scaling,
                      spec.softcap or 0.0)
        status = layer_ops.decoder(h.data_ptr(), work.data_ptr(), self._pointers,
                                (ctypes.c_void_p * len(buffers))(*buffers), self._layer_kinds, len(lean.layers),
                                tables[0][0].data_ptr(), tables[0][1].data_ptr(),
                                *(None if table is None else table.data_ptr() for table in second),
                                positions.data_ptr(), write_index.data_ptr(), mask.data_ptr(), sliding.data_ptr(),
                                ctypes.byref(shape))
        if status != 0:
            steps = ("norm", "q/k/v product", "rotary step", "attention", "output product", "MLP norm",
                     "gate/up product", "activation", "down product", "q/k norms", "output's norm",
                     "MLP output's norm")
            step = steps[status % 100 - 1] if 1 <= status % 100 <= len(steps) else f"step {status % 100}"
            raise ValueError(f"decoder.c's {step} failed (status {status // 100}) over {rows} x {width} tokens, "
                             f"{kv.slots} slots, write_index {slots.write_index.tolist()}")
        return h


def _norms(layer, hidden: int, head_dim: int) -> list[tuple[str, Tensor | None, int]]:
    """A layer's norm weights in decoder.c's order, each with its name and its length."""
    q_norm, k_norm = layer.qk_norms or (None, None)
    return [("attention", layer.attention_norm, hidden), ("MLP", layer.mlp_norm, hidden), ("q", q_norm, head_dim),
            ("k", k_norm, head_dim), ("post-attention", getattr(layer, "post_attention_norm", None), hidden),
            ("post-MLP", getattr(layer, "post_mlp_norm", None), hidden)]


def _unreadable_linear(linear, widths: list[int], in_features: int, kind: int | None) -> str | None:
    """Why decoder.c could not read `linear` (a `linear.Linear`) as a linear of `widths` outputs over `in_features`
    inputs run by our kernel `kind` (the first layer's, every layer's), None when it can."""
    out = sum(widths)
    if list(linear.widths) != widths or _kind(linear) != kind:
        return f"outputs {linear.widths}, not {widths} by the first layer's kernel"
    if linear.bias is not None and tuple(linear.bias.shape) != (out,):
        return f"a bias of {tuple(linear.bias.shape)}, not ({out},)"
    if kind == BFLOAT16:
        weight = linear.weight
        if weight.dtype != torch.bfloat16 or tuple(weight.shape) != (out, in_features) or not weight.is_contiguous():
            return f"{tuple(weight.shape)} {weight.dtype}, strides {weight.stride()} (a contiguous bfloat16 weight)"
        return None
    packed, scales = linear.q4  # one quantization group per linear in every layer: `unsupported`
    try:
        if native.check_q4_weight(packed, scales, out) != in_features:
            return f"a packed weight of {packed.shape[1] * native.Q4_BLOCK} inputs, not {in_features}"
    except (TypeError, ValueError) as error:
        return str(error)
    return None
