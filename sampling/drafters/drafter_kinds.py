"""The library's own drafter kinds, one line each: importing a kind's file registers it
(`sampling/drafters/registry.py`). Adding a kind inside `sampling/`: its file, and one line here; a package
above `sampling/` registers its kinds itself (NASD's pools: `ngram_assisted/nasd.py`).
"""

from __future__ import annotations

import sampling.drafters.custom_drafters  # noqa: F401  your own Drafter
import sampling.drafters.hybrid  # noqa: F401  a drafter model beside an n-gram pool (ngram=)
import sampling.drafters.model_kind  # noqa: F401  a drafter model (cascade= and drafter_tokenizer= are its options)
import sampling.drafters.self_kind  # noqa: F401  "self": the target's own weights in fewer bits (bits=, share_cache=)
from sampling.drafters.registry import KINDS, drafter_kind, register_kind

__all__ = ["KINDS", "drafter_kind", "register_kind"]
