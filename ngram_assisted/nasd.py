"""Ngram Assisted Speculative Decoding (NASD): speculative decoding whose drafter is a dynagram.

The same draft -> verify -> accept loop as `sampling.speculative_generate`; only the drafter
differs. NASD drafts are deterministic, so q is one-hot at each draft and speculative sampling
accepts draft x with probability p(x), or else samples from p with x removed (exact).

ANPD / NAPD (Ou et al. 2024) is reproduced by `SimpleDynaGram`, `top_k_filler=1`,
`stop_if_unknown=False`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from ngram_assisted.dynagram import DynaGram
from ngram_assisted.rows import ngram_rows
from sampling.common import Generation, OnStep, Request
from sampling.draft_policy import DraftLength
from sampling.habits import Habits
from sampling.loop import SpeculativeStats
from sampling.model_kind import encoder_decoder_twin, of_kind
from sampling.options import DecodingOptions, Drafting
from sampling.speculative import run_drafting
from sampling.stopping import Criterion
from utils.logits_processors import GreedyProcessor, LogitsProcessor
from utils.validation import MODEL_EOS, Inputs, transformers_names


@dataclass(frozen=True, kw_only=True)
class NasdOptions(DecodingOptions):
    """`ngram_assisted_speculative_generate`'s options: the pool and how it drafts."""

    ngram: object = None
    top_k_filler: int = 3
    stop_if_unknown: bool = True
    draft_cost: Callable[[int], float] | None = None
    branching: int | None = None


class NgramKind:
    """NASD's drafter kind: the pool's drafter over the rows (`ngram_assisted/rows.py`), `gamma`
    nodes at most every step (its cost rule sizes each draft within them)."""

    def takes(self, options: DecodingOptions) -> bool:
        return isinstance(options, NasdOptions)

    def check(self, request: Request, options: NasdOptions) -> Callable[[Generation], Drafting]:
        build_rows = ngram_rows(options.ngram, request, greedy=options.logits_processor.is_greedy,
                                top_k_filler=options.top_k_filler,
                                stop_if_unknown=options.stop_if_unknown, draft_cost=options.draft_cost,
                                branching=options.branching)
        return lambda gen: Drafting(build_rows(gen), DraftLength(options.gamma))


@transformers_names
@of_kind(False, "target")
def ngram_assisted_speculative_generate(
    inputs: Inputs,
    ngram: DynaGram | list[DynaGram],
    target: PreTrainedModel,
    *,
    tokenizer=None,
    gamma: int = 16,
    top_k_filler: int = 3,
    logits_processor: LogitsProcessor = GreedyProcessor(),
    max_gen_len: int = 40,
    end_tokens_id: int | list[int] | None = MODEL_EOS,
    pad_token_id: int | None = None,
    use_cache: bool = True,
    stop_if_unknown: bool = True,
    draft_cost: Callable[[int], float] | None = None,
    branching: int | None = None,
    generator: torch.Generator | list[torch.Generator] | None = None,
    stats: SpeculativeStats | None = None,
    on_step: OnStep | None = None,
    stop_strings: str | list[str] | None = None,
    stopping_criteria: Criterion | list[Criterion] | None = None,
    num_return_sequences: int = 1,
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
    to `gamma` tokens (16 by default: room for a long copy, which prompt lookup drafts 10 tokens of;
    the cost cut keeps only what pays); with `stop_if_unknown` a draft stops at the first unknown n-gram and is cut
    to the length that pays under `draft_cost` (the cost of verifying k drafts relative to one plain
    step; by default measured on this machine for this model, `utils.calibration`). `branching`:
    the most candidate continuations drafted per node, verified as a token tree in one pass (1: a
    chain; None: up to 3, kept only where the cost model says they pay; `gamma` then counts every
    node). Models that cannot verify a tree (encoder-decoder, no cache, flash attention) draft
    chains. Greedy output equals greedy `autoregressive_generate`; sampled output follows the
    target's processed distribution exactly (multi-candidate speculative sampling on trees).
    `pad_token_id`: for a batch without an attention mask, the token stripped from both ends of
    each row. `tokenizer`: the target's, for `stop_strings`. `stop_strings`, `stopping_criteria`,
    `num_return_sequences` and `end_tokens_id` left out: as in `autoregressive_generate`.
    """
    return run_drafting(inputs, target, NasdOptions(
        ngram=ngram, gamma=gamma, top_k_filler=top_k_filler, logits_processor=logits_processor, max_gen_len=max_gen_len,
        end_tokens_id=end_tokens_id, pad_token_id=pad_token_id, use_cache=use_cache, stop_if_unknown=stop_if_unknown,
        draft_cost=draft_cost, branching=branching, generator=generator, stats=stats, on_step=on_step,
        habits=Habits(tokenizer, stop_strings, stopping_criteria, num_return_sequences, on_step),
    ), NgramKind())


ngram_assisted_speculative_generate_encoder_decoder = encoder_decoder_twin(
    ngram_assisted_speculative_generate, "ngram_assisted_speculative_generate_encoder_decoder", """
    NASD for encoder-decoder models: the pool is also seeded with the encoder's source tokens
    (`inputs`, in any form the decoder-only variant takes), where summarisation and translation
    copy from. Returns the decoder's ids (a list of results for a batch).""", "target")
