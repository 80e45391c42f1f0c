"""The checks every native entry point makes before a pointer crosses to C (`native.py`'s products, `layer_ops.py`'s
operations): a tensor on the CPU in a dtype and shape the kernel reads, written in place only where contiguous, sizes
that fit a C int, indices within what they index. A wrong reading is never a result: a wrong argument is a TypeError or
ValueError naming it, and a kernel's own refusal (its status, `specdec.h`) a ValueError naming the call's values.

Used as `from utils.lean import boundary as check`: `check.tensor(x, "x")`, `check.shape(x, "x", (None, 64))`.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["C_INT_MAX", "READABLE", "c_int", "dtype", "shape", "status", "tensor", "within", "written"]

C_INT_MAX = 2**31 - 1  # a size passed as a C int (ctypes truncates past it silently)
READABLE = (torch.float32, torch.bfloat16)  # the activations' dtypes our kernels read (`bf16` flags)


def tensor(value, name: str) -> Tensor:
    """`value`, a CPU tensor, else a TypeError/ValueError naming the argument `name`."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU for our kernels, got a tensor on {value.device}")
    return value


def dtype(tensor: Tensor, name: str, allowed: tuple[torch.dtype, ...]) -> None:
    """`tensor` in one of the `allowed` dtypes, else a TypeError naming it."""
    if tensor.dtype not in allowed:
        expected = " or ".join(str(dtype).removeprefix("torch.") for dtype in allowed)
        raise TypeError(f"{name} must be {expected} for our kernels, got {str(tensor.dtype).removeprefix('torch.')}")


def shape(tensor: Tensor, name: str, expected: tuple) -> None:
    """`tensor`'s shape is `expected` (None: any size in that dimension), else a ValueError naming it."""
    if tensor.dim() != len(expected) or any(e is not None and s != e for s, e in zip(tensor.shape, expected, strict=True)):
        wanted = "(" + ", ".join("any" if e is None else str(e) for e in expected) + ")"
        raise ValueError(f"{name} must have the shape {wanted}, got {tuple(tensor.shape)}")


def c_int(value: int, name: str) -> int:
    """`value` where it fits a C int, else a ValueError naming `name`."""
    if not 0 <= value <= C_INT_MAX:
        raise ValueError(f"{name} = {value} does not fit our kernels' C int (0 to {C_INT_MAX})")
    return value


def written(tensor: Tensor, name: str) -> None:
    """A tensor the kernel writes into: contiguous (a copy would take the writes), else a ValueError."""
    if not tensor.is_contiguous():
        raise ValueError(f"{name} is written in place by our kernel and must be contiguous, got strides "
                         f"{tensor.stride()} for the shape {tuple(tensor.shape)}")


def within(index: Tensor, name: str, end: int, what: str) -> None:
    """Every value of the integer tensor `index` in 0..end - 1, else a ValueError naming the first one outside."""
    if index.numel() == 0:
        return
    low, high = (int(bound) for bound in torch.aminmax(index))
    if low < 0 or high >= end:
        bad = index[(index < 0) | (index >= end)][0].item()
        raise ValueError(f"{name} holds {bad}, outside 0..{end - 1} ({what})")


def status(code: int, what: str, values: str) -> None:
    """A kernel's nonzero status as a ValueError naming the call's values (the C side checks its arguments too;
    `specdec.h`'s statuses: 2, no memory)."""
    if code != 0:
        raise ValueError(f"{what} failed (status {code}: arguments it refuses, or no memory): {values}")
