"""Where the library keeps what it builds once: de-quantized models, measured pass costs."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

CACHE_ENV = "SPECDEC_CACHE"


def cache_dir() -> Path:
    """$SPECDEC_CACHE, else $XDG_CACHE_HOME/speculative-decoding, else ~/.cache/speculative-decoding."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "speculative-decoding"


def write_cached(path: Path, write: Callable[[Path], object]) -> None:
    """Keep a file under the cache: `write(partial)` fills a file of this process's own, then it is moved to `path`
    in one step, so that a reader (another process measuring the same) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    write(partial)
    partial.replace(path)
