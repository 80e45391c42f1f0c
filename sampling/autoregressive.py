"""Classic autoregressive decoding: one forward pass of one new token per generated token."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from sampling.loop.acceptance import accept_rows
from sampling.loop.common import Generation, OnStep, Step, measured_costs, start_generation
from sampling.loop.drafts import Draft, DraftTree
from sampling.loop.encoder_decoder import encoder_decoder_twin, of_kind
from sampling.loop.habits import Habits
from sampling.loop.options import DecodingOptions, check_request
from sampling.loop.progress import Progress
from sampling.loop.speculative_loop import SpeculativeStats
from sampling.loop.stopping import Criterion
from utils.logits_processors import LogitsProcessor
from utils.runners.model_info import is_encoder_decoder
from utils.runners.prompt_cache import PromptCache
from utils.validation import Inputs, transformers_names

SHARED = DecodingOptions  # the defaults every decoding function shares (max_gen_len, use_cache, the processor...)
NO_DRAFTS = Draft(DraftTree.chain([]), None)


def _decode(gen: Generation, logits_processor: LogitsProcessor, on_step: OnStep | None,
            stats: SpeculativeStats | None = None) -> list:
    """The speculative loop (`sampling.loop.speculative_loop.speculative_loop`) without a drafter: each step accepts
    the target's own token (`accept_rows` with nothing drafted: the argmax, or the inverse CDF at
    the position's uniform) for every row at once, its prefill the same (each row's last token held back
    for the first step's pass: one target pass more than a prefill that scores the first token). `stats`:
    its generated tokens, steps, target passes and each returned token's log-probability."""
    rows, runner = Progress(gen, logprobs=stats is not None and stats.collect_logprobs), gen.runner
    passes = runner.forward_passes
    gen.prefill()  # the speculative loop's: each row's last token held back for the first step's pass
    logits = runner.forward_rows([(prefix[-1:], None) for prefix in gen.prefixes], [1] * len(rows.live))
    while True:
        verdicts = accept_rows(logits, [NO_DRAFTS] * len(rows.live), rows.active(), logits_processor, rows.uniforms())
        going_on = []  # positions in `live` of the rows not finished
        for i, verdict in enumerate(verdicts):
            row = rows.live[i]
            tokens, finished = rows.extend(i, [verdict.token], logits[i] if rows.needs_logits else None)
            going_on += [] if finished else [i]
            if stats is not None:
                stats.record(0, 0)
            if on_step is not None:
                on_step(Step(drafts=(), accepted=0, tokens=tuple(tokens), row=row))
        if rows.keep(going_on):  # finished rows stop costing compute
            runner = gen.narrow(going_on)
        if not rows.live:
            if stats is not None:
                stats.generated_tokens += sum(len(tokens) for tokens in rows.generated)
                stats.target_forwards += runner.forward_passes - passes
                stats.logprobs += rows.logprobs.lists()
            return gen.results(rows.generated, rows.sequences)
        logits = runner.forward_rows([([verdicts[i].token], None) for i in going_on], [1] * len(going_on))  # the cache holds the rest


@transformers_names
@of_kind(False, "model")
def autoregressive_generate(
    inputs: Inputs,
    model: PreTrainedModel,
    *,
    use_cache: bool = SHARED.use_cache,
    max_gen_len: int = SHARED.max_gen_len,
    logits_processor: LogitsProcessor = SHARED.logits_processor,
    end_tokens_id: int | list[int] | None = SHARED.end_tokens_id,
    pad_token_id: int | None = SHARED.pad_token_id,
    generator: torch.Generator | list[torch.Generator] | None = SHARED.generator,
    on_step: OnStep | None = SHARED.on_step,
    stats: SpeculativeStats | None = SHARED.stats,
    tokenizer=Habits.tokenizer,
    stop_strings: str | list[str] | None = Habits.stop_strings,
    stopping_criteria: Criterion | list[Criterion] | None = Habits.stopping_criteria,
    num_return_sequences: int = Habits.num_return_sequences,
    prompt_cache: PromptCache | None = SHARED.prompt_cache,
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
    makes sampling reproducible (`sampling.loop.randomness`); `on_step` receives each new token as a
    `Step` (streaming; `Step.row` says which row). `stats` (a `SpeculativeStats`) gets the
    generated tokens, steps, target passes and each token's `logprobs`.
    `end_tokens_id` left out: the model's `generation_config.eos_token_id` (all of them); None: only
    `max_gen_len` stops. `stop_strings` (with `tokenizer`, the target's) and `stopping_criteria`
    (transformers' `StoppingCriteria`) stop where plain decoding stops (`sampling/loop/stopping.py`);
    `num_return_sequences`=n returns what the batch of n copies of each prompt returns. `logits_processor`
    (greedy by default) picks each token; `use_cache=False` gives the same tokens, slower. `prompt_cache` (a
    `PromptCache`): one sequence's prompt read only past what the cache kept of this model's last call (a chat's
    next turn), and this call's keys kept for the next (`utils/runners/prompt_cache.py`).
    """
    options = DecodingOptions(logits_processor=logits_processor, max_gen_len=max_gen_len, end_tokens_id=end_tokens_id,
                              pad_token_id=pad_token_id, use_cache=use_cache, generator=generator, stats=stats,
                              on_step=on_step, habits=Habits(tokenizer, stop_strings, stopping_criteria, num_return_sequences),
                              prompt_cache=prompt_cache)
    request = check_request(inputs, model, options, encoder_decoder=is_encoder_decoder(model))
    return _decode(start_generation(request, measured_costs(model)), logits_processor, on_step, stats)


autoregressive_generate_encoder_decoder = encoder_decoder_twin(autoregressive_generate, "autoregressive_generate_encoder_decoder", """
    `autoregressive_generate` for encoder-decoder models (T5, BART, ...).

    `inputs` are the encoder's ids, in any form `autoregressive_generate` takes (a batch gives a
    list); the encoder runs once. Returns the decoder's generated ids,
    without the decoder start token.
    """, "model")
