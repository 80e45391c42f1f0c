"""Our own kernels: GEMMs (`gemm.c`) and a layer's small operations (`layer.c`), built for this CPU by its C compiler
on first use (about a second), kept under `SPECDEC_CACHE/kernels`, called through ctypes, never used where they
cannot be built (no C compiler, a CPU without AVX2 and FMA) or with `SPECDEC_NATIVE=0`: torch's operations run then.

    unavailable()                why the kernels cannot run here, None when they can
    supports(shape, dtype)       whether the bfloat16 kernel can multiply a weight of `shape` (out, in) in `dtype`
    gemm(x, weight, bias)        x W^T + b, in x's dtype (float32 or bfloat16), W bfloat16: one candidate among
                                 torch's products in the kernel table (`kernels.py`), used where measured fastest;
                                 bfloat16 activations take the tile unit where there is one (`tile_unit`)
    tile_unit()                  whether this CPU's AMX multiplies bfloat16 activations here (Sapphire Rapids on)
    compute_dtype(weights)       the dtype a lean forward computes in over these weights
    supports_q4, pack_q4,        4-bit weights in groups of 32 or 64 (w = d q + m) times activations quantized to int8
    gemm_q4, dequantize_q4,      per block of 32 (llama.cpp's Q4_1 x Q8_1): integer dot products, for
    q4_group                     `utils/quantize.py`
    layer_ops(dtype, hidden, hd) whether the lean forward's norms, rotary step and attention run here (`layer.c`):
    rms_norm, add_rms_norm,      one call each where torch takes several eager operations; attention is
    rope_write, attention,       width-invariant without padding (each query alone, in one fixed order)
    gated_mul                    act(gate) * up, silu or gelu's tanh approximation
    readable_mask(mask, dtype)   a mask as layer.c reads it (attention's, the stack's)
    decoder(...)                 a decoder-only model's whole stack of layers in one call (`decoder.c`, driven by
                                 `decoder.py`)

On AMX (Intel Xeon from Sapphire Rapids) bfloat16 activations take the tile unit: 16 rows cost what one costs,
the weights' reading alone (measured against torch's products: docs/results.md, eleventh round).
Elsewhere the bfloat16 kernel multiplies in float32, so on a CPU without bfloat16 arithmetic (AVX2 only) a model held in
bfloat16 (its checkpoint's dtype, most Hub checkpoints) computes in float32 at half the bytes a float32 model
reads. Each output of either kernel is one fixed chain of operations per row, so a row's result is the same bits
whatever the number of rows (width-invariant by construction).
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from utils import settings
from utils.lean import build

__all__ = ["ACTIVATION_KINDS", "LANES", "MAX_ROWS", "NATIVE_ENV", "Q4_BLOCK", "Q4_GROUPS", "Q4_ROWS", "add_rms_norm",
           "attention", "bfloat16_arithmetic", "compute_dtype", "decoder", "dequantize_q4", "gated_mul", "gemm",
           "gemm_q4", "layer_ops", "pack_q4", "q4_group", "readable_mask", "rms_norm", "rope_write", "supports",
           "supports_q4", "tile_unit", "unavailable"]

GEMM_SOURCE = Path(__file__).with_name("gemm.c")  # the products (a kernel table's and a quantized model's version)
NATIVE_ENV = build.NATIVE_ENV  # "0": none of our kernels, torch's operations everywhere
MAX_ROWS = 32  # gemm.c's MAX_ROWS
Q4_BLOCK = 32  # gemm.c's 4-bit block: input columns quantized together (an int8 scale of the activations; a weight's
#                scale and minimum serve one block or two)
Q4_ROWS = 16  # and its weight rows laid out together (one per vector lane)
Q4_GROUPS = (32, 64)  # the quantization groups it takes: a scale and a minimum per block of 32 inputs, or per two
ACTIVATION_KINDS = {"silu": 0, "gelu_pytorch_tanh": 1}  # layer.c's `specdec_gated` kinds, by transformers' names
LANES = 16  # layer.c's LANES: a norm's width and a head's size must be multiples of it


@cache
@build.announced  # one warning a process where they cannot run (not under SPECDEC_NATIVE=0)
def _library() -> tuple[ctypes.CDLL | None, str | None]:
    """The built kernel and its input block (from the cache or compiled now: `build.py`), or None and why not."""
    library, reason = build.load()
    if library is None:
        return None, reason
    library.specdec_gemm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 6
    library.specdec_gemm.restype = ctypes.c_int
    library.specdec_gemm_q4.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 7
    library.specdec_gemm_q4.restype = ctypes.c_int
    library.specdec_dequantize_q4.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 5
    library.specdec_dequantize_q4.restype = ctypes.c_int
    pointer, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    library.specdec_rms_norm.argtypes = [pointer] * 4 + [i32, i32, f32, i32, i32, i32, i32]
    library.specdec_rope_write.argtypes = [pointer] * 8 + [i32] * 8
    library.specdec_attention.argtypes = ([pointer, i64, i64, i64, pointer, pointer, pointer, i64, i64, pointer]
                                          + [i32] * 7 + [f32, f32, i32, i32])
    library.specdec_gated.argtypes = [pointer] * 2 + [i32] * 5
    library.specdec_decoder.argtypes = [pointer] * 5 + [i32] + [pointer] * 9
    for function in (library.specdec_rms_norm, library.specdec_rope_write, library.specdec_attention,
                     library.specdec_gated, library.specdec_decoder):
        function.restype = ctypes.c_int
    library.specdec_amx.restype = ctypes.c_int
    if library.specdec_block() == 0:
        return None, "this CPU has neither AVX-512 nor AVX2 with FMA"
    return library, None


def unavailable() -> str | None:
    """Why the kernels cannot run here (no compiler, no vector unit they are written for, `SPECDEC_NATIVE=0`), None
    when they can."""
    if not settings.current().native:
        return f"{NATIVE_ENV}=0"
    return _library()[1]


def _loaded() -> ctypes.CDLL | None:
    """The kernels' library, None where they cannot run (`unavailable`)."""
    return None if unavailable() else _library()[0]


