"""Classic autoregressive decoding: one forward pass of one new token per generated token."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from sampling.acceptance import accept
from sampling.common import Generation, OnStep, Step, prepare
from sampling.drafters import DraftTree
from sampling.randomness import PositionUniforms
from utils.logits_processors import GreedyProcessor, LogitsProcessor

NO_DRAFTS = DraftTree.chain([])


def _decode(
    gen: Generation, logits_processor: LogitsProcessor, generator: torch.Generator | None, on_step: OnStep | None
) -> list[int]:
    generated: list[int] = []
    sequence = list(gen.prefix)  # what the processor sees as history (the decoder's ids)
    uniforms = PositionUniforms(generator, prefix_length=len(sequence))
    logits = gen.runner.forward(gen.prefix)  # prefill: the whole prompt in one pass
    while True:
        # The target's token: a speculative step with nothing drafted (argmax, or the inverse CDF
        # of the processed distribution at this position's uniform number).
        _, token, _ = accept(logits[-1:], NO_DRAFTS, None, sequence, logits_processor, uniforms)
        tokens, finished = gen.trim([token], len(generated))
        generated += tokens
        sequence += tokens
        if on_step is not None:
            on_step(Step(drafts=(), accepted=0, tokens=tuple(tokens)))
        if finished:
            return generated
        logits = gen.runner.forward([token])  # the cache holds everything else


def autoregressive_generate(
    inputs: list[int],
    model: PreTrainedModel,
    use_cache: bool = True,
    max_gen_len: int = 40,
    logits_processor: LogitsProcessor = GreedyProcessor(),
    end_tokens_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    *,
    generator: torch.Generator | None = None,
    on_step: OnStep | None = None,
) -> list[int]:
    """Generate up to `max_gen_len` tokens after `inputs` with a decoder-only model.

    Returns the generated ids only, ending with the end token when one was produced. Generation
    also stops when the model's context is full. `pad_token_id` is accepted for compatibility with
    the seed README and unused (one sequence needs no padding). `generator` makes sampling
    reproducible; `on_step` receives each new token as a `Step` (streaming).
    """
    gen = prepare(
        inputs, model, encoder_decoder=False, use_cache=use_cache, max_gen_len=max_gen_len,
        logits_processor=logits_processor, end_tokens_id=end_tokens_id,
    )
    return _decode(gen, logits_processor, generator, on_step)


def autoregressive_generate_encoder_decoder(
    inputs: list[int],
    model: PreTrainedModel,
    use_cache: bool = True,
    max_gen_len: int = 40,
    logits_processor: LogitsProcessor = GreedyProcessor(),
    end_tokens_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    *,
    generator: torch.Generator | None = None,
    on_step: OnStep | None = None,
) -> list[int]:
    """`autoregressive_generate` for encoder-decoder models (T5, BART, ...).

    `inputs` are the encoder's ids; the encoder runs once. Returns the decoder's generated ids,
    without the decoder start token.
    """
    gen = prepare(
        inputs, model, encoder_decoder=True, use_cache=use_cache, max_gen_len=max_gen_len,
        logits_processor=logits_processor, end_tokens_id=end_tokens_id,
    )
    return _decode(gen, logits_processor, generator, on_step)
