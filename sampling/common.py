"""What every decoding function shares: input checks, the target's runner, end-token handling."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from transformers import PreTrainedModel

from utils.caching import ModelRunner, context_length
from utils.cost_model import pass_costs
from utils.logits_processors import LogitsProcessor
from utils.validation import (
    check_decoder_start,
    check_end_tokens,
    check_fits,
    check_int,
    check_model,
    check_processor,
    check_token_ids,
)


@dataclass(frozen=True)
class Step:
    """One step of a decoding loop, as streamed to an `on_step` callback.

    drafts: the tokens the drafter proposed (empty for autoregressive decoding);
    accepted: how many leading drafts the target accepted;
    tokens: the tokens appended to the output this step (accepted drafts, then the target's own
    token; cut after an end token or at `max_gen_len`).
    """

    drafts: tuple[int, ...]
    accepted: int
    tokens: tuple[int, ...]


OnStep = Callable[[Step], None]


@dataclass
class Generation:
    """A checked request: the target's runner, the decoder prefix and the stopping rules."""

    runner: ModelRunner
    prefix: list[int]  # decoder-only: the prompt; encoder-decoder: [decoder_start_token_id]
    encoder_input_ids: list[int] | None
    end_tokens: frozenset[int]
    max_new_tokens: int  # max_gen_len, capped so that the sequence fits the model's context

    def trim(self, tokens: list[int], generated: int) -> tuple[list[int], bool]:
        """Cut `tokens` after the first end token and at the length budget -> (tokens, finished)."""
        budget = self.max_new_tokens - generated
        for i, token in enumerate(tokens[:budget]):
            if token in self.end_tokens:
                return tokens[: i + 1], True
        return tokens[:budget], len(tokens) >= budget

def prepare(
    inputs: list[int],
    model: PreTrainedModel,
    *,
    encoder_decoder: bool,
    use_cache: bool,
    max_gen_len: int,
    logits_processor: LogitsProcessor,
    end_tokens_id: int | list[int] | None,
    model_name: str = "model",
) -> Generation:
    """Validate a request (before any forward pass) and build the target's runner. Callers check
    their own arguments first: the runner's pass costs may be calibrated here, running the model."""
    check_model(model, model_name, encoder_decoder)
    inputs = check_token_ids(inputs, "inputs", model)
    check_int(max_gen_len, "max_gen_len", 1)
    check_processor(logits_processor)
    if not isinstance(use_cache, bool):
        raise TypeError(f"use_cache must be a bool, got {use_cache!r}")
    end_tokens = check_end_tokens(end_tokens_id, model)
    check_fits(len(inputs), model, "inputs")
    if encoder_decoder:
        prefix, encoder_input_ids = [check_decoder_start(model)], inputs
    else:
        prefix, encoder_input_ids = inputs, None
    limit = context_length(model)
    max_new = max_gen_len if limit is None else min(max_gen_len, limit - len(prefix))
    runner = ModelRunner(model, use_cache=use_cache, encoder_input_ids=encoder_input_ids)
    runner.costs = pass_costs(model)  # the kernels measured fastest here (calibrated once per machine)
    return Generation(runner, prefix, encoder_input_ids, end_tokens, max_new)
