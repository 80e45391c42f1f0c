"""The one builder of NASD's drafter over a batch's rows, for NASD and for hybrid drafting.

`ngram` is one pool shared by every row (each row drafts from it and teaches it) or, for a batch, a
list with one pool per row. Checked before any model runs; built once the target's runner exists
(its measured costs price the drafts, and whether it verifies trees decides their shape).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ngram_assisted.drafter import NgramDrafter, NgramRows
from ngram_assisted.dynagram import DynaGram
from sampling.loop.common import Generation, Request
from sampling.policy.tree_choice import AUTO_BRANCHING  # one width where the cost model chooses trees
from utils.runners.model_info import vocab_size
from utils.validation import check_bool, check_int, check_rows_argument


@dataclass(frozen=True, kw_only=True)
class NgramOptions:
    """An n-gram pool's drafting options (`ngram_assisted_speculative_generate` says what each means)."""

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


def check_pools(ngram: object, request: Request) -> list[DynaGram]:
    """`ngram`: a pool, or for a batch a list of one pool per row -> one pool per row."""
    many = isinstance(ngram, (list, tuple))
    for i, pool in enumerate(ngram if many else [ngram]):
        if not isinstance(pool, DynaGram):
            raise TypeError(f"{f'ngram[{i}]' if many else 'ngram'} must be a SimpleDynaGram or MultiDynaGram, "
                            f"got {type(pool).__name__}")
    if not many:
        return [ngram] * request.num_rows
    if not request.batched:
        raise TypeError("ngram must be one pool for one sequence; a list of pools is for a batch")
    return check_rows_argument(list(ngram), "ngram", request.num_rows, DynaGram)


def ngram_rows(ngram: object, request: Request, greedy: bool, options: NgramOptions) -> Callable[[Generation], NgramRows]:
    """Check NASD's pools against the request (the `options` come checked as they were built;
    `ngram_assisted_speculative_generate` says what each means) -> the builder of its drafter over the
    rows of a generation of `request`.

    Trees where the target verifies them in one pass (else chains, still exact); `branching` None:
    up to AUTO_BRANCHING candidates per node (`sampling.policy.tree_choice`'s: one width wherever the cost model
    sizes trees) where `stop_if_unknown` cuts them to what pays, a chain
    otherwise. `greedy`: the target's processor decodes greedily (else it samples). Unless
    `draft_cost` is given, drafts are priced by the target's measured costs (one
    row; a batch's rows are cut together by `NgramRows`, from its timed batched passes)."""
    pools = check_pools(ngram, request)
    vocab = vocab_size(request.model)
    if options.top_k_filler > vocab:
        raise ValueError(f"top_k_filler must be at most the vocabulary size {vocab}, got {options.top_k_filler}")
    for pool in pools:
        pool.bind_vocabulary(vocab)  # a pool filled under another vocabulary is refused here

    def build(gen: Generation) -> NgramRows:
        if not gen.runner.supports_trees:
            width = 1
        elif options.branching is None:
            width = AUTO_BRANCHING if options.stop_if_unknown else 1
        else:
            width = options.branching
        cost = options.draft_cost or gen.runner.costs
        sources = gen.encoder_input_ids or [()] * len(pools)  # encoder-decoder: the source text, where copying happens
        return NgramRows([
            NgramDrafter(pool, vocab_size=vocab, top_k_filler=options.top_k_filler, stop_if_unknown=options.stop_if_unknown,
                         source_tokens=source, draft_cost=cost, branching=width, greedy=greedy)
            for pool, source in zip(pools, sources, strict=True)
        ], gen.runner.costs if options.draft_cost is None else None, options.stop_if_unknown)

    return build

