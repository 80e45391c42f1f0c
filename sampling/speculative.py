"""Speculative decoding (Leviathan et al. 2023) and speculative sampling (Chen et al. 2023): the
public functions, and `run_speculative`, the one path of every speculative call: its arguments
checked once, its drafter built by the kind its options ask for (`sampling/drafters/drafter_kinds.py`: a
drafter model, your own `Drafter`, a model beside an n-gram pool), the one loop (`sampling/loop/speculative_loop.py`).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from sampling.drafters.drafter_kinds import KINDS, drafter_kind
from sampling.drafters.hybrid import HybridOptions
from sampling.drafters.registry import kind_options
from sampling.loop.common import OnStep, measured_costs, start_generation
from sampling.loop.drafts import Drafter
from sampling.loop.encoder_decoder import encoder_decoder_twin, of_kind
from sampling.loop.habits import Habits
from sampling.loop.options import DecodingOptions, check_request
from sampling.loop.speculative_loop import SpeculativeStats, speculative_loop
from sampling.loop.stopping import Criterion
from sampling.policy.draft_policy import DraftPolicy
from utils.logits_processors import LogitsProcessor
from utils.runners.model_info import is_encoder_decoder
from utils.validation import Inputs, transformers_names

__all__ = ["SpeculativeStats", "run_speculative", "speculative_generate", "speculative_generate_encoder_decoder",
           "speculative_loop"]

SHARED, MODEL = DecodingOptions, HybridOptions  # the public signature's defaults: the options' own


def run_speculative(inputs: Inputs, target: PreTrainedModel, drafter: object, shared: DecodingOptions,
                    keywords: dict[str, object], *, name: str = "drafter", function: str = "speculative_generate",
                    kind: type | None = None):
    """The one path of every speculative call: the drafter's kind found in the registry
    (`sampling/drafters/registry.py`; `kind`: the class it must be, for a function of one kind), its options
    built from the call's kind `keywords` (`kind_options`), every argument checked before any model runs;
    then the drafter built, the loop run, the kind's counters added to the stats."""
    if kind is None:
        chosen = drafter_kind(drafter, keywords, name)
    else:  # a function of one kind: that registered kind, or a TypeError naming what it takes
        chosen = next((k for k in KINDS if isinstance(k, kind) and k.takes(drafter, keywords)), None)
        if chosen is None:
            raise TypeError(f"{name} must be {kind.what}, got a {type(drafter).__name__}")
    options = kind_options(chosen, keywords, function)
    request = check_request(inputs, target, shared, encoder_decoder=is_encoder_decoder(target), model_name="target",
                            tokenizer_used=getattr(options, "drafter_tokenizer", None) is not None)
    build = chosen.check(request, shared, drafter, options)
    gen = start_generation(request, measured_costs(target))  # the first call with a model calibrates it
    drafting = build(gen)
    result = speculative_loop(gen, drafting.drafter, logits_processor=shared.logits_processor,
                              policy=drafting.policy, stats=shared.stats, on_step=shared.on_step)
    if shared.stats is not None:
        shared.stats.add(drafting.counters())
    return result


