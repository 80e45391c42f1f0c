"""Weights in memory backed by 2 MB pages (Linux's transparent huge pages), where the kernel gives them.

A pass streams every weight once, and over 4 KB pages it also walks a page table entry every 4 KB: on the Xeon of
docs/results.md the 1.5B's one-token pass took 151.5 ms with its weights as loaded (the checkpoint file's pages and
torch's 4 KB anonymous pages), 144.3 ms copied to fresh anonymous memory and 134.9 ms in memory advised for huge
pages (`madvise(MADV_HUGEPAGE)`; the kernel's default mode on most distributions, "madvise", gives them only
there). So the lean forward's weights (`linear.py`) and the 4-bit kernel's packed weights (`utils/quantize.py`) are
placed in such memory once, when they are built: one copy each, the old one given back. Its price is paid once, at
the first pass: on that Xeon (a VM whose fresh 2 MB pages come slowly: 1.2 s for 1.5 GB, 0.26 s when recycled) the
1.5B's lean build took 4-6 s against about 1 s, and the peak resident memory rose from 3.54 to 4.00 GB (the head's
copy beside the old pages until they are given back). `SPECDEC_HUGE_PAGES=0` leaves the weights where they are.

    advised_empty(shape, dtype)   an empty tensor in memory advised for huge pages, or a plain one where that cannot
                                  help (not Linux, huge pages "never", under one huge page)
    on_huge_pages(tensor)         `tensor`'s values there (a copy), or `tensor` itself where that cannot help
"""

from __future__ import annotations

import ctypes
import os
import sys
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

from utils import settings

__all__ = ["HUGE_PAGE", "HUGE_PAGES_ENV", "advised_empty", "on_huge_pages", "release_file_pages", "thp_mode"]

HUGE_PAGE = 2 << 20  # x86-64's and arm64's (4 KB base pages) transparent huge page
HUGE_PAGES_ENV = settings.HUGE_PAGES_ENV  # "0": weights stay where they were loaded (no copy at the first pass)
_MADV_HUGEPAGE = 14  # Linux
_MADV_DONTNEED = 4


@cache
def thp_mode() -> str:
    """The kernel's transparent huge page mode ("always", "madvise", "never"), "" where there is none (not Linux)."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return ""
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else ""


@cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _helps(nbytes: int, device: torch.device) -> bool:
    return (sys.platform.startswith("linux") and settings.current().huge_pages
            and thp_mode() in ("always", "madvise") and device.type == "cpu" and nbytes >= HUGE_PAGE)


def advised_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> Tensor:
    """An uninitialised tensor of `shape` whose memory is advised for huge pages before it is first touched (its
    pages are faulted in as 2 MB ones when written), or a plain `torch.empty` where that cannot help."""
    device = torch.device(device)
    nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    if not _helps(nbytes, device):
        return torch.empty(shape, dtype=dtype, device=device)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)  # room to start on a huge page boundary
    start = -(-raw.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(nbytes // HUGE_PAGE * HUGE_PAGE), _MADV_HUGEPAGE)
    offset = start - raw.data_ptr()
    return raw[offset : offset + nbytes].view(dtype).view(shape)  # the view keeps the whole allocation alive


def on_huge_pages(tensor: Tensor) -> Tensor:
    """`tensor`'s values in memory advised for huge pages (a contiguous copy; the pages of a file `tensor` was read
    from given back, `release_file_pages`: the caller drops `tensor`), or `tensor` itself where that cannot help
    (`advised_empty`)."""
    if not _helps(tensor.numel() * tensor.element_size(), tensor.device):
        return tensor
    copy = advised_empty(tuple(tensor.shape), tensor.dtype, tensor.device).copy_(tensor)
    release_file_pages([tensor])
    return copy


def _file_mappings() -> list[tuple[int, int]]:
    """The address ranges of this process mapped from files (Linux's /proc/self/maps), [] elsewhere."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    ranges = []
    for line in lines:
        fields = line.split()
        if len(fields) >= 6 and fields[5].startswith("/") and fields[4] != "0":  # a file, not anonymous memory
            low, high = (int(bound, 16) for bound in fields[0].split("-"))
            ranges.append((low, high))
    return ranges


def release_file_pages(tensors: list[Tensor]) -> None:
    """Tell the kernel that the pages of `tensors` that come straight from a mapped file (a safetensors checkpoint
    loaded without a copy, a cached self-drafter's packed weights) are not needed any more: a copy replaced them (a
    fused weight, or one moved onto huge pages), and a process that kept them would hold the weights twice (the
    1.5B's resident memory: 5.2 GB for 3.5 GB of weights). Only pages of a file mapping that lie wholly inside a
    tensor: anonymous memory is never touched, the model no longer points at these pages, and a page read again
    comes from the file."""
    if not sys.platform.startswith("linux") or not all(t.device.type == "cpu" for t in tensors):
        return
    mappings = _file_mappings()
    if not mappings:
        return
    libc = _libc()
    page = os.sysconf("SC_PAGE_SIZE")
    for tensor in tensors:
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        if not any(low <= start and end <= high for low, high in mappings):
            continue
        first, last = -(-start // page) * page, end // page * page  # whole pages inside the tensor only
        if last > first:
            libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)
