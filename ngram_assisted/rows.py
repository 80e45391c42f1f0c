"""The one builder of NASD's drafter over a batch's rows, for NASD and for hybrid drafting.

`ngram` is one pool shared by every row (each row drafts from it and teaches it) or, for a batch, a
list with one pool per row. Checked before any model runs; built once the target's runner exists
(its measured costs price the drafts, and whether it verifies trees decides their shape).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from ngram_assisted.drafter import NgramDrafter, NgramRows
from ngram_assisted.dynagram import DynaGram
from ngram_assisted.options import NgramOptions, check_vocabulary
from sampling.loop.common import Generation, Request
from utils.runners.model_info import vocab_size
from utils.validation import check_rows_argument


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
    """Check NASD's pools and `options` against the request (the options come checked as they were
    built; `ngram_assisted_speculative_generate` says what each means) -> the builder of its drafter
    over the rows of a generation of `request`. `greedy`: the target's processor decodes greedily
    (else it samples).

    The drafters read the options whole (`NgramDrafter`), with what only the generation knows put
    in: chains where the target cannot verify a tree in one pass (still exact), and unless
    `draft_cost` is given, drafts priced by the target's measured costs (one row; a batch's rows are
    cut together by `NgramRows`, from its timed batched passes)."""
    pools = check_pools(ngram, request)
    vocab = vocab_size(request.model)
    check_vocabulary(options, vocab)  # before any model runs
    for pool in pools:
        pool.bind_vocabulary(vocab)  # a pool filled under another vocabulary is refused here

    def build(gen: Generation) -> NgramRows:
        drafting = options
        if not gen.runner.supports_trees:
            drafting = replace(drafting, branching=1)
        if options.draft_cost is None:
            drafting = replace(drafting, draft_cost=gen.runner.costs)
        sources = gen.encoder_input_ids or [()] * len(pools)  # encoder-decoder: the source text, where copying happens
        return NgramRows([NgramDrafter(pool, drafting, vocab_size=vocab, source_tokens=source, greedy=greedy)
                          for pool, source in zip(pools, sources, strict=True)],
                         gen.runner.costs if options.draft_cost is None else None, options.stop_if_unknown)

    return build
