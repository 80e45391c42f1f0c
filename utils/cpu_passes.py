"""Cheaper CPU forward passes over a few new tokens: what makes verifying a draft nearly free.

Verifying k drafts feeds 1 + k tokens to the target at once. On this kind of machine (CPU, float32,
MKL) transformers' code path makes that pass cost much more than the one-token pass of plain
decoding, for two reasons that have nothing to do with the arithmetic:

1. `nn.Linear` over a handful of rows: MKL's sgemm for x @ W.T streams the weight matrix once per
   row. Computing (W @ x.T).T streams it once. The result must be made contiguous again: a strided
   query would push the attention below off the flash kernel onto the slow "math" kernel.
2. Grouped-query attention with a mask (every pass over more than one new token has one):
   transformers copies the keys and values of the whole cache, in every layer, to repeat them per
   head, unless `TRANSFORMERS_SDPA_FORCE_GQA=1` (read at each call by recent releases, 5.24 here;
   older ones ignore it and stay correct, only slower). On CPU, torch's flash kernel takes
   `enable_gqa` with a mask and returns bitwise the same output.

Measured on SmolLM2-135M (2 cores, `python -m benchmarks.draft_cost`): a pass over 2 tokens cost
1.53x a one-token pass at 200 positions of context and 1.86x at 1000; with both it costs 1.05x and
1.06x. The one-token pass is left untouched, so plain decoding is exactly transformers' own.
Results are the same products up to float rounding (~1e-6 relative).

Both changes are scoped: `FewTokenPass(model)` is a context manager entered around one forward pass;
it gives the model's own `nn.Linear` modules an instance-level `forward` and sets the variable, and
takes both back on exit, even on error. Modules that already have an instance-level `forward`
(accelerate's dispatch hooks) are left alone.
"""

from __future__ import annotations

import os
import types

import torch
from torch import Tensor, nn

__all__ = ["FewTokenPass"]

MAX_ROWS = 32  # beyond this, MKL's own blocking is as good
_GQA_VARIABLE = "TRANSFORMERS_SDPA_FORCE_GQA"


def _few_row_linear(self: nn.Linear, x: Tensor) -> Tensor:
    rows = x.numel() // x.shape[-1]
    if not 1 < rows <= MAX_ROWS:
        return nn.Linear.forward(self, x)
    out = (self.weight @ x.reshape(rows, -1).T).T.contiguous()
    if self.bias is not None:
        out += self.bias
    return out.reshape(*x.shape[:-1], self.weight.shape[0])


class FewTokenPass:
    """Context manager: CPU shortcuts for one forward pass of `model` over 2..32 new tokens.

    A no-op for a model that is not on the CPU (GPU kernels have neither problem).
    """

    def __init__(self, model: nn.Module) -> None:
        self._on_cpu = next(model.parameters()).device.type == "cpu"
        self._forwards = [
            (module, types.MethodType(_few_row_linear, module))
            for module in model.modules()
            if type(module) is nn.Linear and module.weight.dtype == torch.float32 and module.weight.device.type == "cpu"
        ]
        self._patched: list[nn.Module] = []
        self._saved_variable: str | None = None

    def __enter__(self) -> FewTokenPass:
        if not self._on_cpu:
            return self
        for module, forward in self._forwards:
            if "forward" not in module.__dict__:
                module.__dict__["forward"] = forward
                self._patched.append(module)
        self._saved_variable = os.environ.get(_GQA_VARIABLE)
        os.environ[_GQA_VARIABLE] = "1"
        return self

    def __exit__(self, *exc_info) -> None:
        if not self._on_cpu:
            return
        for module in self._patched:
            del module.__dict__["forward"]
        self._patched = []
        if self._saved_variable is None:
            os.environ.pop(_GQA_VARIABLE, None)
        else:
            os.environ[_GQA_VARIABLE] = self._saved_variable
