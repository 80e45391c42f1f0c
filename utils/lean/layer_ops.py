"""A decoder layer's small operations in our kernels (`norm.c`, `rope.c`, `attention.c`, `flash.c`, `gated.c`,
`decoder.c`): one call each where torch takes several eager operations, each checked at the boundary (`boundary.py`)
before a pointer crosses.

    runs(dtype, hidden, head_dim) whether they run a lean forward's pass here (float32 or bfloat16, widths and head
                                  sizes multiples of `LANES`)
    rms_norm, add_rms_norm        the model's RMSNorm (Gemma's times 1 + weight), with the residual addition before it
    check_slots, rope_write       the rotary step and the keys' and values' write into the static buffer, its slots
                                  and positions checked
    readable_mask, attention      attention over the buffer: each query alone in one fixed order, width-invariant
                                  without padding
    flash_attention               a prompt's attention over itself, blocked (FlashAttention's online softmax)
    gated_mul                     act(gate) * up, silu or gelu's tanh approximation
    decoder(...), shape_layout()  a decoder-only model's whole stack of layers in one call (`decoder.py` drives it),
    spec_numbers()                and its shape's C layout and the numbers it reads a family's spec in, which
                                  `decoder.Shape` and `utils/lean/spec.py` are checked against
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from utils.lean import boundary as check
from utils.lean import native
from utils.lean.boundary import READABLE

__all__ = ["ACTIVATION_KINDS", "FLASH_DIMS", "FLASH_GROUP", "LANES", "add_rms_norm", "attention", "check_slots",
           "decoder", "flash_attention", "gated_mul", "readable_mask", "rms_norm", "rope_write", "rotary_width",
           "runs", "shape_layout", "spec_numbers"]

ACTIVATION_KINDS = {"silu": 0, "gelu_pytorch_tanh": 1}  # gated.c's `specdec_gated` kinds, by transformers' names
LANES = 16  # simd.h's LANES: a norm's width and a head's size must be multiples of it
FLASH_DIMS = 32  # flash.c's DIMS: its head size must be a multiple of it
FLASH_GROUP = 8  # and its query heads at most this many times its key heads



def _ops() -> ctypes.CDLL:
    """The library, for the operations below (a lean forward built with them, `runs`, calls them without reading
    the environment again: three calls a layer), else a ValueError saying why the kernels do not run here."""
    return native.library()


def runs(dtype: torch.dtype, hidden: int, head_dim: int) -> bool:
    """Whether our C operations run a lean forward's norms, rotary step and attention here, for a pass computing in `dtype`
    with `hidden` features and heads of `head_dim` (float32 or bfloat16; float64 keeps torch's operations)."""
    return native.unavailable() is None and dtype in READABLE and hidden % LANES == 0 and head_dim % LANES == 0


def _rms_norm(x: Tensor, delta: Tensor | None, weight: Tensor, eps: float, plus_one: bool) -> Tensor:
    """norm.c's RMSNorm of the contiguous `x`, `delta` (x's shape and dtype, contiguous) added into it first where
    given."""
    n = x.shape[-1] if x.dim() else 0
    if n == 0 or n % LANES:
        raise ValueError(f"x's last dimension must be a positive multiple of {LANES} for our RMSNorm, got "
                         f"{tuple(x.shape)}")
    check.dtype(x, "x", READABLE)
    check.dtype(check.tensor(weight, "weight"), "weight", READABLE)
    check.shape(weight, "weight", (n,))
    tokens = check.c_int(x.numel() // n, "the tokens")
    weight = weight.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    status = _ops().specdec_rms_norm(x.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(),
                                     out.data_ptr(), tokens, n, eps, int(plus_one), native.bf16(x), native.bf16(weight),
                                     torch.get_num_threads())
    check.status(status, "norm.c's RMSNorm", f"x {tuple(x.shape)} {x.dtype}, weight {weight.dtype}")
    return out


def rms_norm(x: Tensor, weight: Tensor, eps: float, *, plus_one: bool = False) -> Tensor:
    """RMSNorm over x's last dimension, the model's (`plus_one`: Gemma's, times 1 + weight in float32): `llama.py`'s
    `rms_norm` or `gemma.py`'s `gemma_norm` in one call. x float32 or bfloat16, its width a multiple of `LANES`;
    weight (width,) float32 or bfloat16."""
    return _rms_norm(check.tensor(x, "x").contiguous(), None, weight, eps, plus_one)


def add_rms_norm(h: Tensor, delta: Tensor, weight: Tensor, eps: float, *, plus_one: bool = False) -> tuple[Tensor, Tensor]:
    """(h + delta, its RMSNorm) in one call: the residual addition is written into `h` (made contiguous first);
    delta of h's shape."""
    h = check.tensor(h, "h").contiguous()
    check.shape(check.tensor(delta, "delta"), "delta", tuple(h.shape))
    check.dtype(delta, "delta", (torch.float32, torch.bfloat16, torch.float16, torch.float64))
    return h, _rms_norm(h, delta.to(h.dtype).contiguous(), weight, eps, plus_one)


def check_slots(positions: Tensor, write_index: Tensor, slots: int, table: int, shape: tuple[int, int],
                bounds: tuple[int, int] | None = None) -> None:
    """A pass's `positions` and `write_index` (`shape`: rows, width; integers): each slot within the buffer's
    `slots`, each position within the rotary table's `table` rows, else a ValueError naming the value. `rope_write`
    checks them at each call; a lean forward once a pass (`indices_checked`). `bounds`: (the largest slot, the
    largest position) where the caller made them from integers of its own (`PassSlots.bounds`): checked without
    reading the tensors (a read from an accelerator waits for it)."""
    for name, index in (("positions", check.tensor(positions, "positions")),
                        ("write_index", check.tensor(write_index, "write_index"))):
        if index.is_floating_point() or index.is_complex() or index.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got {index.dtype}")
        check.shape(index, name, shape)
    if bounds is None:
        check.within(write_index, "write_index", slots, f"the buffer's {slots} slots")
        check.within(positions, "positions", table, f"the rotary table's {table} positions")
        return
    for name, bound, end, what in (("write_index", bounds[0], slots, "the buffer's slots"),
                                   ("positions", bounds[1], table, "the rotary table's positions")):
        if bound >= end:
            raise ValueError(f"{name} reaches {bound}, past {what} (0..{end - 1})")


def rope_write(qkv: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, write_index: Tensor, keys: Tensor,
               values: Tensor, heads: int, *, indices_checked: bool = False) -> Tensor:
    """The q/k/v product's output (rows, width, (heads + 2 kv_heads) head_dim) -> the rotated queries (rows, width,
    heads, head_dim); the rotated keys and the values are written into the buffer `keys` and `values` (rows, kv_heads,
    slots, head_dim; contiguous, qkv's dtype) at `write_index` (rows, width). cos and sin: the rotary tables
    (positions, head_dim) in qkv's dtype, taken at `positions` (rows, width); tables narrower than a head (an even
    width) turn its first dimensions only, the rest passing as they are (a partial rotary step, as `llama.rotate`).
    `indices_checked`: the caller checked positions and write_index for this buffer and table already
    (`check_slots`, once a pass)."""
    qkv, keys, values = check.tensor(qkv, "qkv"), check.tensor(keys, "keys"), check.tensor(values, "values")
    check.dtype(qkv, "qkv", READABLE)
    check.shape(keys, "keys", (None, None, None, None))
    rows, kv_heads, slots, head_dim = keys.shape
    if head_dim % 2 or not heads > 0 or kv_heads == 0:
        raise ValueError(f"heads = {heads}, keys {tuple(keys.shape)}: at least one head of each kind, an even head size")
    check.shape(qkv, "qkv", (rows, None, (heads + 2 * kv_heads) * head_dim))
    width = qkv.shape[1]
    for name, tensor in (("keys", keys), ("values", values)):
        check.shape(tensor, name, (rows, kv_heads, slots, head_dim))
        check.dtype(tensor, name, (qkv.dtype,))
        check.written(tensor, name)
    rotary = rotary_width(check.tensor(cos, "cos"), head_dim)
    for name, table in (("cos", cos), ("sin", check.tensor(sin, "sin"))):
        check.shape(table, name, (cos.shape[0], rotary))
        check.dtype(table, name, (qkv.dtype,))
    for value, name in ((rows * width, "the tokens"), (slots, "slots"), ((heads + 2 * kv_heads) * head_dim, "qkv's width")):
        check.c_int(value, name)
    if not indices_checked:
        check_slots(positions, write_index, slots, cos.shape[0], (rows, width))
    qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
    positions, write_index = positions.to(torch.int64).contiguous(), write_index.to(torch.int64).contiguous()
    q = qkv.new_empty(rows, width, heads, head_dim)
    status = _ops().specdec_rope_write_checked(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), cos.shape[0],
                                               positions.data_ptr(), write_index.data_ptr(), q.data_ptr(),
                                               keys.data_ptr(), values.data_ptr(), rows, width, heads, kv_heads, slots,
                                               head_dim, rotary, native.bf16(qkv), torch.get_num_threads())
    if status:  # its message reads the slots: not formatted (nor read from the device) on every call
        check.status(status, "rope.c's rotary step", f"qkv {tuple(qkv.shape)}, keys {tuple(keys.shape)}, write_index "
                                                 f"{write_index.tolist()}, positions {positions.tolist()}")
    return q


def rotary_width(table: Tensor, head_dim: int) -> int:
    """The dimensions of a head that a rotary `table` (positions, width) turns: its width, an even number from 2 to
    `head_dim`; else a ValueError naming it."""
    width = table.shape[-1] if table.dim() == 2 else None
    if width is None or width % 2 or not 2 <= width <= head_dim:
        raise ValueError(f"a rotary table must be (positions, an even width of 2 to {head_dim}, the head's "
                         f"dimensions), got {tuple(table.shape)}")
    return width


def readable_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """`mask` as attention.c reads it: in the pass's `dtype`, its last stride 1 (no copy where it already is)."""
    return mask if mask.stride(-1) == 1 and mask.dtype == dtype else mask.to(dtype).contiguous()


def _buffer(q: Tensor, keys: Tensor, values: Tensor, multiple: int, most: int | None = None) -> tuple[int, int]:
    """The buffer's keys and values checked against q (rows, heads, width, head_dim): (rows, kv_heads, slots,
    head_dim) each, contiguous, in q's dtype, a head size a positive multiple of `multiple`, query heads a multiple of
    the key heads (and at most `most` times them) -> (kv_heads, slots)."""
    rows, heads, _, head_dim = q.shape
    check.shape(keys, "keys", (rows, None, None, head_dim))
    kv_heads, slots = keys.shape[1:3]
    if (head_dim == 0 or head_dim % multiple or kv_heads == 0 or heads % kv_heads
            or (most is not None and not 1 <= heads // kv_heads <= most)):
        per_key = "a multiple of the key heads" if most is None else f"1 to {most} times the key heads"
        raise ValueError(f"q {tuple(q.shape)}, keys {tuple(keys.shape)}: a head size that is a positive multiple of "
                         f"{multiple}, and query heads {per_key}")
    for name, tensor in (("keys", keys), ("values", values)):
        check.shape(tensor, name, (rows, kv_heads, slots, head_dim))
        check.dtype(tensor, name, (q.dtype,))
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous (the buffer's layout), got strides {tensor.stride()}")
    return kv_heads, slots


def attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float, softcap: float | None) -> Tensor:
    """Attention of the queries q (rows, heads, width, head_dim; any strides but the last) over the first
    `mask.shape[-1]` slots of the buffer's keys and values (rows, kv_heads, slots, head_dim; contiguous, q's dtype),
    `mask` (rows, 1, width, used) added to the scores (the dtype's minimum hides a key) -> (rows, width, heads *
    head_dim), the output projection's input. Scores scaled by `scale`, capped at `softcap` by a tanh (Gemma 2);
    softmax and sums in float32, each query alone in one fixed order: the same bits whatever the pass's width."""
    q, keys, values, mask = (check.tensor(t, name) for t, name in ((q, "q"), (keys, "keys"), (values, "values"), (mask, "mask")))
    check.dtype(q, "q", READABLE)
    check.shape(q, "q", (None, None, None, None))
    rows, heads, width, head_dim = q.shape
    kv_heads, slots = _buffer(q, keys, values, LANES)
    check.shape(mask, "mask", (rows, 1, width, None))
    if mask.shape[-1] > slots:
        raise ValueError(f"mask covers {mask.shape[-1]} slots, the buffer holds {slots}")
    check.dtype(mask, "mask", (torch.float32, torch.bfloat16, torch.float16, torch.float64))
    for value, name in ((rows, "rows"), (heads, "heads"), (width, "width"), (slots, "slots"), (head_dim, "head_dim")):
        check.c_int(value, name)
    q = q if q.stride(-1) == 1 else q.contiguous()
    mask = readable_mask(mask, q.dtype)
    out = q.new_empty(rows, width, heads * head_dim)
    status = _ops().specdec_attention(q.data_ptr(), q.stride(0), q.stride(1), q.stride(2), keys.data_ptr(),
                                      values.data_ptr(), mask.data_ptr(), mask.stride(0), mask.stride(2),
                                      out.data_ptr(), rows, heads, kv_heads, width, mask.shape[-1], slots,
                                      head_dim, scale, softcap or 0.0, native.bf16(q), torch.get_num_threads())
    check.status(status, "attention.c", f"q {tuple(q.shape)}, keys {tuple(keys.shape)}, mask {tuple(mask.shape)}")
    return out


def flash_attention(q: Tensor, keys: Tensor, values: Tensor, start: int, scale: float) -> Tensor:
    """A prompt's attention over itself (`flash.c`): q (1, heads, width, head_dim; any strides but the last) at
    positions start..start + width - 1, each over the buffer's keys and values (1, kv_heads, slots, head_dim;
    contiguous) up to its own position -> (1, width, heads * head_dim). bfloat16; scores scaled by `scale`, summed in
    float32, the softmax's weights rounded to bfloat16 before they weigh the values (as torch's kernel rounds them).
    Each query's bits depend on its position and keys only: the same whatever the prompt's width or the threads."""
    q, keys, values = (check.tensor(t, name) for t, name in ((q, "q"), (keys, "keys"), (values, "values")))
    check.dtype(q, "q", (torch.bfloat16,))
    check.shape(q, "q", (1, None, None, None))
    _, heads, width, head_dim = q.shape
    kv_heads, slots = _buffer(q, keys, values, FLASH_DIMS, FLASH_GROUP)
    if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= slots - width:
        raise ValueError(f"start must be an int from 0 to slots - width = {slots - width}, got {start!r}")
    for value, name in ((heads, "heads"), (width, "width"), (slots, "slots"), (head_dim, "head_dim")):
        check.c_int(value, name)
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = q.new_empty(1, width, heads * head_dim)
    status = _ops().specdec_flash_attention(q.data_ptr(), q.stride(1), q.stride(2), keys.data_ptr(), values.data_ptr(),
                                            out.data_ptr(), heads, kv_heads, width, start, slots, head_dim, scale,
                                            torch.get_num_threads())
    check.status(status, "flash.c", f"q {tuple(q.shape)}, keys {tuple(keys.shape)}, start {start}")
    return out


def gated_mul(gate_up: Tensor, activation: str) -> Tensor:
    """act(gate) * up for gate_up (..., 2 n) = [gate | up] -> (..., n), n a multiple of `LANES`, `activation` one of
    `ACTIVATION_KINDS` (transformers' names), each step rounded to the dtype as torch's (float32 or bfloat16; silu
    x sigmoid(x), gelu torch's 0.5 x (1 + tanh(y)), both from our e^x: within a float32 ulp or a few of torch's,
    `gated.c`)."""
    gate_up = check.tensor(gate_up, "gate_up")
    if activation not in ACTIVATION_KINDS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATION_KINDS)}, got {activation!r}")
    check.dtype(gate_up, "gate_up", READABLE)
    width = gate_up.shape[-1] if gate_up.dim() else 0
    if width == 0 or width % (2 * LANES):
        raise ValueError(f"gate_up's last dimension must be two halves, each a positive multiple of {LANES}, got "
                         f"{tuple(gate_up.shape)}")
    gate_up = gate_up.contiguous()
    n = width // 2
    tokens = check.c_int(gate_up.numel() // width, "the tokens")
    out = gate_up.new_empty(*gate_up.shape[:-1], n)
    status = _ops().specdec_gated(gate_up.data_ptr(), out.data_ptr(), tokens, n, ACTIVATION_KINDS[activation],
                                  native.bf16(gate_up), torch.get_num_threads())
    check.status(status, f"gated.c's {activation}", f"gate_up {tuple(gate_up.shape)} {gate_up.dtype}")
    return out


def decoder(*arguments) -> int:
    """decoder.c's `specdec_decoder` (`decoder.py` builds and checks its arguments): 0, else the failing step and its
    status."""
    return _ops().specdec_decoder(*arguments)


def shape_layout() -> list[int]:
    """decoder.c's `specdec_shape_t` as the C compiler laid it out: its size, then each field's offset in order."""
    return _numbers(_ops().specdec_shape_layout)


def spec_numbers() -> list[int]:
    """The numbers decoder.c reads a family's spec in (`specdec.h`'s `specdec_spec_numbers`): the layer kind bits
    SLIDING and SECOND_ROPE, the activation kinds silu and gelu (tanh), a layer's pointer count."""
    return _numbers(_ops().specdec_spec_numbers)


def _numbers(function) -> list[int]:
    out = (ctypes.c_int64 * 64)()
    return list(out[:function(out, 64)])
