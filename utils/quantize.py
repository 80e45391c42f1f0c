"""Weight-only quantized linears with torch's own CPU kernels (gpt-fast's int8 and int4 forms).

- int8, one scale per output channel (symmetric): `torch._weight_int8pack_mm(x, w_int8, scales)`,
  w_int8 (N, K) int8, scales (N,). Any shape.
- int4 in groups of `group_size` input columns (asymmetric, gpt-fast's `get_group_qparams`):
  w = (q - 8) * scale + zero with q in 0..15, packed once by
  `torch._convert_weight_to_int4pack_for_cpu(q_int32 (N, K), 2)` and multiplied by
  `torch._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)`, scales_and_zeros
  (K / group_size, N, 2). The packing refuses N not divisible by 16; K must be a multiple of the
  group: such a layer falls back to int8.

- int4 by our own kernel where it builds here (`utils.lean.native`: groups of 32 or 64, an input width a multiple of 64):
  the same q, scales and minimums (w = scale q + minimum) in the kernel's layout, times the activations quantized
  to int8 per block of 32 (llama.cpp's Q4_1 x Q8_1): integer dot products at 0.625 bytes a weight (0.5625 in groups of
  64). torch's int4 kernel dequantizes to float32 and streams ~14 GB/s on the Xeon of docs/lean.md, ours ~19 (one
  row). A pass over more than `native.MAX_ROWS` rows (a prompt) runs it `MAX_ROWS` rows a call, or multiplies by the
  weight dequantized where that is measured faster (`kernels.q4_in_pieces`).

The kernels take bfloat16, float16 or float32 activations (not float64), on the CPU only. A layer
computes in `compute_dtype(x.dtype)` (bfloat16 and float16 kept, float32 and float64 in bfloat16: torch's CPU
kernels dequantize to float32 either way, and with float32 activations the int4 one takes a path 14x slower on an
AVX2 Zen 3, 13.3 ms against 0.95 ms for an 8960 x 1536 matrix at one row; docs/cost_model.md)
and returns its output in the input's dtype, so a float64 model stays float64 around its linears.
A weight on another device than the CPU keeps its float form (`quantized_linear` returns None).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from utils.lean import huge_pages, kernels, native

__all__ = ["QuantizedLinear", "compute_dtype", "int4_fits", "quantized_linear", "linear_weight"]

INT4_INNER_K_TILES = 2  # the packing's tile parameter (gpt-fast's default)
INT4_N_MULTIPLE = 16  # `_convert_weight_to_int4pack_for_cpu` needs N divisible by this
BITS = (4, 8)
ROWS_AT_ONCE = 8192  # rows quantized at a time (`quantize_int4_native`): a multiple of `native.Q4_ROWS`


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The activations' dtype inside a quantized layer: 16-bit floats, what the kernels are fast with."""
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


