"""Which implementation runs each step of a lean forward's pass, by the pass's width: one table read from the
decisions the forward made when it was built (the kernel tables measured here, `kernels.py`; what our kernels take,
`native.py`, `layer_ops.py`; whether every layer runs in one native call, `decoder.py`; the model's attention), so
that a reader sees in one place what `llama.py`, `linear.py` and `decoder.py` choose between.

    plan(lean)   [(width, {step: implementation})] for passes of 1, 2, 4, 8, 16 and 32 tokens and a prompt's wider one
"""

from __future__ import annotations

from utils.lean import native

__all__ = ["WIDTHS", "plan"]

WIDTHS = (1, 2, 4, 8, 16, native.MAX_ROWS, native.MAX_ROWS + 1)  # the kernel tables' buckets, then a prompt's pass
LINEARS = ("q/k/v", "o", "gate/up", "down")


def plan(lean) -> list[tuple[str, dict[str, str]]]:
    """Each width's steps and what runs them, for the lean forward `lean` (a `llama.LeanLlama`)."""
    caps = lean.spec.softcap is not None
    rows = []
    for width in WIDTHS:
        steps = {"layers": ("one native call (decoder.c)" if lean.stack is not None and lean.stack.runs(width)
                            else "Python, a call a step"),
                 "norms, rotary step": "ours (norm.c, rope.c)" if lean.native else "torch's eager steps",
                 "attention": _attention(lean, width, caps)}
        for name, linear in zip(LINEARS, lean.layers[0].linears, strict=True):
            steps[name] = linear.describe(width, lean.dtype)
        steps["head"] = lean.head.describe(width, lean._head_dtype)
        rows.append((str(width) if width <= native.MAX_ROWS else f"{width}+ (a prompt)", steps))
    return rows


def _attention(lean, width: int, caps: bool) -> str:
    if lean.native and width <= native.MAX_ROWS:
        return "ours (attention.c: each query alone)"
    if lean.eager or caps:
        return "the model's eager attention"
    return "torch's SDPA" + (", queries padded to 16 (width-invariant)" if lean.invariant and not lean.native else "")
