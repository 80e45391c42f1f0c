"""Ngram Assisted Speculative Decoding (NASD): speculative decoding whose drafter is a dynagram.

The same draft -> verify -> accept loop as `sampling.speculative_generate`; only the drafter
differs. NASD drafts are deterministic, so q is one-hot at each draft and speculative sampling
accepts draft x with probability p(x), or else samples from p with x removed (exact).

ANPD / NAPD (Ou et al. 2024) is reproduced by `SimpleDynaGram`, `top_k_filler=1`,
`stop_if_unknown=False`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from ngram_assisted.drafter import NgramRows
from ngram_assisted.dynagram import DynaGram
from ngram_assisted.options import NgramOptions
from ngram_assisted.rows import ngram_rows
from sampling.drafters.registry import register_kind
from sampling.loop.common import Generation, OnStep, Request
from sampling.loop.encoder_decoder import encoder_decoder_twin, of_kind
from sampling.loop.habits import Habits
from sampling.loop.options import DecodingOptions, Drafting, NasdDecodingOptions
from sampling.loop.speculative_loop import SpeculativeStats
from sampling.loop.stopping import Criterion
from sampling.policy.draft_policy import DraftLength, DraftPolicy
from sampling.speculative import run_speculative
from utils.logits_processors import LogitsProcessor
from utils.runners.prompt_cache import PromptCache
from utils.validation import Inputs, transformers_names


def first_pool(ngram: object) -> object:
    return ngram[0] if isinstance(ngram, (list, tuple)) and ngram else ngram


class NgramKind:
    """NASD's drafter kind: an n-gram pool (or one per row of a batch) drafting over the rows
    (`ngram_assisted/rows.py`), the step's budget of nodes at most (its cost rule sizes each draft
    within them); for the hybrid (`sampling/drafters/hybrid.py`), the pool beside a drafter model."""

    Options = NgramOptions
    what = "an n-gram pool (SimpleDynaGram, MultiDynaGram; for a batch one per row)"

    def takes(self, drafter: object, given: dict[str, object]) -> bool:
        return isinstance(first_pool(drafter), DynaGram)

    def check(self, request: Request, shared: DecodingOptions, drafter: object,
              options: NgramOptions) -> Callable[[Generation], Drafting]:
        build_rows = ngram_rows(drafter, request, shared.logits_processor.is_greedy, options)
        return lambda gen: Drafting(build_rows(gen), shared.draft_policy or DraftLength(shared.gamma))

    def pool_rows(self, ngram: object, request: Request, *, greedy: bool) -> Callable[[Generation], NgramRows]:
        """The builder of the pool's drafter over the request's rows, at the pool's defaults (the hybrid's)."""
        return ngram_rows(ngram, request, greedy, NgramOptions())


register_kind(NgramKind())
SHARED, POOL = NasdDecodingOptions, NgramOptions  # the public signature's defaults


@transformers_names
@of_kind(False, "target")
def ngram_assisted_speculative_generate(
    inputs: Inputs,
    ngram: DynaGram | list[DynaGram],
    target: PreTrainedModel,
    *,
    tokenizer=Habits.tokenizer,
    gamma: int = SHARED.gamma,
    top_k_filler: int = POOL.top_k_filler,
    logits_processor: LogitsProcessor = SHARED.logits_processor,
    max_gen_len: int = SHARED.max_gen_len,
    end_tokens_id: int | list[int] | None = SHARED.end_tokens_id,
    pad_token_id: int | None = SHARED.pad_token_id,
    use_cache: bool = SHARED.use_cache,
    stop_if_unknown: bool = POOL.stop_if_unknown,
    draft_cost: Callable[[int], float] | None = POOL.draft_cost,
    branching: int | None = POOL.branching,
    generator: torch.Generator | list[torch.Generator] | None = SHARED.generator,
    stats: SpeculativeStats | None = SHARED.stats,
    on_step: OnStep | None = SHARED.on_step,
    stop_strings: str | list[str] | None = Habits.stop_strings,
    stopping_criteria: Criterion | list[Criterion] | None = Habits.stopping_criteria,
    num_return_sequences: int = Habits.num_return_sequences,
    draft_policy: DraftPolicy | None = SHARED.draft_policy,
    prompt_cache: PromptCache | None = SHARED.prompt_cache,
    **kind_options,
) -> tuple[list[int], float] | list[tuple[list[int], float]]:
    """NASD for a decoder-only `target` -> (generated ids, alpha), or one such pair per row of a batch.

    `inputs`: token ids or a 1-D tensor (one sequence); a list of token-id lists or a 2-D tensor (a
    batch); or a tokenizer's output (`BatchEncoding`/dict: `input_ids`, and `attention_mask`, whose
    padding is removed per row). A batch (2-D `input_ids` included, even [1, n]) is decoded
    together, `ngram` is then one pool the rows share or a list of one pool per row, and a list of
    (ids, alpha) comes back, one per row.
    `ngram` (a SimpleDynaGram or MultiDynaGram) is filled from the prompt, then after every step
    with the accepted tokens and the target's `top_k_filler` most likely tokens at each verified
    position; it keeps what it learned across calls (call `ngram.reset()` to forget). Drafts are up
    to `gamma` tokens (31 by default: room for a long copy, which prompt lookup drafts 10 tokens of,
    in one pass of 32 tokens, our kernels' widest; the cost cut keeps only what pays); with
    `stop_if_unknown` a draft stops at the first unknown n-gram and is cut to the length that pays
    under `draft_cost` (the cost of verifying k drafts relative to one plain step; by default
    measured on this machine for this model, `utils.calibration`). `branching`:
    the most candidate continuations drafted per node, verified as a token tree in one pass (1: a
    chain; None: up to 3, kept only where the cost model says they pay; `gamma` then counts every
    node). Models that cannot verify a tree (encoder-decoder, no cache, flash attention) draft
    chains. Greedy output equals greedy `autoregressive_generate`; sampled output follows the
    target's processed distribution exactly (multi-candidate speculative sampling on trees).
    `pad_token_id`: for a batch without an attention mask, the token stripped from both ends of
    each row. `tokenizer`: the target's, for `stop_strings`. `stop_strings`, `stopping_criteria`,
    `num_return_sequences` and `end_tokens_id` left out: as in `autoregressive_generate`. `logits_processor`,
    `max_gen_len`, `use_cache`, `generator`, `stats`, `on_step`, `draft_policy` and `prompt_cache`: as in
    `speculative_generate`.
    """
    shared = NasdDecodingOptions(gamma=gamma, logits_processor=logits_processor, max_gen_len=max_gen_len,
                                 end_tokens_id=end_tokens_id, pad_token_id=pad_token_id, use_cache=use_cache,
                                 generator=generator, stats=stats, on_step=on_step, draft_policy=draft_policy,
                                 habits=Habits(tokenizer, stop_strings, stopping_criteria, num_return_sequences),
                                 prompt_cache=prompt_cache)
    pool = {"top_k_filler": top_k_filler, "stop_if_unknown": stop_if_unknown, "draft_cost": draft_cost,
            "branching": branching}
    return run_speculative(inputs, target, ngram, shared, {**pool, **kind_options}, name="ngram",
                           function="ngram_assisted_speculative_generate", kind=NgramKind)


ngram_assisted_speculative_generate_encoder_decoder = encoder_decoder_twin(
    ngram_assisted_speculative_generate, "ngram_assisted_speculative_generate_encoder_decoder", """
    NASD for encoder-decoder models: the pool is also seeded with the encoder's source tokens
    (`inputs`, in any form the decoder-only variant takes), where summarisation and translation
    copy from. Returns the decoder's ids (a list of results for a batch).""", "target")
