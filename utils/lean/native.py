"""Our own kernels' library and its products: GEMMs over bfloat16 and 4-bit weights (`gemm.c`), built for this CPU by
its C compiler on first use (`build.py`), called through ctypes, never used where they cannot be built (no C
compiler) or with `SPECDEC_NATIVE=0`: torch's operations run then. A layer's other operations are `layer_ops.py`'s;
every argument is checked before a pointer crosses (`boundary.py`).

    unavailable()                why the kernels cannot run here, None when they can
    library()                    the loaded library (a ValueError saying why where it is not)
    supports(shape, dtype)       whether the bfloat16 kernel can multiply a weight of `shape` (out, in) in `dtype`
    gemm(x, weight, bias)        x W^T + b, in x's dtype (float32 or bfloat16), W bfloat16: one candidate among
                                 torch's products in the kernel table (`kernels.py`), used where measured fastest;
                                 bfloat16 activations take the tile unit where there is one (`tile_unit`)
    tile_unit()                  whether this CPU's AMX multiplies bfloat16 activations here (Sapphire Rapids on)
    bfloat16_arithmetic()        whether this CPU computes in bfloat16 (else a bfloat16 model computes in float32
                                 over its bfloat16 weights: `linear.numerics`)
    supports_q4, pack_q4,        4-bit weights in groups of 32 or 64 (w = d q + m) times activations quantized to int8
    gemm_q4, dequantize_q4,      per block of 32 (llama.cpp's Q4_1 x Q8_1): integer dot products, for
    q4_group                     `utils/quantize.py`

On AMX (Intel Xeon from Sapphire Rapids) bfloat16 activations take the tile unit: 16 rows cost what one costs,
the weights' reading alone (measured against torch's products: docs/results.md, eleventh round).
Elsewhere the bfloat16 kernel multiplies in float32, so on a CPU without bfloat16 arithmetic (AVX2 only) a model held in
bfloat16 (its checkpoint's dtype, most Hub checkpoints) computes in float32 at half the bytes a float32 model
reads. Each output of either kernel is one fixed chain of operations per row, so a row's result is the same bits
whatever the number of rows (width-invariant by construction). Without vector units (another ISA, `-march=x86-64`)
the C's plain version runs, with AVX2's bits.
"""

from __future__ import annotations

import ctypes
import hashlib
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from utils import settings
from utils.lean import boundary as check
from utils.lean import build
from utils.lean.boundary import C_INT_MAX, READABLE

__all__ = ["MAX_ROWS", "NATIVE_ENV", "Q4_BLOCK", "Q4_GROUPS", "Q4_ROWS", "bf16", "bfloat16_arithmetic",
           "dequantize_q4", "gemm", "gemm_q4", "library", "pack_q4", "q4_group", "supports", "supports_q4", "tile_unit",
           "unavailable"]

# The products' sources (every gemm*.c and gemm*.h, and the bfloat16 helpers): their hash is a kernel table's, a
# quantized model's and a measured dtype's version (`GEMM_VERSION`), so a change to any of them measures again.
GEMM_FILES = tuple(sorted(path for path in Path(__file__).parent.iterdir()
                          if path.suffix in (".c", ".h") and path.name.startswith(("gemm", "bf16"))))
GEMM_VERSION = hashlib.sha256(b"".join(path.name.encode() + path.read_bytes() for path in GEMM_FILES)).hexdigest()[:12]
NATIVE_ENV = build.NATIVE_ENV  # "0": none of our kernels, torch's operations everywhere
MAX_ROWS = 32  # gemm.c's MAX_ROWS
Q4_BLOCK = 32  # gemm.c's 4-bit block: input columns quantized together (an int8 scale of the activations; a weight's
#                scale and minimum serve one block or two)
Q4_ROWS = 16  # and its weight rows laid out together (one per vector lane)
Q4_GROUPS = (32, 64)  # the quantization groups it takes: a scale and a minimum per block of 32 inputs, or per two


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
    library.specdec_rope_write_checked.argtypes = [pointer] * 3 + [i64] + [pointer] * 5 + [i32] * 9
    library.specdec_attention.argtypes = ([pointer, i64, i64, i64, pointer, pointer, pointer, i64, i64, pointer]
                                          + [i32] * 7 + [f32, f32, i32, i32])
    library.specdec_gated.argtypes = [pointer] * 2 + [i32] * 5
    library.specdec_flash_attention.argtypes = [pointer, i64, i64] + [pointer] * 3 + [i32] * 6 + [f32, i32]
    library.specdec_decoder.argtypes = [pointer] * 5 + [i32] + [pointer] * 9
    for function in (library.specdec_rms_norm, library.specdec_rope_write_checked, library.specdec_attention,
                     library.specdec_gated, library.specdec_flash_attention, library.specdec_decoder):
        function.restype = ctypes.c_int
    library.specdec_amx.restype = ctypes.c_int
    for function in (library.specdec_shape_layout, library.specdec_spec_numbers):
        function.argtypes = [pointer, i32]
        function.restype = ctypes.c_int
    return library, None