def supports(shape: tuple[int, int], dtype: torch.dtype) -> bool:
    """Whether the kernel can multiply a weight of `shape` (out, in) held in `dtype` here."""
    library = _loaded()
    return (library is not None and dtype == torch.bfloat16 and 0 < shape[1] <= C_INT_MAX
            and 0 < shape[0] <= C_INT_MAX and shape[1] % library.specdec_block() == 0)


# ---- the checks every entry point makes before a pointer crosses to C: a wrong reading is never a result ----

C_INT_MAX = 2**31 - 1  # a size passed as a C int (ctypes truncates past it silently)
READABLE = (torch.float32, torch.bfloat16)  # the activations' dtypes our kernels read (`bf16` flags)


def _tensor(value, name: str) -> Tensor:
    """`value`, a CPU tensor, else a TypeError/ValueError naming the argument `name`."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU for our kernels, got a tensor on {value.device}")
    return value


def _dtype(tensor: Tensor, name: str, allowed: tuple[torch.dtype, ...]) -> None:
    if tensor.dtype not in allowed:
        expected = " or ".join(str(dtype).removeprefix("torch.") for dtype in allowed)
        raise TypeError(f"{name} must be {expected} for our kernels, got {str(tensor.dtype).removeprefix('torch.')}")


def _shape(tensor: Tensor, name: str, expected: tuple) -> None:
    """`tensor`'s shape is `expected` (None: any size in that dimension), else a ValueError naming it."""
    if tensor.dim() != len(expected) or any(e is not None and s != e for s, e in zip(tensor.shape, expected, strict=True)):
        wanted = "(" + ", ".join("any" if e is None else str(e) for e in expected) + ")"
        raise ValueError(f"{name} must have the shape {wanted}, got {tuple(tensor.shape)}")


def _c_int(value: int, name: str) -> int:
    """`value` where it fits a C int, else a ValueError naming `name`."""
    if not 0 <= value <= C_INT_MAX:
        raise ValueError(f"{name} = {value} does not fit our kernels' C int (0 to {C_INT_MAX})")
    return value


def _written(tensor: Tensor, name: str) -> None:
    """A tensor the kernel writes into: contiguous (a copy would take the writes), else a ValueError."""
    if not tensor.is_contiguous():
        raise ValueError(f"{name} is written in place by our kernel and must be contiguous, got strides "
                         f"{tensor.stride()} for the shape {tuple(tensor.shape)}")


