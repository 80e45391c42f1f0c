"""The GEMM kernel each pass width takes on this machine: measured once per weight shape, dtype and machine (a
second or two, over more bytes than the caches hold), kept under `SPECDEC_CACHE/kernels`.

Why measure: which product streams a weight matrix fastest for a few rows differs by CPU and dtype, by 2x.
Measured on a Xeon with AMX (2 threads, bfloat16, 40 matrices of 8960 x 1536 in turn, GB/s of weights read):
`F.linear` at one row 11.3, at eight 16.9; the weight-major product `W @ x.T` at one row 18.3, at two 21.8, at four
23.6, at eight 17.5, at sixteen 22.6; `torch.mv` at one row 24.9 (a `sum` reads 30). So a row count may run
fastest padded to another, and the choice is a table, not a rule.

Kernels, for x (rows, in) and W (out, in):
    ("linear", 0)        F.linear(x, W, b)
    ("mv", 0)            torch.mv(W, x[0]): one row
    ("weight_major", p)  (W @ x.T).T with x padded by zero rows to p rows (0: not padded)
A float64 weight always takes F.linear: the exact tests compare it with the Hugging Face model's own.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from utils.paths import cache_dir

__all__ = ["BUCKETS", "Kernel", "KernelTable", "apply", "kernel_table", "prepare"]

BUCKETS = (1, 2, 4, 8, 16, 32)  # rows r take the table's entry for the smallest bucket >= r; past 32, F.linear
PROBE_BYTES = 1 << 29  # matrices timed in turn: beyond the caches, so that the weights come from memory
REPEATS = 2
Kernel = tuple[str, int]
LINEAR: Kernel = ("linear", 0)


def apply(kernel: Kernel, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """y = x W^T + b, (rows, out), by `kernel`."""
    name, pad = kernel
    if name == "linear":
        return F.linear(x, weight, bias)
    rows = x.shape[0]
    if name == "mv":
        out = torch.mv(weight, x[0])[None]
    else:
        if pad > rows:
            x = torch.cat([x, x.new_zeros(pad - rows, x.shape[1])])
        out = (weight @ x.T)[:, :rows].T.contiguous()
    return out if bias is None else out + bias


def _candidates(bucket: int) -> list[Kernel]:
    pads = sorted({p for p in (bucket, 2 * bucket, 16, 32) if bucket <= p <= 32} - {bucket}) if bucket > 1 else [2]
    return [LINEAR, ("weight_major", 0), *(("weight_major", p) for p in pads), *([("mv", 0)] if bucket == 1 else [])]


def _measure(shape: tuple[int, int], dtype: torch.dtype, device: str) -> dict[int, Kernel]:
    count = max(1, min(64, PROBE_BYTES // (shape[0] * shape[1] * torch.finfo(dtype).bits // 8)))
    weights = [torch.randn(shape, device=device).to(dtype) for _ in range(count)]
    table = {}
    for bucket in BUCKETS:
        x = torch.randn(bucket, shape[1], device=device).to(dtype)
        seconds = {}
        for kernel in _candidates(bucket):
            best = float("inf")
            for _ in range(REPEATS + 1):
                start = time.perf_counter()
                for weight in weights:
                    apply(kernel, x, weight, None)
                best = min(best, time.perf_counter() - start)
            seconds[kernel] = best
        table[bucket] = min(seconds, key=seconds.get)
    return table


class KernelTable:
    """The kernel for each row count of one weight shape and dtype."""

    def __init__(self, by_bucket: dict[int, Kernel]) -> None:
        self._by_rows = [LINEAR] + [by_bucket[next(b for b in BUCKETS if b >= rows)] for rows in range(1, BUCKETS[-1] + 1)]

    def __call__(self, rows: int) -> Kernel:
        return self._by_rows[rows] if rows < len(self._by_rows) else LINEAR


@cache
def kernel_table(shape: tuple[int, int], dtype: torch.dtype, device: str = "cpu") -> KernelTable:
    """The measured table for weights of `shape` (out, in) in `dtype` here: from this process, from the disk
    cache, or measured now."""
    if dtype == torch.float64 or device != "cpu":
        return KernelTable(dict.fromkeys(BUCKETS, LINEAR))
    key = {"shape": list(shape), "dtype": str(dtype), "threads": torch.get_num_threads(), "torch": torch.__version__,
           "cpu": torch.backends.cpu.get_cpu_capability(), "code": hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12],
           "machine": _cpu_name()}
    path = cache_dir() / "kernels" / (hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20] + ".json")
    try:
        stored = json.loads(path.read_text())
        return KernelTable({int(b): tuple(k) for b, k in stored.items()})
    except (OSError, ValueError, TypeError):
        pass
    table = _measure(shape, dtype, device)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps({str(b): list(k) for b, k in table.items()}))
    partial.replace(path)
    return KernelTable(table)


def prepare(weights: list[Tensor]) -> None:
    """Measure the tables of `weights`' shapes not measured yet, with a progress bar on stderr (seconds, once per
    machine and model shape; `SPECDEC_PROGRESS=0` hides it)."""
    wanted = sorted({(tuple(w.shape), w.dtype, w.device.type) for w in weights}, key=str)
    bar = tqdm(wanted, desc="Choosing GEMM kernels here (once)", unit="shape", leave=False, file=sys.stderr,
               disable=os.environ.get("SPECDEC_PROGRESS") == "0" or all(w[1] == torch.float64 for w in wanted))
    for shape, dtype, device in bar:
        kernel_table(shape, dtype, device)


def _cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
    except OSError:
        return ""
