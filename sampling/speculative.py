"""Speculative decoding (Leviathan et al. 2023) and speculative sampling (Chen et al. 2023): the
public functions, and `run_speculative`, the one path of every speculative call: its arguments
checked once, its drafter built by the kind its options ask for (`sampling/drafters/drafter_kinds.py`: a
drafter model, the target's own weights in fewer bits ("self"), your own `Drafter`, a model beside an n-gram
pool), the one loop (`sampling/loop/speculative_loop.py`).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from sampling.drafters.drafter_kinds import KINDS, drafter_kind
from sampling.drafters.hybrid import HybridOptions
from sampling.drafters.registry import kind_options
from sampling.drafters.self_kind import SelfOptions
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
from utils.runners.prompt_cache import PromptCache
from utils.validation import Inputs, transformers_names

__all__ = ["SpeculativeStats", "run_speculative", "speculative_generate", "speculative_generate_encoder_decoder",
           "speculative_loop"]

SHARED, MODEL, SELF = DecodingOptions, HybridOptions, SelfOptions  # the public signature's defaults: the options' own


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
    # `tokenizer` serves the stop strings and, with a drafter of another vocabulary, the bridge to it.
    uses_tokenizer = getattr(options, "drafter_tokenizer", None) is not None
    request = check_request(inputs, target, shared, encoder_decoder=is_encoder_decoder(target), model_name="target",
                            tokenizer_used=uses_tokenizer)
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
    drafter: PreTrainedModel | Drafter | str,
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
    bits: int | str | None = SELF.bits,
    group_size: int | None = SELF.group_size,
    share_cache: bool = SELF.share_cache,
    prompt_cache: PromptCache | None = SHARED.prompt_cache,
    **kind_options,
) -> tuple[list[int], float] | list[tuple[list[int], float]]:
    """Speculative decoding (Leviathan et al. 2023) of a decoder-only `target` with a smaller `drafter`
    model, or any object with the `Drafter` protocol (docs/drafters.md) -> (generated ids, alpha = drafts
    accepted / drafts proposed), or for a batch (`utils.validation.INPUTS_DOC`) one such pair per row.
    Greedy output is greedy `autoregressive_generate`'s, token for token; sampled output follows the
    target's processed distribution exactly. docs/api.md gives every parameter in full.

    `gamma`: tokens drafted each step (with `adaptive_gamma`: 0 .. max(gamma, 16), as the measured costs
    and acceptance say pays, `sampling.policy.draft_policy`); `draft_policy`: your own `DraftPolicy`
    instead. `logits_processor` (greedy by default) makes p and q; `generator` (one, or one per row)
    makes sampling reproducible; `use_cache=False` gives the same tokens, slower. `max_gen_len`,
    `end_tokens_id` (left out: the model's end tokens; None: only `max_gen_len` stops), `stop_strings`
    (with `tokenizer`, the target's) and `stopping_criteria` stop where plain decoding stops;
    `num_return_sequences`=n returns what the batch of n copies of each prompt returns; `pad_token_id`:
    the token stripped from both ends of a batch's rows without an attention mask. `stats` collects
    tau, passes, acceptance by position and `logprobs`; `on_step` streams each step.
    `drafter_tokenizer` (with `tokenizer`): a drafter with another vocabulary (`sampling/drafters/universal.py`).
    `drafter_invariant`: a draft accepted iff it is the token the target samples there (None: on with
    `adaptive_gamma`). `ngram` (a pool, or one per row): hybrid drafting (`sampling/drafters/hybrid.py`).
    `cascade`: prompt lookup checked in the drafter's own passes (None: on with `adaptive_gamma`).
    `branching`: token trees of up to this many children per node, verified in one pass (1: chains;
    None: trees where the measured costs say so with `adaptive_gamma`, else chains). `drafter="self"`: the
    target drafts for itself, its own weights in `bits` (4, 8 or "auto"; None: 4) in groups of `group_size` (None:
    the library's choice), built once per target (`sampling/drafters/self_kind.py`); `share_cache`: it drafts
    over the target's cache, no prompt pass of its own (a `quantized_drafter(target)` model takes these too). `**kind_options`:
    the options of a drafter kind the signature does not list; one no kind takes is refused by name.
    `prompt_cache`: as in `autoregressive_generate` (the target's keys kept, and a drafter model's own).
    """
    shared = DecodingOptions(gamma=gamma, logits_processor=logits_processor, max_gen_len=max_gen_len,
                             end_tokens_id=end_tokens_id, pad_token_id=pad_token_id, use_cache=use_cache,
                             generator=generator, stats=stats, on_step=on_step, draft_policy=draft_policy,
                             habits=Habits(tokenizer, stop_strings, stopping_criteria, num_return_sequences),
                             prompt_cache=prompt_cache)
    model = {"adaptive_gamma": adaptive_gamma, "drafter_tokenizer": drafter_tokenizer, "ngram": ngram,
             "drafter_invariant": drafter_invariant, "cascade": cascade, "branching": branching, "bits": bits,
             "group_size": group_size, "share_cache": share_cache}
    return run_speculative(inputs, target, drafter, shared, {**model, **kind_options})


speculative_generate_encoder_decoder = encoder_decoder_twin(speculative_generate, "speculative_generate_encoder_decoder", """
    `speculative_generate` for encoder-decoder models: `inputs` are the encoder's ids, in any
    form `speculative_generate` takes (each model's encoder runs once); returns the decoder's generated ids without the start token.
    A `drafter_tokenizer` with another vocabulary is refused (decoder-only models only); `branching` is
    checked, and the drafts are chains (the encoder-decoder runners verify chains).""", "target")