def _within(index: Tensor, name: str, end: int, what: str) -> None:
    """Every value of the integer tensor `index` in 0..end - 1, else a ValueError naming the first one outside."""
    if index.numel() == 0:
        return
    low, high = (int(bound) for bound in torch.aminmax(index))
    if low < 0 or high >= end:
        bad = index[(index < 0) | (index >= end)][0].item()
        raise ValueError(f"{name} holds {bad}, outside 0..{end - 1} ({what})")


def _status(status: int, what: str, values: str) -> None:
    """A kernel's nonzero status as a ValueError naming the call's values (the C side checks its arguments too;
    status 2 in layer.c: no memory)."""
    if status != 0:
        raise ValueError(f"{what} failed (status {status}: arguments it refuses, or no memory): {values}")


# ---- the products ----


def gemm(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x W^T + b for x (rows <= MAX_ROWS, in) in float32 or bfloat16, W (out, in) bfloat16, b (out,) any float dtype
    (used in x's): the result in x's dtype, each output summed in float32 in the kernel's fixed order. Rows of
    another float dtype (float16, float64) are multiplied as float32 and returned in their own. Where the kernels do
    not run (`unavailable()`, `SPECDEC_NATIVE=0`), torch's product of the same values in float32 (other bits).
    Wrong arguments raise a TypeError or ValueError naming them; nothing else reaches the kernel."""
    x, weight = _tensor(x, "x"), _tensor(weight, "weight")
    _dtype(weight, "weight", (torch.bfloat16,))
    _dtype(x, "x", (torch.float32, torch.bfloat16, torch.float16, torch.float64))
    _shape(x, "x", (None, weight.shape[1] if weight.dim() == 2 else None))
    _shape(weight, "weight", (None, x.shape[1]))
    if bias is not None:
        _dtype(_tensor(bias, "bias"), "bias", (torch.float32, torch.bfloat16, torch.float16, torch.float64))
        _shape(bias, "bias", (weight.shape[0],))
    library = _loaded()
    if library is None:  # torch's operations, as everywhere else with SPECDEC_NATIVE=0
        y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        return y.to(x.dtype)
    if x.dtype not in READABLE:
        return gemm(x.float(), weight, bias).to(x.dtype)
    rows, (out_features, in_features) = x.shape[0], weight.shape
    if not 1 <= rows <= MAX_ROWS or in_features % library.specdec_block() or out_features > C_INT_MAX:
        raise ValueError(f"the native kernel cannot multiply x {tuple(x.shape)} {x.dtype} by W {tuple(weight.shape)} "
                         f"{weight.dtype}: 1 to at most {MAX_ROWS} rows, the input width a multiple of "
                         f"{library.specdec_block()}")
    x, weight = x.contiguous(), weight.contiguous()  # no copy where they are already (the fused weights are)
    bias = None if bias is None else bias.to(x.dtype).contiguous()
    out = torch.empty(rows, out_features, dtype=x.dtype)
    status = library.specdec_gemm(weight.data_ptr(), x.data_ptr(), None if bias is None else bias.data_ptr(),
                                  out.data_ptr(), rows, out_features, in_features, _bf16(x), _bf16(x),
                                  torch.get_num_threads())
    _status(status, "gemm.c's bfloat16 product", f"x {tuple(x.shape)} {x.dtype}, W {tuple(weight.shape)}")
    return out


def tile_unit() -> bool:
    """Whether bfloat16 activations take the tile unit (AMX) in `gemm` here: built for it, and Linux let this
    process use its state."""
    library = _loaded()
    return library is not None and library.specdec_amx() == 1


@cache
def bfloat16_arithmetic() -> bool:
    """Whether this CPU computes in bfloat16 (AVX-512-BF16 or AMX). Elsewhere a bfloat16 matmul over a few rows is
    converted on the fly and grows with the rows: on a 2-core AMD EPYC with AVX2 only, the 1.5B's pass over 5 tokens
    cost 3.98x its one-token pass in bfloat16, 1.39x in float32, which no draft can pay for (docs/results.md).
    torch held to AVX2 (`ATEN_CPU_CAPABILITY=avx2`: how the suite and `benchmarks.passes --emulate-avx2` take an
    AVX2-only CPU's path here) computes as such a CPU does."""
    if torch.backends.cpu.get_cpu_capability() in ("DEFAULT", "AVX2"):
        return False
    return any(getattr(torch.cpu, check, lambda: False)() for check in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def compute_dtype(weights: list[Tensor]) -> torch.dtype:
    """The dtype a lean forward computes in over `weights` (its linears'): float32 over bfloat16 weights where this
    CPU has no bfloat16 arithmetic and this kernel takes every one of them (the weights read in bfloat16, the
    products summed in float32: a float32 model's numerics at half its bytes), else the weights' own."""
    dtype = weights[0].dtype
    if dtype == torch.bfloat16 and not bfloat16_arithmetic() and all(supports(tuple(w.shape), w.dtype) for w in weights):
        return torch.float32
    return dtype


def supports_q4(in_features: int, group_size: int) -> bool:
    """Whether the 4-bit kernel can run a linear of `in_features` quantized in groups of `group_size` here: groups of
    32 inputs (a scale and a minimum each: 5 bits a weight) or 64 (4.5 bits)."""
    library = _loaded()
    return (library is not None and library.specdec_q4_block() > 0 and group_size in Q4_GROUPS
            and 0 < in_features <= C_INT_MAX and in_features % group_size == 0
            and in_features % library.specdec_q4_block() == 0)


def q4_group(packed: Tensor, scales_minimums: Tensor) -> int:
    """The quantization group (inputs a scale serves) of a weight in `pack_q4`'s layout."""
    return Q4_BLOCK * packed.shape[1] // max(1, scales_minimums.shape[1])


def pack_q4(q: Tensor, scales: Tensor, minimums: Tensor) -> tuple[Tensor, Tensor]:
    """q (N, K) in 0..15, scales and minimums (N, K / group), a group of 32 or 64 inputs (w = scale q + minimum) ->
    the kernel's layout (gemm.c):
    the rows in groups of `Q4_ROWS` (the last padded with zero rows), (groups, K / 32, 256) uint8, each block of a
    group four 64-byte vectors whose four bytes at lane l hold row l's inputs 8v..8v+3 of the block (low nibbles)
    and 8v+4..8v+7 (high ones); and (groups, K / group, 2, Q4_ROWS) float16, the row group's scales of each
    quantization group, then its minimums."""
    _check_q4_values(q, scales, minimums)
    n, k = q.shape
    groups, blocks = -(-n // Q4_ROWS), k // Q4_BLOCK
    padded = q.new_zeros(groups * Q4_ROWS, k, dtype=torch.uint8)
    padded[:n] = q
    nibbles = padded.reshape(groups, Q4_ROWS, blocks, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)  # g, b, v, lane, i, half
    packed = (nibbles[..., 0] | (nibbles[..., 1] << 4)).reshape(groups, blocks, Q4_ROWS * Q4_BLOCK // 2).contiguous()

    def by_group(values: Tensor) -> Tensor:  # (N, K / group) -> (groups, K / group, Q4_ROWS)
        whole = values.new_zeros(groups * Q4_ROWS, values.shape[1])
        whole[:n] = values
        return whole.reshape(groups, Q4_ROWS, values.shape[1]).transpose(1, 2)

    return packed, torch.stack([by_group(scales), by_group(minimums)], dim=2).to(torch.float16).contiguous()


def _check_q4_values(q: Tensor, scales: Tensor, minimums: Tensor) -> None:
    """`pack_q4`'s arguments: q (N, K) of whole values 0..15, K a multiple of 32, scales and minimums (N, K / 32 or
    K / 64) floats."""
    q, scales, minimums = _tensor(q, "q"), _tensor(scales, "scales"), _tensor(minimums, "minimums")
    _shape(q, "q", (None, None))
    n, k = q.shape
    if k == 0 or k % Q4_BLOCK:
        raise ValueError(f"q's input width must be a positive multiple of {Q4_BLOCK}, got {k}")
    _shape(scales, "scales", (n, None))
    if scales.shape[1] == 0 or k % scales.shape[1] or k // scales.shape[1] not in Q4_GROUPS:
        raise ValueError(f"scales must have one column per group of {' or '.join(map(str, Q4_GROUPS))} inputs "
                         f"({k} inputs), got {scales.shape[1]} columns")
    _shape(minimums, "minimums", tuple(scales.shape))
    _dtype(scales, "scales", (torch.float32, torch.bfloat16, torch.float16, torch.float64))
    _dtype(minimums, "minimums", (torch.float32, torch.bfloat16, torch.float16, torch.float64))
    if q.numel():
        low, high = torch.aminmax(q)
        if not (low >= 0 and high <= 15) or (q.is_floating_point() and not torch.equal(q, q.round())):
            raise ValueError(f"q must hold whole values in 0..15, got values in {low.item()}..{high.item()}")


def _check_q4_weight(packed: Tensor, scales_minimums: Tensor, out_features: int) -> int:
    """A weight in `pack_q4`'s layout with at least `out_features` rows -> its input width K; else a ValueError."""
    packed, scales_minimums = _tensor(packed, "packed"), _tensor(scales_minimums, "scales_minimums")
    _dtype(packed, "packed", (torch.uint8,))
    _dtype(scales_minimums, "scales_minimums", (torch.float16,))
    _shape(packed, "packed", (None, None, Q4_ROWS * Q4_BLOCK // 2))
    groups, blocks = packed.shape[:2]
    _shape(scales_minimums, "scales_minimums", (groups, None, 2, Q4_ROWS))
    if scales_minimums.shape[1] == 0 or blocks % scales_minimums.shape[1] or \
            q4_group(packed, scales_minimums) not in Q4_GROUPS:
        raise ValueError(f"scales_minimums holds {scales_minimums.shape[1]} groups for {blocks} blocks of "
                         f"{Q4_BLOCK} inputs: a group of {' or '.join(map(str, Q4_GROUPS))} inputs expected")
    if not packed.is_contiguous() or not scales_minimums.is_contiguous():
        raise ValueError("packed and scales_minimums must be contiguous (pack_q4's layout), got strides "
                         f"{packed.stride()} and {scales_minimums.stride()}")
    if not 0 < out_features <= groups * Q4_ROWS:
        raise ValueError(f"out_features = {out_features}: the packed weight holds 1 to {groups * Q4_ROWS} rows")
    _c_int(blocks * Q4_BLOCK, "the input width")
    return blocks * Q4_BLOCK


def dequantize_q4(packed: Tensor, scales_minimums: Tensor, out_features: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """The (out_features, K) weight `pack_q4`'s layout holds, in `dtype` (float32 or bfloat16)."""
    in_features = _check_q4_weight(packed, scales_minimums, out_features)
    if dtype not in READABLE:
        raise TypeError(f"dtype must be float32 or bfloat16, got {dtype}")
    library = _loaded()
    if library is None or library.specdec_q4_block() == 0:
        raise ValueError(f"the 4-bit kernel does not run here: {unavailable() or 'built without it for this CPU'}")
    weight = torch.empty(out_features, in_features, dtype=dtype)
    status = library.specdec_dequantize_q4(packed.data_ptr(), scales_minimums.data_ptr(), weight.data_ptr(),
                                           out_features, in_features, q4_group(packed, scales_minimums),
                                           int(dtype == torch.bfloat16), torch.get_num_threads())
    _status(status, "gemm.c's 4-bit dequantization", f"a ({out_features}, {in_features}) weight in {dtype}")
    return weight


def gemm_q4(x: Tensor, packed: Tensor, scales_minimums: Tensor, out_features: int, bias: Tensor | None = None) -> Tensor:
    """x (rows, K) times the 4-bit weight `pack_q4` made, plus `bias` (out_features,) -> (rows, out_features) in x's
    dtype: up to MAX_ROWS rows by the kernel (float32 or bfloat16 rows as they come, others in float32; the bias
    added in float32), a prompt's more rows by the weight dequantized (by the kernel's library, in a few
    milliseconds) and torch's GEMM, in bfloat16 where this CPU computes in it (AMX's GEMMs), else float32."""
    in_features = _check_q4_weight(packed, scales_minimums, out_features)
    _dtype(_tensor(x, "x"), "x", (torch.float32, torch.bfloat16, torch.float16, torch.float64))
    _shape(x, "x", (None, in_features))
    if bias is not None:
        _dtype(_tensor(bias, "bias"), "bias", (torch.float32, torch.bfloat16, torch.float16, torch.float64))
        _shape(bias, "bias", (out_features,))
    if x.dtype not in READABLE:
        return gemm_q4(x.float(), packed, scales_minimums, out_features, bias).to(x.dtype)
    if x.shape[0] == 0:
        return x.new_empty(0, out_features)
    if x.shape[0] > MAX_ROWS:
        dtype = torch.bfloat16 if bfloat16_arithmetic() else torch.float32
        y = F.linear(x.to(dtype), dequantize_q4(packed, scales_minimums, out_features, dtype)).to(x.dtype)
        return y if bias is None else y + bias.to(x.dtype)
    library = _loaded()
    if library is None or library.specdec_q4_block() == 0 or in_features % library.specdec_q4_block():
        raise ValueError(f"the 4-bit kernel cannot multiply x {tuple(x.shape)}: "
                         f"{unavailable() or 'an input width it does not take, or no 4-bit kernel for this CPU'}")
    x = x.contiguous()
    bias = None if bias is None else bias.to(x.dtype).contiguous()
    out = torch.empty(x.shape[0], out_features, dtype=x.dtype)
    status = library.specdec_gemm_q4(
        packed.data_ptr(), scales_minimums.data_ptr(), x.data_ptr(), None if bias is None else bias.data_ptr(),
        out.data_ptr(), x.shape[0], out_features, in_features, q4_group(packed, scales_minimums), _bf16(x), _bf16(x),
        torch.get_num_threads())
    _status(status, "gemm.c's 4-bit product", f"x {tuple(x.shape)} {x.dtype}, a weight of {out_features} rows "
                                              f"packed as {tuple(packed.shape)}")
    return out


# ---- a layer's operations (`layer.c`) ----


def _ops() -> ctypes.CDLL:
    """The library, for the layer operations below, else a ValueError saying why the kernels do not run here: a
    lean forward built with them (`layer_ops`) calls them without reading the environment again (three calls a
    layer)."""
    library = _library()[0]
    if library is None:
        raise ValueError(f"our layer operations do not run here: {_library()[1]}")
    return library


def layer_ops(dtype: torch.dtype, hidden: int, head_dim: int) -> bool:
    """Whether `layer.c` runs a lean forward's norms, rotary step and attention here, for a pass computing in `dtype`
    with `hidden` features and heads of `head_dim` (float32 or bfloat16; float64 keeps torch's operations)."""
    return (_loaded() is not None and dtype in READABLE and hidden % LANES == 0
            and head_dim % LANES == 0)


def _bf16(tensor: Tensor) -> int:
    return int(tensor.dtype == torch.bfloat16)


def _rms_norm(x: Tensor, delta: Tensor | None, weight: Tensor, eps: float, plus_one: bool) -> Tensor:
    """layer.c's RMSNorm of the contiguous `x`, `delta` (x's shape and dtype, contiguous) added into it first where
    given."""
    n = x.shape[-1] if x.dim() else 0
    if n == 0 or n % LANES:
        raise ValueError(f"x's last dimension must be a positive multiple of {LANES} for our RMSNorm, got "
                         f"{tuple(x.shape)}")
    _dtype(x, "x", READABLE)
    _dtype(_tensor(weight, "weight"), "weight", READABLE)
    _shape(weight, "weight", (n,))
    tokens = _c_int(x.numel() // n, "the tokens")
    weight = weight.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    status = _ops().specdec_rms_norm(x.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(),
                                     out.data_ptr(), tokens, n, eps, int(plus_one), _bf16(x), _bf16(weight),
                                     torch.get_num_threads())
    _status(status, "layer.c's RMSNorm", f"x {tuple(x.shape)} {x.dtype}, weight {weight.dtype}")
    return out


def rms_norm(x: Tensor, weight: Tensor, eps: float, *, plus_one: bool = False) -> Tensor:
    """RMSNorm over x's last dimension, the model's (`plus_one`: Gemma's, times 1 + weight in float32): `llama.py`'s
    `rms_norm` or `gemma.py`'s `gemma_norm` in one call. x float32 or bfloat16, its width a multiple of `LANES`;
    weight (width,) float32 or bfloat16."""
    return _rms_norm(_tensor(x, "x").contiguous(), None, weight, eps, plus_one)


def add_rms_norm(h: Tensor, delta: Tensor, weight: Tensor, eps: float, *, plus_one: bool = False) -> tuple[Tensor, Tensor]:
    """(h + delta, its RMSNorm) in one call: the residual addition is written into `h` (made contiguous first);
    delta of h's shape."""
    h = _tensor(h, "h").contiguous()
    _shape(_tensor(delta, "delta"), "delta", tuple(h.shape))
    _dtype(delta, "delta", (torch.float32, torch.bfloat16, torch.float16, torch.float64))
    return h, _rms_norm(h, delta.to(h.dtype).contiguous(), weight, eps, plus_one)


def check_slots(positions: Tensor, write_index: Tensor, slots: int, table: int, shape: tuple[int, int]) -> None:
    """A pass's `positions` and `write_index` (`shape`: rows, width; integers): each slot within the buffer's
    `slots`, each position within the rotary table's `table` rows, else a ValueError naming the value. `rope_write`
    checks them at each call; a lean forward once a pass (`indices_checked`)."""
    for name, index in (("positions", _tensor(positions, "positions")), ("write_index", _tensor(write_index, "write_index"))):
        if index.is_floating_point() or index.is_complex() or index.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got {index.dtype}")
        _shape(index, name, shape)
    _within(write_index, "write_index", slots, f"the buffer's {slots} slots")
    _within(positions, "positions", table, f"the rotary table's {table} positions")


def rope_write(qkv: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, write_index: Tensor, keys: Tensor,
               values: Tensor, heads: int, *, indices_checked: bool = False) -> Tensor:
    """The q/k/v product's output (rows, width, (heads + 2 kv_heads) head_dim) -> the rotated queries (rows, width,
    heads, head_dim); the rotated keys and the values are written into the buffer `keys` and `values` (rows, kv_heads,
    slots, head_dim; contiguous, qkv's dtype) at `write_index` (rows, width). cos and sin: the rotary tables
    (positions, head_dim) in qkv's dtype, taken at `positions` (rows, width). `indices_checked`: the caller checked
    positions and write_index for this buffer and table already (`check_slots`, once a pass)."""
    qkv, keys, values = _tensor(qkv, "qkv"), _tensor(keys, "keys"), _tensor(values, "values")
    _dtype(qkv, "qkv", READABLE)
    _shape(keys, "keys", (None, None, None, None))
    rows, kv_heads, slots, head_dim = keys.shape
    if head_dim % 2 or not heads > 0 or kv_heads == 0:
        raise ValueError(f"heads = {heads}, keys {tuple(keys.shape)}: at least one head of each kind, an even head size")
    _shape(qkv, "qkv", (rows, None, (heads + 2 * kv_heads) * head_dim))
    width = qkv.shape[1]
    for name, tensor in (("keys", keys), ("values", values)):
        _shape(tensor, name, (rows, kv_heads, slots, head_dim))
        _dtype(tensor, name, (qkv.dtype,))
        _written(tensor, name)
    for name, table in (("cos", _tensor(cos, "cos")), ("sin", _tensor(sin, "sin"))):
        _shape(table, name, (cos.shape[0] if cos.dim() else None, head_dim))
        _dtype(table, name, (qkv.dtype,))
    for value, name in ((rows * width, "the tokens"), (slots, "slots"), ((heads + 2 * kv_heads) * head_dim, "qkv's width")):
        _c_int(value, name)
    if not indices_checked:
        check_slots(positions, write_index, slots, cos.shape[0], (rows, width))
    qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
    positions, write_index = positions.to(torch.int64).contiguous(), write_index.to(torch.int64).contiguous()
    q = qkv.new_empty(rows, width, heads, head_dim)
    status = _ops().specdec_rope_write(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), positions.data_ptr(),
                                       write_index.data_ptr(), q.data_ptr(), keys.data_ptr(), values.data_ptr(), rows,
                                       width, heads, kv_heads, slots, head_dim, _bf16(qkv), torch.get_num_threads())
    _status(status, "layer.c's rotary step", f"qkv {tuple(qkv.shape)}, keys {tuple(keys.shape)}, write_index "
                                             f"{write_index.tolist()}, positions {positions.tolist()}")
    return q


def readable_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """`mask` as layer.c reads it: in the pass's `dtype`, its last stride 1 (no copy where it already is)."""
    return mask if mask.stride(-1) == 1 and mask.dtype == dtype else mask.to(dtype).contiguous()


def attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float, softcap: float | None) -> Tensor:
    """Attention of the queries q (rows, heads, width, head_dim; any strides but the last) over the first
    `mask.shape[-1]` slots of the buffer's keys and values (rows, kv_heads, slots, head_dim; contiguous, q's dtype),
    `mask` (rows, 1, width, used) added to the scores (the dtype's minimum hides a key) -> (rows, width, heads *
    head_dim), the output projection's input. Scores scaled by `scale`, capped at `softcap` by a tanh (Gemma 2);
    softmax and sums in float32, each query alone in one fixed order: the same bits whatever the pass's width."""
    q, keys, values, mask = (_tensor(t, name) for t, name in ((q, "q"), (keys, "keys"), (values, "values"), (mask, "mask")))
    _dtype(q, "q", READABLE)
    _shape(q, "q", (None, None, None, None))
    rows, heads, width, head_dim = q.shape
    _shape(keys, "keys", (rows, None, None, head_dim))
    kv_heads, slots = keys.shape[1:3]
    if head_dim == 0 or head_dim % LANES or kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"q {tuple(q.shape)}, keys {tuple(keys.shape)}: a head size that is a positive multiple of "
                         f"{LANES}, and query heads a multiple of the key heads")
    for name, tensor in (("keys", keys), ("values", values)):
        _shape(tensor, name, (rows, kv_heads, slots, head_dim))
        _dtype(tensor, name, (q.dtype,))
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous (the buffer's layout), got strides {tensor.stride()}")
    _shape(mask, "mask", (rows, 1, width, None))
    if mask.shape[-1] > slots:
        raise ValueError(f"mask covers {mask.shape[-1]} slots, the buffer holds {slots}")
    _dtype(mask, "mask", (torch.float32, torch.bfloat16, torch.float16, torch.float64))
    for value, name in ((rows, "rows"), (heads, "heads"), (width, "width"), (slots, "slots"), (head_dim, "head_dim")):
        _c_int(value, name)
    q = q if q.stride(-1) == 1 else q.contiguous()
    mask = readable_mask(mask, q.dtype)
    out = q.new_empty(rows, width, heads * head_dim)
    status = _ops().specdec_attention(q.data_ptr(), q.stride(0), q.stride(1), q.stride(2), keys.data_ptr(),
                                      values.data_ptr(), mask.data_ptr(), mask.stride(0), mask.stride(2),
                                      out.data_ptr(), rows, heads, kv_heads, width, mask.shape[-1], slots,
                                      head_dim, scale, softcap or 0.0, _bf16(q), torch.get_num_threads())
    _status(status, "layer.c's attention", f"q {tuple(q.shape)}, keys {tuple(keys.shape)}, mask {tuple(mask.shape)}")
    return out


def gated_mul(gate_up: Tensor, activation: str) -> Tensor:
    """act(gate) * up for gate_up (..., 2 n) = [gate | up] -> (..., n), n a multiple of `LANES`, `activation` one of
    `ACTIVATION_KINDS` (transformers' names), each step rounded to the dtype as torch's (float32 or bfloat16; silu
    x sigmoid(x), gelu torch's 0.5 x (1 + tanh(y)), both from our e^x: within a float32 ulp or a few of torch's,
    `layer.c`)."""
    gate_up = _tensor(gate_up, "gate_up")
    if activation not in ACTIVATION_KINDS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATION_KINDS)}, got {activation!r}")
    _dtype(gate_up, "gate_up", READABLE)
    width = gate_up.shape[-1] if gate_up.dim() else 0
    if width == 0 or width % (2 * LANES):
        raise ValueError(f"gate_up's last dimension must be two halves, each a positive multiple of {LANES}, got "
                         f"{tuple(gate_up.shape)}")
    gate_up = gate_up.contiguous()
    n = width // 2
    tokens = _c_int(gate_up.numel() // width, "the tokens")
    out = gate_up.new_empty(*gate_up.shape[:-1], n)
    status = _ops().specdec_gated(gate_up.data_ptr(), out.data_ptr(), tokens, n, ACTIVATION_KINDS[activation],
                                  _bf16(gate_up), torch.get_num_threads())
    _status(status, f"layer.c's {activation}", f"gate_up {tuple(gate_up.shape)} {gate_up.dtype}")
    return out


def decoder(*arguments) -> int:
    """decoder.c's `specdec_decoder` (`decoder.py` builds and checks its arguments): 0, else the failing step and its
    status."""
    return _ops().specdec_decoder(*arguments)
