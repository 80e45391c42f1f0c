"""Where the library keeps what it builds once: de-quantized models, measured pass costs."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "SPECDEC_CACHE"


def cache_dir() -> Path:
    """$SPECDEC_CACHE, else $XDG_CACHE_HOME/speculative-decoding, else ~/.cache/speculative-decoding."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "speculative-decoding"
