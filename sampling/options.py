"""One speculative call's options, and what a drafter kind builds from them.

The public functions gather their arguments into one frozen options object and hand it to the
one path of every speculative call (`sampling.speculative.run_drafting`): the request is checked,
the drafter kind checks its own options (before any model runs) and, once the target's runner
exists, builds its `Drafting`: the drafter, the loop's draft policy and the kind's own counters,
which the stats then take in. A drafter kind is one file with one `DrafterKind` object; the
registry (`sampling/drafter_kinds.py`) lists them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from sampling.common import Generation, OnStep, Request
from sampling.draft_policy import DraftPolicy
from sampling.drafters import Drafter
from sampling.habits import Habits
from utils.logits_processors import GreedyProcessor, LogitsProcessor
from utils.validation import check_int


@dataclass(frozen=True, kw_only=True)
class DecodingOptions:
    """What every speculative call takes besides its inputs and target (the public functions'
    docstrings say what each means)."""

    gamma: int = 5
    logits_processor: LogitsProcessor = field(default_factory=GreedyProcessor)
    max_gen_len: int = 40
    end_tokens_id: int | list[int] | None = None
    pad_token_id: int | None = None
    use_cache: bool = True
    generator: torch.Generator | list[torch.Generator] | None = None
    stats: object = None  # a SpeculativeStats, filled
    on_step: OnStep | None = None
    habits: Habits = field(default_factory=Habits)  # stop strings, stopping criteria, num_return_sequences


@dataclass(frozen=True, kw_only=True)
class SpeculativeOptions(DecodingOptions):
    """`speculative_generate`'s options: the drafter (a model or a `Drafter`) and how it drafts."""

    drafter: object = None
    tokenizer: object = None
    adaptive_gamma: bool = False
    drafter_tokenizer: object = None
    drafter_invariant: bool | None = None
    ngram: object = None
    cascade: bool | None = None
    branching: int | None = None  # token trees from a drafter model (sampling/model_tree.py); 1: chains

    def __post_init__(self) -> None:
        for name in ("drafter_invariant", "cascade"):  # switches every kind reads (a Drafter refuses them)
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool or None, got {value!r}")
        if self.branching is not None:
            check_int(self.branching, "branching", 1)
        if self.branching not in (None, 1) and not isinstance(self.drafter, torch.nn.Module):
            raise ValueError(f"branching={self.branching} drafts token trees with a drafter model; your own Drafter "
                             f"shapes its own drafts (DraftTree): pass branching=None")


Counters = Callable[[], dict[str, float]]


@dataclass(frozen=True)
class Drafting:
    """What a drafter kind builds for one generation: the drafter the loop drives, the policy that
    gives each step's draft budget, and the kind's own counters, read once the loop is done and
    added to the caller's `SpeculativeStats` (a counter without a field goes to `stats.counters`)."""

    drafter: Drafter
    policy: DraftPolicy
    counters: Counters = dict


class DrafterKind(Protocol):
    """A kind of drafter (one file each; the registry `sampling/drafter_kinds.py` lists them)."""

    def takes(self, options: DecodingOptions) -> bool:
        """Whether these options ask for this kind (the registry's first taker builds)."""

    def check(self, request: Request, options: DecodingOptions) -> Callable[[Generation], Drafting]:
        """Check the kind's options against the checked request, before any model runs (a
        ValueError/TypeError naming the argument) -> how to build its `Drafting` once the
        target's runner exists (its measured costs and whether it verifies trees shape the drafter)."""
