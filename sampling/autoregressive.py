"""Classic autoregressive decoding: one forward pass of one new token per generated token."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from sampling.acceptance import accept
from sampling.common import Generation, OnStep, Step, check_request, start_generation
from sampling.drafters import DraftTree
from sampling.habits import Habits
from sampling.logprobs import RowLogprobs
from sampling.loop import SpeculativeStats
from sampling.stopping import Criterion
from utils.logits_processors import GreedyProcessor, LogitsProcessor
from utils.validation import MODEL_EOS, Inputs, transformers_names

NO_DRAFTS = DraftTree.chain([])


def _decode(gen: Generation, logits_processor: LogitsProcessor, on_step: OnStep | None,
            stats: SpeculativeStats | None = None) -> list:
    """The plain loop over every row of `gen`; rows that finish leave the batch. `stats`: its
    generated tokens, steps, target passes and each returned token's log-probability."""
    sequences = [list(prefix) for prefix in gen.prefixes]  # what the processor sees as history (the decoder's ids)
    generated: list[list[int]] = [[] for _ in sequences]
    live = list(range(len(sequences)))  # indices of the rows still decoding, in the runner's order
    runner = gen.runner
    passes, logprobs = runner.forward_passes, RowLogprobs(len(sequences))
    logits = runner.forward_rows([(prefix, None) for prefix in gen.prefixes], [1] * len(live))  # prefill
    while True:
        feeds, going_on = [], []  # going_on: positions in `live` of the rows not finished
        for i, row in enumerate(live):
            # The target's token: a speculative step with nothing drafted (argmax, or the inverse
            # CDF of the processed distribution at this position's uniform number).
            _, token, _ = accept(logits[i], NO_DRAFTS, None, sequences[row], logits_processor, gen.uniforms[row])
            tokens, finished = gen.trim(row, [token], len(generated[row]), sequences[row], logits[i])
            if stats is not None:
                logprobs.add(row, logits[i], tokens)
                stats.record(0, 0)
            generated[row] += tokens
            sequences[row] += tokens
            if on_step is not None:
                on_step(Step(drafts=(), accepted=0, tokens=tuple(tokens), row=row))
            if not finished:
                going_on.append(i)
                feeds.append(([token], None))
        if not going_on:
            if stats is not None:
                stats.generated_tokens += sum(len(tokens) for tokens in generated)
                stats.target_forwards += runner.forward_passes - passes
                stats.logprobs += logprobs.lists()
            return gen.results(generated)
        if len(going_on) < len(live):
            runner = runner.select_rows(going_on)  # finished rows stop costing compute (the runner to use next)
            live = [live[i] for i in going_on]
        logits = runner.forward_rows(feeds, [1] * len(feeds))  # the cache holds everything else


@transformers_names
def autoregressive_generate(
    inputs: Inputs,
    model: PreTrainedModel,
    *,
    use_cache: bool = True,
    max_gen_len: int = 40,
    logits_processor: LogitsProcessor = GreedyProcessor(),
    end_tokens_id: int | list[int] | None = MODEL_EOS,
    pad_token_id: int | None = None,
    generator: torch.Generator | list[torch.Generator] | None = None,
    on_step: OnStep | None = None,
    stats: SpeculativeStats | None = None,
    tokenizer=None,
    stop_strings: str | list[str] | None = None,
    stopping_criteria: Criterion | list[Criterion] | None = None,
    num_return_sequences: int = 1,
) -> list[int] | list[list[int]]:
    """Generate up to `max_gen_len` tokens after `inputs` with a decoder-only model.

    Returns the generated ids only, ending with the end token when one was produced. Generation
    also stops when the model's context is full. `inputs`: token ids (a list or a 1-D tensor), or
    a batch (a list of token-id lists of any lengths, a 2-D tensor), or a tokenizer's output
    (`BatchEncoding`/dict with `input_ids` and `attention_mask`: padding is removed per row by the
    mask). A batch (2-D `input_ids` included, even [1, n]) gives a list with each row's ids, each
    what the single call returns for that row, decoded together (one pass per step for all running
    rows). `pad_token_id`: for a batch without an attention mask, the token stripped from both
    ends of each row (without it, a batch that looks padded is refused). `generator` (one, or one per row)
    makes sampling reproducible (`sampling.randomness`); `on_step` receives each new token as a
    `Step` (streaming; `Step.row` says which row). `stats` (a `SpeculativeStats`) gets the
    generated tokens, steps, target passes and each token's `logprobs`.
    `end_tokens_id` left out: the model's `generation_config.eos_token_id` (all of them); None: only
    `max_gen_len` stops. `stop_strings` (with `tokenizer`, the target's) and `stopping_criteria`
    (transformers' `StoppingCriteria`) stop where plain decoding stops (`sampling/stopping.py`);
    `num_return_sequences=n` returns what the batch of n copies of each prompt returns.
    """
    request = check_request(
        inputs, model, encoder_decoder=False, use_cache=use_cache, max_gen_len=max_gen_len,
        logits_processor=logits_processor, end_tokens_id=end_tokens_id, generator=generator, pad_token_id=pad_token_id,
        habits=Habits(tokenizer, stop_strings, stopping_criteria, num_return_sequences, on_step),
    )
    return _decode(start_generation(request), logits_processor, on_step, stats)


@transformers_names
def autoregressive_generate_encoder_decoder(
    inputs: Inputs,
    model: PreTrainedModel,
    *,
    use_cache: bool = True,
    max_gen_len: int = 40,
    logits_processor: LogitsProcessor = GreedyProcessor(),
    end_tokens_id: int | list[int] | None = MODEL_EOS,
    pad_token_id: int | None = None,
    generator: torch.Generator | list[torch.Generator] | None = None,
    on_step: OnStep | None = None,
    stats: SpeculativeStats | None = None,
    tokenizer=None,
    stop_strings: str | list[str] | None = None,
    stopping_criteria: Criterion | list[Criterion] | None = None,
    num_return_sequences: int = 1,
) -> list[int] | list[list[int]]:
    """`autoregressive_generate` for encoder-decoder models (T5, BART, ...).

    `inputs` are the encoder's ids, in any form `autoregressive_generate` takes (a batch gives a
    list); the encoder runs once. Returns the decoder's generated ids,
    without the decoder start token.
    """
    request = check_request(
        inputs, model, encoder_decoder=True, use_cache=use_cache, max_gen_len=max_gen_len,
        logits_processor=logits_processor, end_tokens_id=end_tokens_id, generator=generator, pad_token_id=pad_token_id,
        habits=Habits(tokenizer, stop_strings, stopping_criteria, num_return_sequences, on_step),
    )
    return _decode(start_generation(request), logits_processor, on_step, stats)
