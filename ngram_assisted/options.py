"""NASD's drafting options: one field per option, each checked as the options are built, and
checked against the target's vocabulary where that is known (`check_vocabulary`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from utils.validation import check_bool, check_int


@dataclass(frozen=True, kw_only=True)
class NgramOptions:
    """An n-gram pool's drafting options (`ngram_assisted_speculative_generate` says what each means;
    `NgramDrafter` reads them whole)."""

    top_k_filler: int = 3
    stop_if_unknown: bool = True
    draft_cost: Callable[[int], float] | None = None
    branching: int | None = None

    def __post_init__(self) -> None:
        check_int(self.top_k_filler, "top_k_filler", 1)
        check_bool(self.stop_if_unknown, "stop_if_unknown")
        if self.draft_cost is not None and not callable(self.draft_cost):
            raise TypeError(f"draft_cost must be a function of the number of drafts, or None; got {self.draft_cost!r}")
        if self.branching is not None:
            check_int(self.branching, "branching", 1)


def check_vocabulary(options: NgramOptions, vocab: int) -> None:
    """The options against the target's vocabulary of `vocab` tokens, or a ValueError naming the one that exceeds it."""
    if options.top_k_filler > vocab:
        raise ValueError(f"top_k_filler must be at most the vocabulary size {vocab}, got {options.top_k_filler}")
