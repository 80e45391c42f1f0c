"""Which kernel takes a prompt's attention over itself here: ours (`flash.c`, `layer_ops.flash_attention`) or torch's
(`F.scaled_dot_product_attention`, is_causal), whichever ran faster on this machine for the model's heads.

    chosen(heads, kv_heads, head_dim)   True where ours runs a bfloat16 prompt's attention here: our kernels load,
                                        the heads fit it, and it was the faster, timed once per machine and shape
                                        (a prompt of `WIDTH` tokens, interleaved medians after a warm-up round,
                                        about half a second) and kept under `SPECDEC_CACHE/kernels` beside the
                                        kernel tables (`kernels.choice_path`)

Why measured, not assumed: the two kernels stand on different units. Ours sums its products with the vector unit's
bfloat16 pairs (VDPBF16PS) where the CPU has them and in float32 elsewhere; torch's may take a matrix unit (AMX) ours
does not, and on a CPU without bfloat16 arithmetic neither is fast. On a 2-vCPU AMD EPYC (Zen 4, AVX512_BF16, no
AMX) ours ran the 1.5B's heads 2.1-3.9x faster at 512 to 8,192 tokens (docs/results.md, twenty-ninth round).
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from utils.lean import kernels, layer_ops, native
from utils.paths import write_cached
from utils.timing import interleaved_medians

__all__ = ["WIDTH", "chosen"]

WIDTH = 1024  # the timed prompt's tokens: past the one-pass width, short enough to take well under a second
# flash.c's version (with the headers its steps come from): a change to them measures again
VERSION = hashlib.sha256(b"".join(Path(__file__).with_name(name).read_bytes()
                                  for name in ("flash.c", "simd.h", "fused.h"))).hexdigest()[:12]


@functools.cache
def chosen(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether ours takes a bfloat16 prompt's attention for these heads here (the module's docstring)."""
    if native.unavailable() is not None or head_dim % layer_ops.FLASH_DIMS or heads % kv_heads:
        return False
    if not 1 <= heads // kv_heads <= layer_ops.FLASH_GROUP:
        return False
    path = kernels.choice_path((heads, kv_heads, head_dim), torch.bfloat16, kind=f"prompt attention, flash.c {VERSION}")
    try:
        return bool(json.loads(path.read_text())["ours"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    ours, torch_seconds = _time(heads, kv_heads, head_dim)
    faster = ours < torch_seconds
    write_cached(path, lambda file: file.write_text(json.dumps(
        {"ours": faster, "seconds": {"ours": ours, "torch": torch_seconds}, "heads": [heads, kv_heads, head_dim]})))
    return faster


def _time(heads: int, kv_heads: int, head_dim: int) -> tuple[float, float]:
    """`chosen`'s measurement: both kernels' medians of 5 interleaved rounds after a warm-up one, in seconds."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, WIDTH, head_dim, generator=generator).bfloat16()
    keys, values = (torch.randn(1, kv_heads, WIDTH, head_dim, generator=generator).bfloat16() for _ in range(2))
    scale = head_dim ** -0.5
    seconds = interleaved_medians({
        "ours": lambda: layer_ops.flash_attention(q, keys, values, 0, scale),
        "torch": lambda: F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale,
                                                        enable_gqa=heads != kv_heads),
    }, rounds=5)
    return seconds["ours"], seconds["torch"]
