"""A pass's freed memory kept for the next pass (glibc's malloc), instead of given back to the system and faulted in
again page by page.

Why: glibc hands an allocation over its mmap threshold (128 KB at first, raised as such blocks are freed, to 32 MB at
most) a mapping of its own, unmapped when freed, and gives the heap's free top back past a trim threshold (twice that).
A pass's large tensors (a prompt's activations, the self-drafter's and the sampling steps' vocabulary-wide rows) were
then new pages at every pass, each 4 KB page a fault: on a 2-vCPU AMD EPYC Zen 4 the 1.5B's prompt pass over 1,000
tokens faulted 320,000-340,000 times (1.3 GB), and a 64-token generation of the self-drafter sampling after a
Spec-Bench prompt 330,000 times. So the first generation in a process (`keep_freed_memory`) has glibc map no block
apart (`M_MMAP_MAX` 0: every block from the heap; a thread's arena still maps what its heaps cannot hold) and keep up to
`TRIM_THRESHOLD` of the heap's free top, reused by the next pass: there the same runs faulted 20,000-70,000 and
0-21,000 times, the first token came 1.05-1.12x sooner and the self-drafter's generations took 0.92x the time, at the
same peak resident memory and 0.26 GB more resident after a generation (processes alternated; raising the mmap
threshold to its 32 MB instead left most faults: docs/results.md, thirty-first round). The process keeps what its
largest pass freed, up to `TRIM_THRESHOLD`, between generations; `SPECDEC_KEEP_MEMORY=0` leaves glibc's own rules.
Elsewhere than glibc (macOS, musl) nothing changes.
"""

from __future__ import annotations

import ctypes
import platform

from utils import settings

__all__ = ["KEEP_MEMORY_ENV", "TRIM_THRESHOLD", "keep_freed_memory"]

KEEP_MEMORY_ENV = settings.KEEP_MEMORY_ENV
TRIM_THRESHOLD = 1 << 30  # the heap's free top kept, at most (a prompt pass's activations over thousands of tokens)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # malloc.h's parameter numbers

_kept: bool | None = None  # whether this process keeps it (None: not asked yet)


def keep_freed_memory() -> bool:
    """Have glibc keep a pass's freed memory, once a process (not under `SPECDEC_KEEP_MEMORY=0`) -> whether it does (a
    later `SPECDEC_KEEP_MEMORY=0` does not undo it)."""
    global _kept
    if _kept is None and settings.current().keep_memory:
        _kept = _keep()
    return bool(_kept)


def _keep() -> bool:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    no_block_mapped = mallopt(_M_MMAP_MAX, 0)  # each call 1 where glibc took the value
    top_kept = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    return bool(no_block_mapped and top_kept)