@transformers_names
@of_kind(False, "target")
def speculative_generate(
    inputs: Inputs,
    drafter: PreTrainedModel | Drafter,
    target: PreTrainedModel,
    *,
    tokenizer=Habits.tokenizer,
    gamma: int = SHARED.gamma,
    logits_processor: LogitsProcessor = SHARED.logits_processor,
    max_gen_len: int = SHARED.max_gen_len,
    end_tokens_id: int | list[int] | None = SHARED.end_tokens_id,
    pad_token_id: int | None = SHARED.pad_token_id,
    use_cache: bool = SHARED.use_cache,
    adaptive_gamma: bool = MODEL.adaptive_gamma,
    generator: torch.Generator | list[torch.Generator] | None = SHARED.generator,
    stats: SpeculativeStats | None = SHARED.stats,
    on_step: OnStep | None = SHARED.on_step,
    drafter_tokenizer=MODEL.drafter_tokenizer,
    drafter_invariant: bool | None = MODEL.drafter_invariant,
    ngram: object | list[object] | None = MODEL.ngram,
    cascade: bool | None = MODEL.cascade,
    stop_strings: str | list[str] | None = Habits.stop_strings,
    stopping_criteria: Criterion | list[Criterion] | None = Habits.stopping_criteria,
    num_return_sequences: int = Habits.num_return_sequences,
    branching: int | None = MODEL.branching,
    draft_policy: DraftPolicy | None = SHARED.draft_policy,
    **kind_options,
) -> tuple[list[int], float] | list[tuple[list[int], float]]:
    """Speculative decoding of a decoder-only `target` with a smaller `drafter` model, or with any
    object with the `Drafter` protocol (your own drafter: docs/drafters.md).

    Each step the drafter proposes `gamma` tokens, the target scores them in one forward pass, and
    a prefix is accepted: greedily (output identical to greedy `autoregressive_generate`) or by
    rejection sampling (output distributed exactly as the target's processed distribution).
    Returns (generated ids, alpha = drafts accepted / drafts proposed); for a batch (a list of
    token-id lists, a 2-D tensor, or a tokenizer's output with 2-D `input_ids`, even [1, n]; its
    attention mask's padding is removed per row: `utils.validation.INPUTS_DOC`) a list with one such
    pair per row, the rows decoded together; a 1-D tensor is one sequence. With `adaptive_gamma` each
    step drafts the number of tokens (0 .. max(gamma, 16)) that maximises the expected tokens per
    unit of measured cost (`sampling.policy.draft_policy`), so a drafter that cannot pay on this machine
    stops drafting; without it, `gamma` every step. `stats` collects tau, forward passes and
    acceptance by position; `on_step` streams each step. `pad_token_id`: for a batch without an
    attention mask, the token stripped from both ends of each row. A drafter with another tokenizer: pass `tokenizer` (the target's) and
    `drafter_tokenizer` (the drafter's); it drafts in its own vocabulary, inputs and outputs stay
    target ids, greedy and sampling stay exact (`sampling/drafters/universal.py`; decoder-only models).
    `drafter_invariant` (sampling): the drafter drafts with the target's own random number of each
    position and a draft is accepted iff it is the token the target samples there, so the output is
    plain seeded sampling's (`autoregressive_generate` with the same generator) whatever gamma,
    adaptive_gamma or timings chose; it accepts less than the standard min(1, p/q) rule. None (the
    default): on with `adaptive_gamma` (draft lengths follow timings: only this makes a seed give
    one output), off with a fixed gamma (the standard rule already reproduces itself there).
    `ngram` (a `MultiDynaGram(8)`, say; one pool shared by a batch's rows, or a list with one per
    row): hybrid drafting: each step and row drafts from the pool or with the model, whichever is
    expected to give more tokens per unit of measured cost (`sampling/drafters/hybrid.py`), exact either way.
    `cascade` (cascade drafting, `sampling/drafters/cascade.py`): a prompt-lookup proposer offers the drafter
    model tokens that it checks in one pass of its own, so several drafts cost one drafter pass where
    its measured costs say a wider pass is cheap; its drafts and q are exactly those of one-token
    passes, so outputs are unchanged. None (the default): on with `adaptive_gamma`, off otherwise.
    `end_tokens_id` left out: the model's `generation_config.eos_token_id` (all of them); None: only
    `max_gen_len` stops. `stop_strings` (with `tokenizer`, the target's) and `stopping_criteria`
    (transformers' `StoppingCriteria`) stop where plain decoding stops (`sampling/loop/stopping.py`);
    `num_return_sequences`=n returns what the batch of n copies of each prompt returns. `stats.logprobs`: each returned token's
    log-softmax of the target's raw logits, from the verification passes. `logits_processor` (greedy by
    default) makes the target's p and the drafter's q; `generator` (one, or one per row) makes sampling
    reproducible (docs/seeds.md); `use_cache=False` gives the same tokens, slower.
    `branching` (token trees from the drafter model, `sampling/drafters/model_tree.py`, docs/trees.md): up to this
    many children per node, the tree verified in one target pass, exact (greedy: the argmax path;
    sampling: recursive rejection sampling with the drafter's q); `gamma` counts every node. 1: chains.
    None (the default): with `adaptive_gamma`, a tree (up to 3 children per node) on the steps where
    the measured costs say it gives more than a chain, else a chain; with a fixed gamma, chains.
    Chains where a runner cannot verify trees (encoder-decoder models, `use_cache=False`, flash
    attention), with `ngram=` and with a `drafter_tokenizer`.
    `draft_policy` (your own `sampling.policy.draft_policy.DraftPolicy`: `budget(num_rows)`, `update(num_drafts,
    num_accepted)`): each step's budget of drafted nodes per row, instead of the kind's own (`gamma`, or
    with `adaptive_gamma` the cost-aware rule); docs/architecture.md, "Add a policy".
    `**kind_options`: the options of a drafter kind that the signature does not list (each kind's
    `Options` dataclass, `sampling/drafters/registry.py`); one no kind takes is refused by name.
    """
    shared = DecodingOptions(gamma=gamma, logits_processor=logits_processor, max_gen_len=max_gen_len,
                             end_tokens_id=end_tokens_id, pad_token_id=pad_token_id, use_cache=use_cache,
                             generator=generator, stats=stats, on_step=on_step, draft_policy=draft_policy,
                             habits=Habits(tokenizer, stop_strings, stopping_criteria, num_return_sequences))
    model = {"adaptive_gamma": adaptive_gamma, "drafter_tokenizer": drafter_tokenizer, "ngram": ngram,
             "drafter_invariant": drafter_invariant, "cascade": cascade, "branching": branching}
    return run_speculative(inputs, target, drafter, shared, {**model, **kind_options})


speculative_generate_encoder_decoder = encoder_decoder_twin(speculative_generate, "speculative_generate_encoder_decoder", """
    `speculative_generate` for encoder-decoder models: `inputs` are the encoder's ids, in any
    form `speculative_generate` takes (each model's encoder runs once); returns the decoder's generated ids without the start token.
    A `drafter_tokenizer` with another vocabulary is refused (decoder-only models only); `branching` is
    checked, and the drafts are chains (the encoder-decoder runners verify chains).""", "target")
