"""A decoding call's options, built whole and valid, the request checked against them, and what a
drafter kind builds from them.

A public function gathers its arguments into frozen objects, each validated field by field when it
is built (a `TypeError`/`ValueError` naming the argument, the value and what is expected, as
transformers' processors do), each value in one home:

- `DecodingOptions`: what every decoding call takes (the processor, the lengths, the seed, the
  stats, `on_step`, its `Habits`; a speculative one also `gamma` and `draft_policy`); its field
  defaults are every public signature's defaults;
- a speculative call's drafter kind's own options: a small frozen dataclass in the kind's file
  (`ModelOptions` in `sampling/drafters/model_kind.py`; `NgramOptions` in `ngram_assisted/options.py`, which
  `NgramDrafter` reads whole), handed down whole to what builds the drafter. The keywords that are not shared options go to the kind the
  drafter belongs to (`sampling/drafters/registry.py`); `tests/test_options.py` holds the public
  signatures and docstrings equal to the dataclasses' fields.

`check_request` then checks what needs the model (once, before any model runs), and for a
speculative call the one path (`sampling.speculative.run_speculative`) asks the kind to check its
options against the request and, once the target's runner exists, to build its `Drafting`: the
drafter, the loop's draft policy and the kind's own counters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import PreTrainedModel

from sampling.loop.common import Generation, OnStep, Request
from sampling.loop.drafts import Drafter
from sampling.loop.habits import Habits, check_gen_len
from sampling.loop.speculative_loop import SpeculativeStats
from sampling.policy.draft_policy import DraftPolicy, check_policy
from utils.logits_processors import GreedyProcessor, LogitsProcessor
from utils.runners.prompt_cache import PromptCache
from utils.validation import (
    MODEL_EOS,
    Inputs,
    check_batch,
    check_bool,
    check_end_tokens,
    check_end_tokens_form,
    check_fits,
    check_int,
    check_model,
    check_processor,
    check_rows_argument,
)

GREEDY = GreedyProcessor()  # the default processor (stateless: one object serves every call)


def check_generator_form(value: object) -> None:
    """`generator`: None, a torch.Generator, or (a batch) a list of them."""
    values = value if isinstance(value, (list, tuple)) else [value]
    if value is None or all(isinstance(v, torch.Generator) for v in values):
        return
    raise TypeError(f"generator must be a torch.Generator, a list of them (a batch) or None, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class DecodingOptions:
    """What every decoding call takes besides its inputs and models (the public functions'
    docstrings say what each means); `gamma` and `draft_policy` (your own `DraftPolicy`, None: the
    kind's own, `sampling/policy/draft_policy.py`) are read by speculative calls only."""

    gamma: int = 5
    logits_processor: LogitsProcessor = GREEDY
    max_gen_len: int = 40
    end_tokens_id: int | list[int] | None = MODEL_EOS  # left out: the model's generation_config.eos_token_id
    pad_token_id: int | None = None
    use_cache: bool = True
    generator: torch.Generator | list[torch.Generator] | None = None
    stats: SpeculativeStats | None = None
    on_step: OnStep | None = None
    draft_policy: DraftPolicy | None = None
    habits: Habits = Habits()  # tokenizer, stop strings, stopping criteria, num_return_sequences
    prompt_cache: PromptCache | None = None  # a conversation's kept keys (`utils/runners/prompt_cache.py`)

    def __post_init__(self) -> None:
        check_int(self.gamma, "gamma", 1)
        check_processor(self.logits_processor)
        check_int(self.max_gen_len, "max_gen_len", 1)
        check_end_tokens_form(self.end_tokens_id)
        if self.pad_token_id is not None:
            check_int(self.pad_token_id, "pad_token_id", 0)
        check_bool(self.use_cache, "use_cache")
        check_generator_form(self.generator)
        if self.stats is not None and not isinstance(self.stats, SpeculativeStats):
            raise TypeError(f"stats must be a SpeculativeStats (to be filled) or None, got {self.stats!r}")
        if self.on_step is not None and not callable(self.on_step):
            raise TypeError(f"on_step must be a function taking a Step (or None), got {self.on_step!r}")
        if self.draft_policy is not None:
            check_policy(self.draft_policy)
        if not isinstance(self.habits, Habits):
            raise TypeError(f"habits must be a sampling.loop.habits.Habits, got {self.habits!r}")
        if self.prompt_cache is not None and not isinstance(self.prompt_cache, PromptCache):
            raise TypeError(f"prompt_cache must be a PromptCache (kept across calls) or None, got {self.prompt_cache!r}")


@dataclass(frozen=True, kw_only=True)
class NasdDecodingOptions(DecodingOptions):
    """NASD's shared options: drafts of up to 31 tokens by default (room for a long copy, which
    prompt lookup drafts 10 tokens of: a verification of 32 tokens, the widest pass of our own
    kernels; the pool's cost cut keeps only what pays; measured against 16: docs/results.md,
    eleventh round)."""

    gamma: int = 31


def row_generators(generator: object, num_rows: int, batched: bool) -> list[torch.Generator | None]:
    """`generator=` (of a form already checked: None, a torch.Generator, or a list of them) -> one per row.

    One generator (or None: torch's global one) for a batch gives each row its own stream, seeded
    from it in row order; a list gives row i exactly the numbers the single call gets from
    generator[i]."""
    if isinstance(generator, (list, tuple)):
        if not batched:
            raise TypeError("generator must be a torch.Generator or None for one sequence; a list is for a batch")
        return check_rows_argument(generator, "generator", num_rows, torch.Generator)
    if not batched:
        return [generator]
    seeds = torch.randint(0, 2**62, (num_rows,), generator=generator,
                          device=generator.device if generator is not None else "cpu").tolist()
    device = generator.device if generator is not None else "cpu"
    return [torch.Generator(device=device).manual_seed(seed) for seed in seeds]


def check_request(inputs: Inputs, model: PreTrainedModel, options: DecodingOptions, *, encoder_decoder: bool,
                  model_name: str = "model", tokenizer_used: bool = False) -> Request:
    """Check a call's inputs and model against its `options` (each of their values checked once
    already, as they were built: `sampling.loop.options.DecodingOptions`), before any model runs:
    what needs the model (its kind, the end tokens and the tokenizer it knows, what its context
    holds) and the rows. `inputs` in any form `utils.validation.INPUTS_DOC` lists: tensors become
    lists and padding is removed by the attention mask there (`check_batch`), in this one place for
    every function. `options.habits`: stop strings, stopping criteria, num_return_sequences (each row
    repeated); `tokenizer_used`: something besides them reads `habits.tokenizer`."""
    check_model(model, model_name, encoder_decoder)
    row_ids, batched = check_batch(inputs, "inputs", model, options.pad_token_id)
    check_gen_len(options.max_gen_len, model)
    end_tokens = check_end_tokens(options.end_tokens_id, model)
    stopping = options.habits.check(model, options.logits_processor, model_name, tokenizer_used=tokenizer_used)
    row_ids, batched = options.habits.repeat(row_ids, batched)
    for i, ids in enumerate(row_ids):
        check_fits(len(ids), model, f"inputs[{i}]" if batched else "inputs")
    generators = row_generators(options.generator, len(row_ids), batched)
    return Request(model, encoder_decoder, options.use_cache, row_ids, batched, end_tokens, options.max_gen_len,
                   generators, stopping, options.prompt_cache)


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
    """A kind of drafter: one file with its drafter, its options and this object, registered once
    (`sampling.drafters.registry.register_kind`). Kinds claim disjoint drafters: two claimants are a TypeError.

    `Options`: the kind's frozen options dataclass; its fields are the keywords the kind takes,
    its defaults are theirs. `what`: the drafter it takes, in words, for error messages.
    `refusals`: keyword -> why this kind does not take it (optional; a generic reason otherwise)."""

    Options: type
    what: str

    def takes(self, drafter: object, given: dict[str, object]) -> bool:
        """Whether `drafter` (with these kind keywords given) is one of this kind's."""

    def check(self, request: Request, shared: DecodingOptions, drafter: object,
              options: object) -> Callable[[Generation], Drafting]:
        """Check the drafter and its options against the checked request, before any model runs
        (a ValueError/TypeError naming the argument) -> how to build its `Drafting` once the target's
        runner exists (its measured costs and whether it verifies trees shape the drafter)."""
