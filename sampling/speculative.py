"""Speculative decoding (Leviathan et al. 2023) and speculative sampling (Chen et al. 2023): the
public functions, and `run_drafting`, the one path of every speculative call: its arguments
checked once, its drafter built by the kind its options ask for (`sampling/drafter_kinds.py`: a
drafter model, your own `Drafter`, a model beside an n-gram pool), the one loop (`sampling/loop.py`).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from sampling.common import OnStep, check_request, measured_costs, start_generation
from sampling.drafter_kinds import drafter_kind
from sampling.drafters import Drafter
from sampling.habits import Habits
from sampling.hybrid import NgramPool
from sampling.loop import SpeculativeStats, speculative_loop
from sampling.model_kind import encoder_decoder_twin, of_kind
from sampling.options import DecodingOptions, DrafterKind, SpeculativeOptions
from sampling.stopping import Criterion
from utils.logits_processors import GreedyProcessor, LogitsProcessor
from utils.runners.model_info import is_encoder_decoder
from utils.validation import MODEL_EOS, Inputs, check_int, transformers_names

__all__ = ["SpeculativeOptions", "SpeculativeStats", "check_gamma", "run_drafting",
           "speculative_generate", "speculative_generate_encoder_decoder",
           "speculative_loop"]


def check_gamma(gamma: object) -> int:
    return check_int(gamma, "gamma", 1)


def run_drafting(inputs: Inputs, target: PreTrainedModel, options: DecodingOptions, kind: DrafterKind | None = None):
    """The one path of every speculative call: check every argument (before any model runs), build
    the drafter of its kind (`sampling/drafter_kinds.py`; None: the kind the options ask for), run
    the loop, add the kind's counters to the stats."""
    kind = kind if kind is not None else drafter_kind(options)
    request = check_request(inputs, target, encoder_decoder=is_encoder_decoder(target), use_cache=options.use_cache,
                            max_gen_len=options.max_gen_len, logits_processor=options.logits_processor,
                            end_tokens_id=options.end_tokens_id, generator=options.generator, model_name="target",
                            pad_token_id=options.pad_token_id, habits=options.habits)
    check_gamma(options.gamma)
    build = kind.check(request, options)
    gen = start_generation(request, measured_costs(target))  # the first call with a model calibrates it
    drafting = build(gen)
    result = speculative_loop(gen, drafting.drafter, logits_processor=options.logits_processor,
                              policy=drafting.policy, stats=options.stats, on_step=options.on_step)
    if options.stats is not None:
        options.stats.add(drafting.counters())
    return result


@transformers_names
@of_kind(False, "target")
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
    return run_drafting(inputs, target, SpeculativeOptions(
        drafter=drafter, tokenizer=tokenizer, gamma=gamma, logits_processor=logits_processor, max_gen_len=max_gen_len,
        end_tokens_id=end_tokens_id, pad_token_id=pad_token_id, use_cache=use_cache, adaptive_gamma=adaptive_gamma,
        generator=generator, stats=stats, on_step=on_step, drafter_tokenizer=drafter_tokenizer,
        drafter_invariant=drafter_invariant, ngram=ngram, cascade=cascade, branching=branching,
        habits=Habits(tokenizer, stop_strings, stopping_criteria, num_return_sequences, on_step, drafter_tokenizer),
    ))


speculative_generate_encoder_decoder = encoder_decoder_twin(speculative_generate, "speculative_generate_encoder_decoder", """
    `speculative_generate` for encoder-decoder models: `inputs` are the encoder's ids, in any
    form `speculative_generate` takes (each model's encoder runs once); returns the decoder's generated ids without the start token.
    A `drafter_tokenizer` with another vocabulary is refused (decoder-only models only); `branching` is
    checked, and the drafts are chains (the encoder-decoder runners verify chains).""", "target")