def unavailable() -> str | None:
    """Why the kernels cannot run here (no working C compiler, a cache refused, `SPECDEC_NATIVE=0`), None when they
    can."""
    if not settings.current().native:
        return f"{NATIVE_ENV}=0"
    return _library()[1]


def _loaded() -> ctypes.CDLL | None:
    """The kernels' library, None where they cannot run (`unavailable`)."""
    return None if unavailable() else _library()[0]


def library() -> ctypes.CDLL:
    """The kernels' library, else a ValueError saying why they do not run here (for callers that chose them already:
    `layer_ops.py`'s operations do not read the environment again at each call)."""
    loaded, reason = _library()
    if loaded is None:
        raise ValueError(f"our kernels do not run here: {reason}")
    return loaded


def bf16(tensor: Tensor) -> int:
    """A kernel's dtype flag for `tensor`: 1 bfloat16, 0 float32 (`boundary.READABLE`)."""
    return int(tensor.dtype == torch.bfloat16)


def supports(shape: tuple[int, int], dtype: torch.dtype) -> bool:
    """Whether the kernel can multiply a weight of `shape` (out, in) held in `dtype` here."""
    library = _loaded()
    return (library is not None and dtype == torch.bfloat16 and 0 < shape[1] <= C_INT_MAX
            and 0 < shape[0] <= C_INT_MAX and shape[1] % library.specdec_block() == 0)


# ---- the products ----