def int4_fits(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether torch's int4 CPU packing accepts an (out_features, in_features) weight in groups of `group_size`."""
    return out_features % INT4_N_MULTIPLE == 0 and in_features % group_size == 0


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """(N, K) float weight -> (int8 (N, K), scales (N,) float32): w ~ q * scale, per output channel."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-10)
    return (w / scales[:, None]).round().clamp(-128, 127).to(torch.int8), scales


def _int4_groups(weight: Tensor, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """(N, K) float weight -> q (N, K / group_size, group_size) in 0..15, scales and minimums (N, K / group_size, 1):
    w ~ q * scale + minimum per group (gpt-fast's asymmetric `get_group_qparams`)."""
    n, k = weight.shape
    groups = weight.detach().float().reshape(n, k // group_size, group_size)
    low, high = groups.amin(dim=-1, keepdim=True), groups.amax(dim=-1, keepdim=True)
    scales = ((high - low) / 15).clamp(min=1e-6)
    return ((groups - low) / scales).round().clamp(0, 15), scales, low


def quantize_int4_native(weight: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """(N, K) float weight -> our kernel's layout (`native.pack_q4`): the same q, scales and minimums as
    `quantize_int4`. Quantized `ROWS_AT_ONCE` rows at a time (whole groups of the layout: the same bytes as all at
    once): the float32 copies of a 1.5B's head took 4 GB at once, the peak of building its self-drafter."""
    parts = []
    for rows in weight.split(ROWS_AT_ONCE):
        q, scales, low = _int4_groups(rows, group_size)
        parts.append(native.pack_q4(q.reshape(rows.shape), scales[..., 0], low[..., 0]))
    if len(parts) == 1:
        return parts[0]
    return torch.cat([packed for packed, _ in parts]), torch.cat([scales for _, scales in parts])


def quantize_int4(weight: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """(N, K) float weight -> (packed int4 for the CPU kernel, scales_and_zeros (K / group_size, N, 2)
    float32): w ~ (q - 8) * scale + zero per group of `group_size` input columns (`int4_fits`)."""
    n, k = weight.shape
    q, scales, low = _int4_groups(weight, group_size)
    zeros = low + scales * 8
    packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).reshape(n, k), INT4_INNER_K_TILES)
    scales_and_zeros = torch.stack([scales.reshape(n, -1).t(), zeros.reshape(n, -1).t()], dim=-1).contiguous()
    return packed, scales_and_zeros


class QuantizedLinear(nn.Module):
    """y = x W^T + b with W held in 8 or 4 bits (`bits`); `bias` (N,) is the float layer's own,
    shared. Buffers: `weight_q` (int8 (N, K), torch's int4 packing, or our kernel's (`kernel` "native",
    `native.pack_q4`)) and `scales` ((N,), scales_and_zeros (K / group_size, N, 2), or our kernel's float16
    scales and minimums by groups of 16 rows); torch's scales in the compute dtype of `dtype`."""

    def __init__(self, bits: int, in_features: int, out_features: int, weight_q: Tensor, scales: Tensor,
                 bias: Tensor | None, *, group_size: int | None, dtype: torch.dtype, kernel: str = "torch") -> None:
        super().__init__()
        assert bits in BITS and (bits == 8 or group_size is not None) and kernel in ("torch", "native")
        self.bits, self.group_size, self.kernel = bits, group_size, kernel
        self.in_features, self.out_features = in_features, out_features
        self.compute = compute_dtype(dtype)
        self.register_buffer("weight_q", huge_pages.on_huge_pages(weight_q))  # streamed every pass (huge_pages.py)
        self.register_buffer("scales", scales if kernel == "native" else scales.to(self.compute))
        self.bias = bias

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features)
        if self.kernel == "native":  # the bias added inside
            return kernels.q4_product(rows, self.weight_q, self.scales, self.out_features, self.bias).reshape(
                *shape[:-1], self.out_features)
        rows = rows.to(self.compute)
        if self.bits == 8:
            y = torch._weight_int8pack_mm(rows, self.weight_q, self.scales)
        else:
            y = torch._weight_int4pack_mm_for_cpu(rows, self.weight_q, self.group_size, self.scales)
        y = y.to(x.dtype).reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.bits == 4 else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}{group}"


def linear_weight(module: nn.Module) -> Tensor | None:
    """The (out, in) weight of an `nn.Linear` or of transformers' `Conv1D` (GPT-2's, stored (in, out)),
    None for any other module."""
    if isinstance(module, nn.Linear):
        return module.weight
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return module.weight.t()
    return None


def quantized_linear(module: nn.Module, bits: int, group_size: int) -> QuantizedLinear | None:
    """`module` (a linear, `linear_weight`) in `bits` bits -> its `QuantizedLinear`: int4 by our kernel where it
    runs here (`native.supports_q4`), else by torch's where it takes the shape (`int4_fits`), else int8; None where
    no kernel runs (not on the CPU)."""
    weight = linear_weight(module)
    if weight is None or weight.device.type != "cpu":
        return None
    out_features, in_features = weight.shape
    bias = module.bias
    if bits == 4 and native.supports_q4(in_features, group_size):
        packed, scales = quantize_int4_native(weight, group_size)
        return QuantizedLinear(4, in_features, out_features, packed, scales, bias, group_size=group_size,
                               dtype=weight.dtype, kernel="native")
    if bits == 4 and int4_fits(out_features, in_features, group_size):
        packed, scales = quantize_int4(weight, group_size)
        return QuantizedLinear(4, in_features, out_features, packed, scales, bias, group_size=group_size,
                               dtype=weight.dtype)
    q, scales = quantize_int8(weight)
    return QuantizedLinear(8, in_features, out_features, q, scales, bias, group_size=None, dtype=weight.dtype)
