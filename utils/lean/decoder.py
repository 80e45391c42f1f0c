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
prompt's wider pass) the layers run in Python. Its one step of its own is act(gate) * up (`layer.c`'s
`specdec_gated`: its e^x is ours, so a value can sit a bfloat16 step from torch's at a rounding's edge), taken at
every width it runs: a row's bits stay the same whatever the pass's width.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from utils.lean import native
from utils.lean.static_kv import PassSlots, StaticKV

__all__ = ["NativeStack"]

LINEARS = ("qkv", "o", "gate_up", "down")  # decoder.c's order
BFLOAT16, FOUR_BITS = 0, 1  # decoder.c's kernel kinds


class Shape(ctypes.Structure):
    """decoder.c's `shape_t`, field for field."""

    _fields_ = [*((name, ctypes.c_int64) for name in ("rows", "width", "used", "slots", "hidden", "intermediate",
                                                       "heads", "kv_heads", "head_dim", "mask_row", "mask_token")),
                ("kinds", ctypes.c_int64 * 4), ("outs", ctypes.c_int64 * 4), ("groups", ctypes.c_int64 * 4),
                *((name, ctypes.c_int64) for name in ("bf16", "norm_bf16", "threads", "plus_one", "activation",
                                                       "sliding_row", "sliding_token")),
                *((name, ctypes.c_float) for name in ("eps", "scale", "cap"))]


SLIDING, SECOND_ROPE = 1, 2  # decoder.c's layer kind bits


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
        """Why `NativeStack` cannot run `lean`'s layers, None when it can."""
        if not lean.native:
            dtype = str(lean.dtype).removeprefix("torch.")
            return native.unavailable() or (f"our norms, rotary step and attention do not run a {dtype} pass over "
                                             f"{lean.layers[0].attention_norm.shape[-1]} features, heads of "
                                             f"{lean.head_dim} (float32 or bfloat16, multiples of {native.LANES})")
        if lean.activation_name not in native.ACTIVATION_KINDS:
            return f"activation {lean.activation_name!r}"
        if len(lean._rope_kinds) > 2 or len({layer.softcap for layer in lean.layers}) > 1:
            return "layers of more than two kinds, or attention caps that differ"
        kinds = {tuple((_kind(linear), linear.q4 and native.q4_group(*linear.q4)) for linear in layer.linears)
                 for layer in lean.layers}
        if len(kinds) != 1 or None in (kind for kind, _ in next(iter(kinds))):
            return "a linear our kernels do not run (int8, torch's int4, hooked or another dtype)"
        if lean.layers[0].gate_up.widths[0] % native.LANES:
            return f"an MLP width not a multiple of {native.LANES}"
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
        kinds = lean._rope_kinds
        self._layer_kinds = (ctypes.c_int64 * len(lean.layers))(
            *(SLIDING * layer.sliding + SECOND_ROPE * (kinds.index(layer.rope) == 1) for layer in lean.layers))
        self._cap = lean.layers[0].softcap or 0.0
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
        rotary tables by kind of layer (`LeanLlama._rope`)."""
        lean = self._lean
        rows, width, hidden = h.shape
        h = h.contiguous()
        like = h.new_empty(rows, lean.kv_heads, 0, lean.head_dim)
        buffers = [pointer for index in range(len(lean.layers))
                   for pointer in (tensor.data_ptr() for tensor in kv.layer(index, like))]
        mask = native.readable_mask(slots.mask, h.dtype)
        sliding = mask if slots.sliding_mask is None else native.readable_mask(slots.sliding_mask, h.dtype)
        tables = [ropes[kind] for kind in lean._rope_kinds]
        second = tables[1] if len(tables) > 1 else (None, None)
        positions = slots.positions.to(torch.int64).contiguous()
        write_index = slots.write_index.to(torch.int64).contiguous()
        work = h.new_empty(rows * width * self._work)
        bf16 = int(h.dtype == torch.bfloat16)
        per_linear = [(ctypes.c_int64 * 4)(*values) for values in (self._kinds, self._outs, self._groups)]
        shape = Shape(rows, width, mask.shape[-1], kv.slots, hidden, self._intermediate, lean.heads, lean.kv_heads,
                      lean.head_dim, mask.stride(0), mask.stride(2), *per_linear, bf16,
                      int(lean.norm.dtype == torch.bfloat16), torch.get_num_threads(), int(lean.norm_plus_one),
                      native.ACTIVATION_KINDS[lean.activation_name], sliding.stride(0), sliding.stride(2), lean.eps,
                      lean.scaling, self._cap)
        status = native.decoder(h.data_ptr(), work.data_ptr(), self._pointers,
                                (ctypes.c_void_p * len(buffers))(*buffers), self._layer_kinds, len(lean.layers),
                                tables[0][0].data_ptr(), tables[0][1].data_ptr(),
                                *(None if table is None else table.data_ptr() for table in second),
                                positions.data_ptr(), write_index.data_ptr(), mask.data_ptr(), sliding.data_ptr(),
                                ctypes.byref(shape))
        if status != 0:
            step = ("norm", "q/k/v product", "rotary step", "attention", "output product", "MLP norm",
                    "gate/up product", "activation", "down product", "q/k norms", "output's norm",
                    "MLP output's norm")[status % 100 - 1]
            raise ValueError(f"decoder.c's {step} failed (status {status // 100}) over {rows} x {width} tokens")
        return h