def gemm(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x W^T + b for x (rows <= MAX_ROWS, in) in float32 or bfloat16, W (out, in) bfloat16, b (out,) any float dtype
    (used in x's): the result in x's dtype, each output summed in float32 in the kernel's fixed order. Rows of
    another float dtype (float16, float64) are multiplied as float32 and returned in their own. Where the kernels do
    not run (`unavailable()`, `SPECDEC_NATIVE=0`), torch's product of the same values in float32 (other bits).
    Wrong arguments raise a TypeError or ValueError naming them; nothing else reaches the kernel."""
    x, weight = check.tensor(x, "x"), check.tensor(weight, "weight")
    check.dtype(weight, "weight", (torch.bfloat16,))
    check.dtype(x, "x", (torch.float32, torch.bfloat16, torch.float16, torch.float64))
    check.shape(x, "x", (None, weight.shape[1] if weight.dim() == 2 else None))
    check.shape(weight, "weight", (None, x.shape[1]))
    if bias is not None:
        check.dtype(check.tensor(bias, "bias"), "bias", (torch.float32, torch.bfloat16, torch.float16, torch.float64))
        check.shape(bias, "bias", (weight.shape[0],))
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
                                  out.data_ptr(), rows, out_features, in_features, bf16(x), bf16(x),
                                  torch.get_num_threads())
    check.status(status, "gemm.c's bfloat16 product", f"x {tuple(x.shape)} {x.dtype}, W {tuple(weight.shape)}")
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
    q, scales, minimums = check.tensor(q, "q"), check.tensor(scales, "scales"), check.tensor(minimums, "minimums")
    check.shape(q, "q", (None, None))
    n, k = q.shape
    if k == 0 or k % Q4_BLOCK:
        raise ValueError(f"q's input width must be a positive multiple of {Q4_BLOCK}, got {k}")
    check.shape(scales, "scales", (n, None))
    if scales.shape[1] == 0 or k % scales.shape[1] or k // scales.shape[1] not in Q4_GROUPS:
        raise ValueError(f"scales must have one column per group of {' or '.join(map(str, Q4_GROUPS))} inputs "
                         f"({k} inputs), got {scales.shape[1]} columns")
    check.shape(minimums, "minimums", tuple(scales.shape))
    check.dtype(scales, "scales", (torch.float32, torch.bfloat16, torch.float16, torch.float64))
    check.dtype(minimums, "minimums", (torch.float32, torch.bfloat16, torch.float16, torch.float64))
    if q.numel():
        low, high = torch.aminmax(q)
        if not (low >= 0 and high <= 15) or (q.is_floating_point() and not torch.equal(q, q.round())):
            raise ValueError(f"q must hold whole values in 0..15, got values in {low.item()}..{high.item()}")


def check_q4_weight(packed: Tensor, scales_minimums: Tensor, out_features: int) -> int:
    """A weight in `pack_q4`'s layout with at least `out_features` rows -> its input width K; else a ValueError."""
    packed, scales_minimums = check.tensor(packed, "packed"), check.tensor(scales_minimums, "scales_minimums")
    check.dtype(packed, "packed", (torch.uint8,))
    check.dtype(scales_minimums, "scales_minimums", (torch.float16,))
    check.shape(packed, "packed", (None, None, Q4_ROWS * Q4_BLOCK // 2))
    groups, blocks = packed.shape[:2]
    check.shape(scales_minimums, "scales_minimums", (groups, None, 2, Q4_ROWS))
    if scales_minimums.shape[1] == 0 or blocks % scales_minimums.shape[1] or \
            q4_group(packed, scales_minimums) not in Q4_GROUPS:
        raise ValueError(f"scales_minimums holds {scales_minimums.shape[1]} groups for {blocks} blocks of "
                         f"{Q4_BLOCK} inputs: a group of {' or '.join(map(str, Q4_GROUPS))} inputs expected")
    if not packed.is_contiguous() or not scales_minimums.is_contiguous():
        raise ValueError("packed and scales_minimums must be contiguous (pack_q4's layout), got strides "
                         f"{packed.stride()} and {scales_minimums.stride()}")
    if not 0 < out_features <= groups * Q4_ROWS:
        raise ValueError(f"out_features = {out_features}: the packed weight holds 1 to {groups * Q4_ROWS} rows")
    check.c_int(blocks * Q4_BLOCK, "the input width")
    return blocks * Q4_BLOCK


def dequantize_q4(packed: Tensor, scales_minimums: Tensor, out_features: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """The (out_features, K) weight `pack_q4`'s layout holds, in `dtype` (float32 or bfloat16)."""
    in_features = check_q4_weight(packed, scales_minimums, out_features)
    if dtype not in READABLE:
        raise TypeError(f"dtype must be float32 or bfloat16, got {dtype}")
    library = _loaded()
    if library is None or library.specdec_q4_block() == 0:
        raise ValueError(f"the 4-bit kernel does not run here: {unavailable() or 'built without it for this CPU'}")
    weight = torch.empty(out_features, in_features, dtype=dtype)
    status = library.specdec_dequantize_q4(packed.data_ptr(), scales_minimums.data_ptr(), weight.data_ptr(),
                                           out_features, in_features, q4_group(packed, scales_minimums),
                                           int(dtype == torch.bfloat16), torch.get_num_threads())
    check.status(status, "gemm.c's 4-bit dequantization", f"a ({out_features}, {in_features}) weight in {dtype}")
    return weight


def gemm_q4(x: Tensor, packed: Tensor, scales_minimums: Tensor, out_features: int, bias: Tensor | None = None, *,
            pieces: bool = False) -> Tensor:
    """x (rows, K) times the 4-bit weight `pack_q4` made, plus `bias` (out_features,) -> (rows, out_features) in x's
    dtype: up to MAX_ROWS rows by the kernel (float32 or bfloat16 rows as they come, others in float32; the bias
    added in float32); a prompt's more rows by the kernel in passes of MAX_ROWS rows (`pieces`: each row the bits it
    gets alone), else by the weight dequantized (by the kernel's library, in a few milliseconds) and torch's GEMM, in
    bfloat16 where this CPU computes in it (AMX's GEMMs), else float32 (`kernels.q4_in_pieces` measures which)."""
    in_features = check_q4_weight(packed, scales_minimums, out_features)
    check.dtype(check.tensor(x, "x"), "x", (torch.float32, torch.bfloat16, torch.float16, torch.float64))
    check.shape(x, "x", (None, in_features))
    if bias is not None:
        check.dtype(check.tensor(bias, "bias"), "bias", (torch.float32, torch.bfloat16, torch.float16, torch.float64))
        check.shape(bias, "bias", (out_features,))
    if x.dtype not in READABLE:
        return gemm_q4(x.float(), packed, scales_minimums, out_features, bias, pieces=pieces).to(x.dtype)
    if x.shape[0] == 0:
        return x.new_empty(0, out_features)
    if x.shape[0] > MAX_ROWS and pieces:
        return torch.cat([gemm_q4(part, packed, scales_minimums, out_features, bias) for part in x.split(MAX_ROWS)])
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
        out.data_ptr(), x.shape[0], out_features, in_features, q4_group(packed, scales_minimums), bf16(x), bf16(x),
        torch.get_num_threads())
    check.status(status, "gemm.c's 4-bit product", f"x {tuple(x.shape)} {x.dtype}, a weight of {out_features} rows "
                                              f"packed as {tuple(packed.shape)}")
    return out


