"""Cheaper CPU forward passes over a few new tokens: what can make verifying a draft nearly free.

Verifying k drafts feeds 1 + k tokens to the target at once. On this kind of machine (CPU, float32,
MKL) transformers' code path makes that pass cost much more than the one-token pass of plain
decoding, for two reasons that have nothing to do with the arithmetic:

1. `nn.Linear` over a handful of rows: MKL's sgemm for x @ W.T streams the weight matrix once per
   row. Computing (W @ x.T).T streams it once. The result must be made contiguous again: a strided
   query would push the attention below off the flash kernel onto the slow "math" kernel. A single
   row is computed as two (the same row twice): on some CPUs the matrix-vector kernel streams the
   weights from memory at less than half the speed of the matrix-matrix one (AMD EPYC: a one-token
   pass of SmolLM2-135M spent 53 ms in its linears, a two-token pass 22 ms).
2. Grouped-query attention with a mask (every pass over more than one new token has one):
   transformers copies the keys and values of the whole cache, in every layer, to repeat them per
   head, unless `TRANSFORMERS_SDPA_FORCE_GQA=1` (read at each call by recent releases, 5.24 here;
   older ones ignore it and stay correct, only slower). On CPU, torch's flash kernel takes
   `enable_gqa` with a mask and returns bitwise the same output.

Measured on SmolLM2-135M (2 cores, `python -m benchmarks.draft_cost`): a pass over 2 tokens cost
1.53x a one-token pass at 200 positions of context and 1.86x at 1000; with both it costs 1.05x and
1.06x. Results are the same products up to the dtype's rounding: ~1e-6 relative in float32, ~1e-2 in
bfloat16 and float16 (there a greedy speculative output can part from plain decoding's at a near-tie,
as in docs/real_models.md).

Those figures are one CPU's. On another (a Xeon with AVX-512 and AMX) the few-row linear made a
pass over 2 tokens 1.7x *dearer* than transformers' own path in float32 while the GQA change still
helped; on a third (AMD EPYC, AVX-512) it made a pass over 2 tokens cheaper than transformers' one-token
pass. In bfloat16 on that Xeon (one 8960 x 1536 matrix, 1 to 16 rows) `F.linear` took 1.45-1.52 ms at
every row count and the weight-major product 1.02-1.10 ms (a single row computed as two): 26 GB/s, the
machine's copy bandwidth. So neither is switched on by default, in any dtype but float64:
`utils/calibration.py` times every combination for each number
of new tokens on the machine in use and picks the fastest (`Shortcuts`), and the runner asks for
that choice at each pass.

Both changes are scoped: `FewTokenPass(model)` is a context manager entered around one forward pass
with the chosen `Shortcuts`; it gives the model's own `nn.Linear` modules an instance-level
`forward` and/or sets the variable, and takes both back on exit, even on error. Modules that
already have an instance-level `forward` (accelerate's dispatch hooks) are left alone.
"""

from __future__ import annotations

import os
import types
from typing import NamedTuple

import torch
from torch import Tensor, nn

__all__ = ["FewTokenPass", "Shortcuts", "available_shortcuts"]

MAX_ROWS = 32  # beyond this, MKL's own blocking is as good
_GQA_VARIABLE = "TRANSFORMERS_SDPA_FORCE_GQA"


class Shortcuts(NamedTuple):
    """Which CPU shortcuts a pass uses; the default, none, is transformers' own code path."""

    few_row_linear: bool = False
    gqa_without_repeat: bool = False


SHORTCUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # float64: kept on transformers' path (exact tests)


def _cpu_linears(model: nn.Module) -> list[nn.Linear]:
    return [module for module in model.modules()
            if type(module) is nn.Linear and module.weight.dtype in SHORTCUT_DTYPES and module.weight.device.type == "cpu"]


def _on_cpu(model: nn.Module) -> bool:
    return next(model.parameters()).device.type == "cpu"


def available_shortcuts(model: nn.Module) -> list[Shortcuts]:
    """Every combination of the shortcuts that can change anything for `model` (none first)."""
    if not _on_cpu(model):
        return [Shortcuts()]  # GPU kernels have neither problem
    linear = [False, True] if _cpu_linears(model) else [False]
    return [Shortcuts(a, b) for a in linear for b in (False, True)]


def _few_row_linear(self: nn.Linear, x: Tensor) -> Tensor:
    rows = x.numel() // x.shape[-1]
    if rows > MAX_ROWS:
        return nn.Linear.forward(self, x)
    flat = x.reshape(rows, -1)
    if rows == 1:  # as two rows: the matrix-vector kernel may stream the weights far below memory speed
        flat = torch.cat([flat, flat])
    out = (self.weight @ flat.T)[:, :rows].T.contiguous()
    if self.bias is not None:
        out += self.bias
    return out.reshape(*x.shape[:-1], self.weight.shape[0])


class FewTokenPass:
    """Context manager: the chosen CPU shortcuts for one forward pass of `model` over 1..32 new tokens.

        passes = FewTokenPass(model)
        with passes.using(Shortcuts(few_row_linear=True, gqa_without_repeat=True)):
            model(...)

    A no-op for a model that is not on the CPU.
    """

    def __init__(self, model: nn.Module) -> None:
        self._on_cpu = _on_cpu(model)
        self._forwards = [(module, types.MethodType(_few_row_linear, module)) for module in _cpu_linears(model)]
        self._choice = Shortcuts()
        self._patched: list[nn.Module] = []
        self._saved_variable: str | None = None

    def using(self, choice: Shortcuts) -> FewTokenPass:
        self._choice = choice
        return self

    def __enter__(self) -> FewTokenPass:
        if not self._on_cpu:
            return self
        if self._choice.few_row_linear:
            for module, forward in self._forwards:
                if "forward" not in module.__dict__:
                    module.__dict__["forward"] = forward
                    self._patched.append(module)
        if self._choice.gqa_without_repeat:
            self._saved_variable = os.environ.get(_GQA_VARIABLE)
            os.environ[_GQA_VARIABLE] = "1"
        return self

    def __exit__(self, *exc_info) -> None:
        if not self._on_cpu:
            return
        for module in self._patched:
            del module.__dict__["forward"]
        self._patched = []
        if self._choice.gqa_without_repeat:
            if self._saved_variable is None:
                os.environ.pop(_GQA_VARIABLE, None)
            else:
                os.environ[_GQA_VARIABLE] = self._saved_variable
        self._choice = Shortcuts()
