"""The lean forward's linear: one GEMM over several of the Hugging Face model's linears (q/k/v, gate/up), fused
once at build time without a second copy, and the kernel for the weight's format chosen per pass.

Fusing: the fused weight is one new tensor, and the model's own `nn.Linear` weights become views into it (the
same values, the same bytes: the Hugging Face model still runs, and memory holds each weight once: the pages of a
checkpoint file the originals were read from are given back, `huge_pages.release_file_pages`). 4-bit `QuantizedLinear`s of
our kernel (a quantized target, the self-drafter) are fused alike, their packed weights and scales (groups of 16
rows side by side) and their biases: one kernel call where there were three, the bias added inside. Any other
linear (int8, torch's int4, accelerate's hooked modules) is never fused: its own module runs it.

Kernels (float weights): the one measured fastest here for the pass's row count (`kernels.py`: `F.linear`, the
weight-major product, `torch.mv`, padded or not, our own), once per weight shape and machine. Float32 activations
over bfloat16 weights (`numerics`: a CPU without bfloat16 arithmetic) take our own kernel, which reads
the weights in bfloat16 and sums in float32; a prompt's pass over more rows than it takes multiplies by the weight
converted to float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from utils import settings
from utils.lean import huge_pages, native
from utils.lean.kernels import LINEAR, NATIVE, KernelTable, apply, invariance_pays, kernel_table, prepare, q4_in_pieces, q4_product

__all__ = ["Linear", "fused", "numerics"]


def _plain(module: nn.Module) -> bool:
    return type(module) is nn.Linear and "forward" not in module.__dict__ and not hasattr(module, "_hf_hook")


class Linear:
    """y = x W^T + b over `modules` in one GEMM when they can be fused (their outputs side by side), else each
    module run in turn and concatenated. `widths`: each module's output width, to split the result (or the parts of
    one module's output, `parts`: Phi-3's fused q/k/v)."""

    def __init__(self, modules: list[nn.Module], parts: list[int] | None = None) -> None:
        if parts is not None and (len(modules) != 1 or sum(parts) != modules[0].out_features):
            raise ValueError(f"parts {parts} must split one module's {modules[0].out_features} outputs, got "
                             f"{len(modules)} modules")
        self.widths = parts or [module.out_features for module in modules]
        self.q4 = None  # the fused 4-bit weight and its scales (`native.pack_q4`'s layout), where the modules are ours
        if _our_four_bits(modules):  # their packed weights are on huge pages already (`QuantizedLinear`)
            self.q4 = ((modules[0].weight_q, modules[0].scales) if len(modules) == 1 else
                       (fused([m.weight_q for m in modules], modules, "weight_q"),
                        fused([m.scales for m in modules], modules, "scales")))
            self.bias = _fused_bias(modules)
            self.weight, self.modules, self.q4_inputs = None, None, modules[0].in_features
        elif all(_plain(module) for module in modules) and len({m.weight.dtype for m in modules}) == 1:
            self.weight = fused([module.weight for module in modules], modules, "weight")
            biases = [module.bias for module in modules]
            if all(b is None for b in biases):
                self.bias = None
            elif all(b is not None for b in biases):
                self.bias = fused(biases, modules, "bias")
            else:
                self.bias = _fused_bias(modules)
            self.modules = None
            self.kernels = None  # its shape's kernel table, at the first pass (`kernels.prepare` measures them first)
        else:
            self.weight, self.bias, self.modules = None, None, modules

    def __call__(self, x: Tensor) -> Tensor:
        """(..., in) -> (..., sum of widths), by the kernel measured fastest here for this many rows."""
        if self.modules is not None:
            outputs = [module(x) for module in self.modules]
            return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)
        rows = x.numel() // x.shape[-1]
        if self.q4 is not None:
            out = q4_product(x.reshape(rows, -1), *self.q4, sum(self.widths), self.bias)
            return out.reshape(*x.shape[:-1], out.shape[-1])
        if x.dtype != self.weight.dtype:
            return self._mixed(x, rows)
        kernel = self._table()(rows)
        if kernel == LINEAR:
            return F.linear(x, self.weight, self.bias)
        out = apply(kernel, x.reshape(rows, -1), self.weight, self.bias)
        return out.reshape(*x.shape[:-1], self.weight.shape[0])

    def _mixed(self, x: Tensor, rows: int) -> Tensor:
        """x W^T + b for rows in another dtype than the weight's, in x's dtype: float32 rows over bfloat16 weights
        (`numerics`: a CPU without bfloat16 arithmetic) by our kernel, which reads the weights in bfloat16 and sums in
        float32; any other pair (a prompt's more rows, a float32 head over bfloat16 rows) by torch's product in the
        wider of the two dtypes, the weight never read as another dtype."""
        if self._ours_for(rows, x.dtype):
            out = native.gemm(x.reshape(rows, -1), self.weight, self.bias)
            return out.reshape(*x.shape[:-1], self.weight.shape[0])
        wide = torch.promote_types(x.dtype, self.weight.dtype)
        bias = None if self.bias is None else self.bias.to(wide)
        return F.linear(x.to(wide), self.weight.to(wide), bias).to(x.dtype)

    def _ours_for(self, rows: int, dtype: torch.dtype) -> bool:
        """Whether `_mixed` takes our bfloat16 kernel for `rows` rows of `dtype`."""
        return (dtype == torch.float32 and self.weight.dtype == torch.bfloat16 and rows <= native.MAX_ROWS
                and native.supports(tuple(self.weight.shape), self.weight.dtype))

    def ours_at(self, rows: int, dtype: torch.dtype) -> bool:
        """Whether `__call__` multiplies `rows` rows of `dtype` by one of our own kernels (`native.gemm`,
        `native.gemm_q4`): what `decoder.py` needs of every linear to run a pass's layers in one call."""
        if self.modules is not None or rows > native.MAX_ROWS:
            return False
        if self.q4 is not None:
            return True
        if dtype != self.weight.dtype:
            return self._ours_for(rows, dtype)
        return self._table()(rows) == NATIVE

    def describe(self, rows: int, dtype: torch.dtype) -> str:
        """Which kernel `__call__` takes for `rows` rows of `dtype`, in a few words (`plan.py`)."""
        if self.modules is not None:
            return f"its own module ({type(self.modules[0]).__name__})"
        if self.q4 is not None:
            if rows <= native.MAX_ROWS:
                return "ours, 4-bit"
            return (f"ours, 4-bit, {native.MAX_ROWS} rows a call" if q4_in_pieces(self.q4_inputs, dtype)
                    else "4-bit dequantized, torch's GEMM")
        if dtype != self.weight.dtype:
            wide = str(torch.promote_types(dtype, self.weight.dtype)).removeprefix("torch.")
            return "ours, float32 rows over bfloat16" if self._ours_for(rows, dtype) else f"torch's F.linear in {wide}"
        name, pad = self._table()(rows)
        return {"native": "ours", "linear": "torch's F.linear", "mv": "torch.mv",
                "weight_major": "torch's weight-major product" + (f", padded to {pad} rows" if pad else "")}[name]

    def _table(self) -> KernelTable:
        """This weight shape's kernel table (`kernels.py`), looked up at the first pass (`numerics` measured it)."""
        if self.kernels is None:
            self.kernels = kernel_table(tuple(self.weight.shape), self.weight.dtype, self.weight.device.type)
        return self.kernels

    def split(self, y: Tensor) -> list[Tensor]:
        return list(y.split(self.widths, dim=-1))


def _our_four_bits(modules: list[nn.Module]) -> bool:
    """Whether `modules` are 4-bit linears of our kernel that fuse: one input width and quantization group, and each
    but the last a whole number of the layout's groups of rows."""
    return (all(getattr(m, "kernel", None) == "native" and getattr(m, "bits", None) == 4 for m in modules)
            and len({(m.in_features, m.group_size) for m in modules}) == 1
            and all(m.out_features % native.Q4_ROWS == 0 for m in modules[:-1]))


def _fused_bias(modules: list[nn.Module]) -> Tensor | None:
    """The modules' biases side by side (zeros for a module without one; a small vector, a copy), None if none has
    one."""
    if all(m.bias is None for m in modules):
        return None
    like = next(m.bias for m in modules if m.bias is not None)
    return torch.cat([m.bias.detach() if m.bias is not None else like.new_zeros(m.out_features) for m in modules])


def fused(tensors: list[Tensor], modules: list[nn.Module], name: str) -> Tensor:
    """`tensors` (each module's parameter `name`) concatenated on dim 0 into one tensor in memory advised for huge
    pages (`huge_pages.py`), each module's parameter then a view into it: one copy in memory, the model's own modules
    unchanged in value (a buffer stays a buffer). One tensor is moved there alone where huge pages can back it (its
    parameter's data swapped, so that a tied head and embedding stay one parameter), else kept as it is, made
    contiguous the same way where it is not (the kernels take data pointers)."""
    if len(tensors) == 1:
        tensor, old = tensors[0], tensors[0].detach()
        moved = huge_pages.on_huge_pages(old)  # the file's pages it was read from given back
        if not moved.is_contiguous():  # our kernels read a weight row by row (a column-major one: the same values)
            moved = moved.contiguous()
        if moved is not old:
            tensor.data = moved
        return tensor.detach()
    rows = sum(t.shape[0] for t in tensors)
    whole = huge_pages.advised_empty((rows, *tensors[0].shape[1:]), tensors[0].dtype, tensors[0].device)
    torch.cat([t.detach() for t in tensors], out=whole)
    huge_pages.release_file_pages(tensors)
    start = 0
    for tensor, module in zip(tensors, modules, strict=True):
        end = start + tensor.shape[0]
        view = whole[start:end]
        setattr(module, name, view if name in module._buffers else nn.Parameter(view, requires_grad=False))
        start = end
    return whole


def _takes_float32(linear: Linear) -> bool:
    """Whether `linear` multiplies float32 rows over weights held in bfloat16 or fewer bits: our bfloat16 kernel, our
    4-bit one, or a quantized module that converts its rows (`utils.quantize.QuantizedLinear`)."""
    if linear.q4 is not None:
        return True
    if linear.weight is not None:
        return native.supports(tuple(linear.weight.shape), linear.weight.dtype)
    return all(getattr(module, "bits", None) in (4, 8) and hasattr(module, "compute") for module in linear.modules)


def _computed_dtype(linears: list[Linear], own: torch.dtype) -> torch.dtype:
    """float32 over bfloat16 weights (`own`) where this CPU has no bfloat16 arithmetic, our kernels run and every
    linear takes float32 rows, else `own`. Decided by the model's dtype, the CPU and our kernels, not by its
    weights' format, so that a self-drafter (4-bit linears, ours or torch's) computes in its target's dtype: it
    writes into the target's buffer (`SharedCacheRunner`)."""
    if (own == torch.bfloat16 and not native.bfloat16_arithmetic() and native.unavailable() is None
            and all(map(_takes_float32, linears))):
        return torch.float32
    return own


def numerics(linears: list[Linear], dtype: torch.dtype, counts: list[int] | None = None) -> tuple[torch.dtype, bool]:
    """(the dtype a lean forward computes in, whether its passes are width-invariant) for a model whose layers
    have `linears` (one layer's and the head: every layer has the same shapes), each `counts` times in a pass (1
    each when not given), and whose norms are in `dtype`.

    The dtype: the weights', or float32 over bfloat16 weights on a CPU without bfloat16 arithmetic
    (our kernels alone, invariant by construction). Otherwise the kernel tables of these
    shapes are measured now (`kernels.prepare`, once per machine) and invariance is priced over the whole pass:
    the invariant kernels' seconds over the fastest ones' for all its linears, averaged over the row buckets; at
    most `kernels.INVARIANCE_PAYS` (`kernels.invariance_pays`), every table takes its invariant family: one small
    matrix dearer by 20% is not a dearer pass (docs/results.md, tenth round).
    Never in float64 (it rounds far below any tie), nor with `SPECDEC_WIDTH_INVARIANT=0`; with `=1` at any price."""
    weights = [linear.weight for linear in linears if linear.weight is not None]
    computed = _computed_dtype(linears, weights[0].dtype if weights else dtype)
    if settings.current().width_invariant is False or computed == torch.float64:
        return computed, False
    if computed != (weights[0].dtype if weights else dtype):
        return computed, True
    prepare(weights)
    tables = [kernel_table(tuple(w.shape), w.dtype, w.device.type) for w in weights]
    counts = counts or [1] * len(linears)
    counts = [count for linear, count in zip(linears, counts, strict=True) if linear.weight is not None]
    invariant = invariance_pays(tables, counts)
    for table in tables:  # tables are shared by shape: a model with the same shapes decides the same
        table.take(invariant)
    return computed, invariant
