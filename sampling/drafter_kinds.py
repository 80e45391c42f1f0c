"""The registry of drafter kinds: which kind builds the drafter of a speculative call.

Each kind is one file with one `DrafterKind` object (`sampling/options.py` says what it does); the
first kind in `KINDS` that takes a call's options builds its drafter. Adding a kind: its file, and
one line here. NASD's n-gram kind lives in `ngram_assisted/nasd.py` and is handed to
`run_drafting` directly (`sampling/` never imports `ngram_assisted/`).
"""

from __future__ import annotations

from sampling.custom_drafters import CustomDrafterKind
from sampling.hybrid import HybridKind
from sampling.model_drafting import ModelDrafterKind
from sampling.options import DecodingOptions, DrafterKind

KINDS: list[DrafterKind] = [
    HybridKind(),  # a drafter model beside an n-gram pool (ngram=)
    ModelDrafterKind(),  # a drafter model (cascade= and drafter_tokenizer= are its options)
    CustomDrafterKind(),  # your own Drafter
]


def drafter_kind(options: DecodingOptions) -> DrafterKind:
    """The kind that builds the drafter these options ask for."""
    return next(kind for kind in KINDS if kind.takes(options))
