"""utils/freed_memory.py: where glibc keeps a pass's freed memory, a pass's large tensors come back from the heap at
the next pass instead of being faulted in again page by page; `SPECDEC_KEEP_MEMORY=0` leaves glibc's rules; a
generation asks for it once. Each case runs in a fresh process (malloc's settings are the process's)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from utils import settings

ROOT = Path(__file__).resolve().parent.parent
GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# "Passes", each holding three 40 MB tensors at once (a prompt pass's activations) and freeing them: glibc's own rules
# map a block over 32 MB apart and unmap it when freed, so every pass faults its pages in again. Where the memory is
# kept, torch's aligned blocks settle into the heap within a few passes (a pass or two grow it while the free blocks
# left between them are too small) and then come back without a fault. Prints what the call returned and the minor
# faults of four passes after eight.
PASSES = """
import resource, sys, torch
sys.path.insert(0, {root!r})
from utils.freed_memory import keep_freed_memory
kept = keep_freed_memory() if {ask} else False
def one_pass():
    held = [torch.ones(10 << 20) for _ in range(3)]  # 3 x 40 MB of float32, every page written
    del held
for _ in range(8):
    one_pass()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    one_pass()
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def passes(ask: bool, keep: str | None = None) -> tuple[bool, int]:
    env = {k: v for k, v in os.environ.items() if k != settings.KEEP_MEMORY_ENV}
    if keep is not None:
        env[settings.KEEP_MEMORY_ENV] = keep
    out = subprocess.run([sys.executable, "-c", PASSES.format(root=str(ROOT), ask=ask)], env=env, check=True,
                         capture_output=True, text=True).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only: elsewhere keep_freed_memory changes nothing")
def test_freed_pages_are_reused_where_kept_and_faulted_again_without():
    kept, faults = passes(ask=True)
    assert kept and faults < 30720, faults  # fewer than one pass's 120 MB of pages: 122,880 faults if given back
    kept, faults = passes(ask=False)
    assert not kept and faults > 90000, faults
    kept, faults = passes(ask=True, keep="0")  # the user's choice: glibc's rules
    assert not kept and faults > 90000, faults


def test_elsewhere_than_glibc_nothing_changes(monkeypatch):
    from utils import freed_memory

    monkeypatch.setattr(freed_memory, "_kept", None)
    monkeypatch.setattr(freed_memory.platform, "libc_ver", lambda: ("", ""))
    assert freed_memory.keep_freed_memory() is False
    monkeypatch.setattr(freed_memory, "_kept", None)
    monkeypatch.setenv(settings.KEEP_MEMORY_ENV, "0")
    assert freed_memory.keep_freed_memory() is False and freed_memory._kept is None  # not even asked


def test_a_generation_asks_for_it():
    from sampling import autoregressive_generate
    from tests.models import tiny_model
    from utils import freed_memory

    autoregressive_generate(list(range(5, 12)), tiny_model("llama", seed=0), max_gen_len=2)
    assert bool(freed_memory._kept) == (GLIBC and settings.current().keep_memory)
