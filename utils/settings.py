"""Every `SPECDEC_*` environment variable the library reads, named, parsed and checked in this one place: a
value nobody meant (`SPECDEC_NATIVE=yes`) raises a ValueError naming the variable, the value and what it takes,
instead of meaning "on" in one file and "off" in another. The library reads them through `current()` only
(tests/test_settings.py checks that no other library file spells a `SPECDEC_` name).

    name                    values           default     meaning                                          read by
    SPECDEC_CACHE           a folder         unset       where the library keeps what it builds once      utils/paths.py
                                                         (taken as written; unset or empty:
                                                         $XDG_CACHE_HOME/speculative-decoding, else
                                                         ~/.cache/speculative-decoding)
    SPECDEC_NATIVE          0, 1             1           0: none of our C kernels, torch's operations     utils/lean/native.py,
                                                         everywhere (a choice: not warned about)          utils/lean/build.py
    SPECDEC_NATIVE_MARCH    a CPU name       native      the target of -march (x86-64) or -mcpu (Arm)     utils/lean/build.py
                                                         our kernels are built for (haswell: an
                                                         AVX2-only CPU's code)
    SPECDEC_LEAN            0, 1             1           0: every model takes the Hugging Face forward,   utils/lean/__init__.py
                                                         not our lean one
    SPECDEC_WIDTH_INVARIANT 0, 1, unset      unset       1: width-invariant GEMM kernels at any price;    utils/lean/kernels.py,
                                                         0: the fastest kernel per width; unset: the      utils/lean/linear.py
                                                         invariant ones where they cost a pass at most
                                                         `kernels.INVARIANCE_PAYS`
    SPECDEC_PROGRESS        0, 1             1           0: no progress bar on stderr (measuring costs    utils/calibration.py,
                                                         and kernels, converting or quantizing a model)   utils/offline_models.py,
                                                                                                          utils/quantized_models.py,
                                                                                                          utils/lean/kernels.py
    SPECDEC_CALIBRATE       0, 1, unset      unset       0: the prior pass costs, nothing measured;       utils/calibration.py
                                                         1: measure even within the back-off after a
                                                         busy machine; unset: measure unless backed off
    SPECDEC_HUGE_PAGES      0, 1             1           0: weights stay where they were loaded (no copy  utils/lean/huge_pages.py
                                                         onto transparent huge pages at the first pass)
    SPECDEC_KEEP_MEMORY     0, 1             1           0: glibc's malloc gives a pass's freed memory    utils/freed_memory.py
                                                         back as it does by default (faulted in again
                                                         at the next pass)

An empty value is the same as unset. `SPECDEC_REQUIRE_NATIVE` is the test suite's own (tests/conftest.py), not the
library's: it is not read here.

Why parse at every `current()` call and not once at import: tests (and a notebook) change the environment while the
process runs. The few dictionary lookups that read the raw values are the key of a small cache, so each distinct
environment is parsed once and a hot path (`kernels.invariance_pays`, per pass) pays a handful of lookups.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

__all__ = ["CACHE_ENV", "CALIBRATE_ENV", "HUGE_PAGES_ENV", "INVARIANT_ENV", "KEEP_MEMORY_ENV", "LEAN_ENV", "MARCH_ENV",
           "NAMES", "NATIVE_ENV", "PROGRESS_ENV", "Settings", "current", "parse"]

CACHE_ENV = "SPECDEC_CACHE"
NATIVE_ENV = "SPECDEC_NATIVE"
MARCH_ENV = "SPECDEC_NATIVE_MARCH"
LEAN_ENV = "SPECDEC_LEAN"
INVARIANT_ENV = "SPECDEC_WIDTH_INVARIANT"
PROGRESS_ENV = "SPECDEC_PROGRESS"
CALIBRATE_ENV = "SPECDEC_CALIBRATE"
HUGE_PAGES_ENV = "SPECDEC_HUGE_PAGES"
KEEP_MEMORY_ENV = "SPECDEC_KEEP_MEMORY"
NAMES = (CACHE_ENV, NATIVE_ENV, MARCH_ENV, LEAN_ENV, INVARIANT_ENV, PROGRESS_ENV, CALIBRATE_ENV, HUGE_PAGES_ENV,
         KEEP_MEMORY_ENV)
# A compiler's CPU name (haswell, x86-64-v3, neoverse-v1, armv8.2-a+fp16): never a leading "-", which would
# hand the compiler a flag of the environment's choosing.
_MARCH = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")
# os.environ's own dictionary (CPython's `_data`: keys and values as the OS holds them, bytes on POSIX), which
# monkeypatch.setenv and os.environ[...] = ... update: eight lookups in it take 0.4 us, eight `os.environ.get` 6 us,
# and `native.unavailable()` asks at every product our kernels run. Elsewhere, the public lookups.
_ENVIRON = getattr(os.environ, "_data", None)
_KEYS = tuple(os.environ.encodekey(name) for name in NAMES) if _ENVIRON is not None else NAMES


@dataclass(frozen=True)
class Settings:
    """The parsed `SPECDEC_*` variables (the module docstring's table); the defaults are those of an empty
    environment."""

    cache: Path | None = None  # SPECDEC_CACHE; None: the default folder (`utils.paths.configured_cache_dir`)
    native: bool = True  # SPECDEC_NATIVE
    native_march: str = "native"  # SPECDEC_NATIVE_MARCH
    lean: bool = True  # SPECDEC_LEAN
    width_invariant: bool | None = None  # SPECDEC_WIDTH_INVARIANT; None: priced per pass
    progress: bool = True  # SPECDEC_PROGRESS
    calibrate: bool | None = None  # SPECDEC_CALIBRATE; None: measure unless a busy machine backed it off
    huge_pages: bool = True  # SPECDEC_HUGE_PAGES
    keep_memory: bool = True  # SPECDEC_KEEP_MEMORY


def current() -> Settings:
    """The settings of the environment as it is now (parsed once per distinct set of raw values); a ValueError
    naming the variable where one holds a value it does not take."""
    if _ENVIRON is None:
        return _parsed(tuple(os.environ.get(name) for name in NAMES))
    return _parsed(tuple(map(_ENVIRON.get, _KEYS)))


def parse(environ: Mapping[str, str]) -> Settings:
    """The settings `environ` (a mapping like `os.environ`) would give; a ValueError for a bad value."""
    return _parsed(tuple(environ.get(name) for name in NAMES))


@lru_cache(maxsize=32)  # a ValueError is not cached: a bad value raises at every read
def _parsed(raw: tuple[str | bytes | None, ...]) -> Settings:
    text = (os.fsdecode(value) if isinstance(value, bytes) else value for value in raw)  # as os.environ decodes
    values = dict(zip(NAMES, (value or None for value in text), strict=True))  # empty: unset
    return Settings(
        cache=None if values[CACHE_ENV] is None else Path(values[CACHE_ENV]),
        native=_switch(NATIVE_ENV, values[NATIVE_ENV], True, "0 (torch's operations everywhere) or 1"),
        native_march=_march(values[MARCH_ENV]),
        lean=_switch(LEAN_ENV, values[LEAN_ENV], True, "0 (the Hugging Face forward) or 1"),
        width_invariant=_switch(INVARIANT_ENV, values[INVARIANT_ENV], None,
                                "0 (the fastest kernels), 1 (invariant at any price) or unset (priced)"),
        progress=_switch(PROGRESS_ENV, values[PROGRESS_ENV], True, "0 (no progress bars) or 1"),
        calibrate=_switch(CALIBRATE_ENV, values[CALIBRATE_ENV], None,
                          "0 (the prior costs), 1 (measure even when backed off) or unset"),
        huge_pages=_switch(HUGE_PAGES_ENV, values[HUGE_PAGES_ENV], True, "0 (weights stay where loaded) or 1"),
        keep_memory=_switch(KEEP_MEMORY_ENV, values[KEEP_MEMORY_ENV], True, "0 (glibc's own rules) or 1"),
    )


def _switch(name: str, value: str | None, default: bool | None, expected: str) -> bool | None:
    """"0" False, "1" True (surrounding spaces ignored), unset `default`; anything else a ValueError."""
    if value is None:
        return default
    if value.strip() in ("0", "1"):
        return value.strip() == "1"
    raise ValueError(f"{name}={value!r} is not a value it takes: expected {expected}")


def _march(value: str | None) -> str:
    if value is None:
        return "native"
    if _MARCH.fullmatch(value) is None:
        raise ValueError(f"{MARCH_ENV}={value!r} is not a value it takes: expected a CPU name for -march/-mcpu "
                         f"(letters, digits, '.', '_', '+', '-', not starting with '-'; e.g. haswell), or unset "
                         f"for native")
    return value
