"""Speculative decoding (Leviathan et al. 2023) and speculative sampling (Chen et al. 2023): the
public functions. Each checks its arguments once, builds its drafter in the factory of its kind
(a drafter model: `sampling/model_drafting.py`; your own `Drafter`: `sampling/custom_drafters.py`;
a model beside an n-gram pool: `sampling/hybrid.py`) and runs the one loop (`sampling/loop.py`).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from sampling.common import OnStep, check_request, start_generation
from sampling.custom_drafters import check_drafter_options, checked_drafter
from sampling.draft_policy import DraftLength
from sampling.drafters import Drafter
from sampling.habits import Habits
from sampling.hybrid import NgramPool, hybrid_drafter, pool_rows
from sampling.loop import SpeculativeStats, speculative_loop
from sampling.model_drafting import check_same_vocabulary, model_drafting
from sampling.stopping import Criterion
from sampling.universal import check_tokenizers
from utils.logits_processors import GreedyProcessor, LogitsProcessor
from utils.validation import MODEL_EOS, Inputs, check_int, check_model, transformers_names

__all__ = ["SpeculativeStats", "check_gamma", "speculative_generate", "speculative_generate_encoder_decoder",
           "speculative_loop"]


def check_gamma(gamma: object) -> int:
    return check_int(gamma, "gamma", 1)


def check_branching(branching: object) -> int | None:
    """`branching=`: None (the policy's choice) or an int >= 1 (1: chains)."""
    return None if branching is None else check_int(branching, "branching", 1)


def _speculative(inputs, drafter, target, *, encoder_decoder, use_cache, gamma, max_gen_len, logits_processor,
                 end_tokens_id, adaptive_gamma, generator, stats, on_step, tokenizer=None, drafter_tokenizer=None,
                 drafter_invariant=None, ngram=None, cascade=None, pad_token_id=None, habits=Habits(), branching=1):
    """Check every argument (before any model runs), build the drafter, run the loop."""
    if drafter_invariant is not None and not isinstance(drafter_invariant, bool):
        raise TypeError(f"drafter_invariant must be a bool or None, got {drafter_invariant!r}")
    if cascade is not None and not isinstance(cascade, bool):
        raise TypeError(f"cascade must be a bool or None, got {cascade!r}")
    branching = check_branching(branching)
    is_model = isinstance(drafter, torch.nn.Module)
    if not is_model and branching not in (None, 1):
        raise ValueError(f"branching={branching} drafts token trees with a drafter model; your own Drafter shapes "
                         f"its own drafts (DraftTree): pass branching=None")
    if is_model:
        check_model(drafter, "drafter", encoder_decoder)
    else:  # your own drafter: the `Drafter` protocol (docs/drafters.md)
        check_drafter_options(drafter, adaptive_gamma=adaptive_gamma, drafter_tokenizer=drafter_tokenizer, ngram=ngram,
                              drafter_invariant=drafter_invariant, cascade=cascade)
    request = check_request(inputs, target, encoder_decoder=encoder_decoder, use_cache=use_cache, max_gen_len=max_gen_len,
                            logits_processor=logits_processor, end_tokens_id=end_tokens_id, generator=generator,
                            model_name="target", pad_token_id=pad_token_id, habits=habits)
    gamma = check_gamma(gamma)
    if not isinstance(adaptive_gamma, bool):
        raise TypeError(f"adaptive_gamma must be a bool, got {adaptive_gamma!r}")
    if not is_model:  # `gamma` nodes at most every step (it may propose fewer: it knows best how sure it is)
        gen = start_generation(request)
        return speculative_loop(gen, checked_drafter(drafter, target, gen), logits_processor=logits_processor,
                                policy=DraftLength(gamma), stats=stats, on_step=on_step)
    universal = check_tokenizers(tokenizer, drafter_tokenizer, drafter, target, encoder_decoder=encoder_decoder)
    if not universal:
        check_same_vocabulary(drafter, target)
    elif ngram is not None:
        raise ValueError("ngram= drafts in the target's vocabulary beside a drafter sharing it; with "
                         "drafter_tokenizer (another vocabulary) pass ngram=None")
    build_pool_rows = pool_rows(ngram, request) if ngram is not None else None
    gen = start_generation(request)
    model_drafter, cost_policy, policy = model_drafting(
        drafter, target, gen, logits_processor=logits_processor, use_cache=use_cache, gamma=gamma,
        adaptive_gamma=adaptive_gamma, drafter_invariant=drafter_invariant, cascade=cascade, universal=universal,
        tokenizer=tokenizer, drafter_tokenizer=drafter_tokenizer,
        branching=1 if build_pool_rows is not None else branching)  # the hybrid's model drafts chains
    drafter_in_loop = model_drafter
    if build_pool_rows is not None:  # the pool's draft or the model's, per step and row (sampling/hybrid.py)
        drafter_in_loop, policy = hybrid_drafter(build_pool_rows(gen), model_drafter, cost_policy, gamma=gamma,
                                                 adaptive_gamma=adaptive_gamma)
    result = speculative_loop(gen, drafter_in_loop, logits_processor=logits_processor, policy=policy, stats=stats,
                              on_step=on_step)
    if universal and stats is not None:
        stats.retokenize_seconds += model_drafter.retokenize_seconds
        stats.lossy_text_rows += model_drafter.lossy_text_rows
    if model_drafter.cascade is not None and stats is not None:
        stats.cascade_proposed += model_drafter.cascade.proposed
        stats.cascade_accepted += model_drafter.cascade.accepted
    return result


@transformers_names
def speculative_generate(
    inputs: Inputs,
    drafter: PreTrainedModel | Drafter,
    target: PreTrainedModel,
    *,
    tokenizer=None,
    gamma: int = 5,
    logits_processor: LogitsProcessor = GreedyProcessor(),
    max_gen_len: int = 40,
    end_tokens_id: int | list[int] | None = MODEL_EOS,
    pad_token_id: int | None = None,
    use_cache: bool = True,
    adaptive_gamma: bool = False,
    generator: torch.Generator | list[torch.Generator] | None = None,
    stats: SpeculativeStats | None = None,
    on_step: OnStep | None = None,
    drafter_tokenizer=None,
    drafter_invariant: bool | None = None,
    ngram: NgramPool | list[NgramPool] | None = None,
    cascade: bool | None = None,
    stop_strings: str | list[str] | None = None,
    stopping_criteria: Criterion | list[Criterion] | None = None,
    num_return_sequences: int = 1,
    branching: int | None = None,
) -> tuple[list[int], float] | list[tuple[list[int], float]]:
    """Speculative decoding of a decoder-only `target` with a smaller `drafter` model, or with any
    object with the `Drafter` protocol (your own drafter: docs/drafters.md; `adaptive_gamma` is for models).

    Each step the drafter proposes `gamma` tokens, the target scores them in one forward pass, and
    a prefix is accepted: greedily (output identical to greedy `autoregressive_generate`) or by
    rejection sampling (output distributed exactly as the target's processed distribution).
    Returns (generated ids, alpha = drafts accepted / drafts proposed); for a batch (a list of
    token-id lists, a 2-D tensor, or a tokenizer's output with 2-D `input_ids`, even [1, n]; its
    attention mask's padding is removed per row: `utils.validation.INPUTS_DOC`) a list with one such
    pair per row, the rows decoded together; a 1-D tensor is one sequence. With `adaptive_gamma` each
    step drafts the number of tokens (0 .. max(gamma, 16)) that maximises the expected tokens per
    unit of measured cost (`sampling.draft_policy`), so a drafter that cannot pay on this machine
    stops drafting; without it, `gamma` every step. `stats` collects tau, forward passes and
    acceptance by position; `on_step` streams each step. `pad_token_id`: for a batch without an
    attention mask, the token stripped from both ends of each row. A drafter with another tokenizer: pass `tokenizer` (the target's) and
    `drafter_tokenizer` (the drafter's); it drafts in its own vocabulary, inputs and outputs stay
    target ids, greedy and sampling stay exact (`sampling/universal.py`; decoder-only models).
    `drafter_invariant` (sampling): the drafter drafts with the target's own random number of each
    position and a draft is accepted iff it is the token the target samples there, so the output is
    plain seeded sampling's (`autoregressive_generate` with the same generator) whatever gamma,
    adaptive_gamma or timings chose; it accepts less than the standard min(1, p/q) rule. None (the
    default): on with `adaptive_gamma` (draft lengths follow timings: only this makes a seed give
    one output), off with a fixed gamma (the standard rule already reproduces itself there).
    `ngram` (a `MultiDynaGram(8)`, say; one pool shared by a batch's rows, or a list with one per
    row): hybrid drafting: each step and row drafts from the pool or with the model, whichever is
    expected to give more tokens per unit of measured cost (`sampling/hybrid.py`), exact either way.
    `cascade` (cascade drafting, `sampling/cascade.py`): a prompt-lookup proposer offers the drafter
    model tokens that it checks in one pass of its own, so several drafts cost one drafter pass where
    its measured costs say a wider pass is cheap; its drafts and q are exactly those of one-token
    passes, so outputs are unchanged. None (the default): on with `adaptive_gamma`, off otherwise.
    `end_tokens_id` left out: the model's `generation_config.eos_token_id` (all of them); None: only
    `max_gen_len` stops. `stop_strings` (with `tokenizer`, the target's) and `stopping_criteria`
    (transformers' `StoppingCriteria`) stop where plain decoding stops (`sampling/stopping.py`);
    `num_return_sequences=n` returns what the batch of n copies of each prompt returns. `stats.logprobs`: each returned token's
    log-softmax of the target's raw logits, from the verification passes.
    `branching` (token trees from the drafter model, `sampling/model_tree.py`, docs/trees.md): up to this
    many children per node, the tree verified in one target pass, exact (greedy: the argmax path;
    sampling: recursive rejection sampling with the drafter's q); `gamma` counts every node. 1: chains.
    None (the default): with `adaptive_gamma`, a tree (up to 3 children per node) on the steps where
    the measured costs say it gives more than a chain, else a chain; with a fixed gamma, chains.
    Chains where a runner cannot verify trees (encoder-decoder models, `use_cache=False`, flash
    attention), with `ngram=` and with a `drafter_tokenizer`.
    """
    return _speculative(
        inputs, drafter, target, encoder_decoder=False, use_cache=use_cache, gamma=gamma,
        max_gen_len=max_gen_len, logits_processor=logits_processor, end_tokens_id=end_tokens_id,
        adaptive_gamma=adaptive_gamma, generator=generator, stats=stats, on_step=on_step,
        tokenizer=tokenizer, drafter_tokenizer=drafter_tokenizer, drafter_invariant=drafter_invariant, ngram=ngram,
        cascade=cascade, pad_token_id=pad_token_id, branching=branching,
        habits=Habits(tokenizer, stop_strings, stopping_criteria, num_return_sequences, on_step, drafter_tokenizer),
    )


@transformers_names
def speculative_generate_encoder_decoder(
    inputs: Inputs,
    drafter: PreTrainedModel | Drafter,
    target: PreTrainedModel,
    *,
    tokenizer=None,
    gamma: int = 5,
    logits_processor: LogitsProcessor = GreedyProcessor(),
    max_gen_len: int = 40,
    end_tokens_id: int | list[int] | None = MODEL_EOS,
    pad_token_id: int | None = None,
    use_cache: bool = True,
    adaptive_gamma: bool = False,
    generator: torch.Generator | list[torch.Generator] | None = None,
    stats: SpeculativeStats | None = None,
    on_step: OnStep | None = None,
    drafter_tokenizer=None,
    drafter_invariant: bool | None = None,
    ngram: NgramPool | list[NgramPool] | None = None,
    cascade: bool | None = None,
    stop_strings: str | list[str] | None = None,
    stopping_criteria: Criterion | list[Criterion] | None = None,
    num_return_sequences: int = 1,
    branching: int | None = None,
) -> tuple[list[int], float] | list[tuple[list[int], float]]:
    """`speculative_generate` for encoder-decoder models: `inputs` are the encoder's ids, in any
    form `speculative_generate` takes (each model's encoder runs once); returns the decoder's generated ids without the start token.
    A `drafter_tokenizer` with another vocabulary is refused (decoder-only models only); `branching` is
    checked, and the drafts are chains (the encoder-decoder runners verify chains)."""
    return _speculative(
        inputs, drafter, target, encoder_decoder=True, use_cache=use_cache, gamma=gamma,
        max_gen_len=max_gen_len, logits_processor=logits_processor, end_tokens_id=end_tokens_id,
        adaptive_gamma=adaptive_gamma, generator=generator, stats=stats, on_step=on_step,
        tokenizer=tokenizer, drafter_tokenizer=drafter_tokenizer, drafter_invariant=drafter_invariant, ngram=ngram,
        cascade=cascade, pad_token_id=pad_token_id, branching=branching,
        habits=Habits(tokenizer, stop_strings, stopping_criteria, num_return_sequences, on_step, drafter_tokenizer),
    )
