"""What every decoding function shares: a checked request (`Request`, made by
`sampling.loop.options.check_request`), the generation started over it (`Generation`: the target's
runner, each row's prefix, budget and random numbers, end-token handling), the streamed `Step`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from transformers import PreTrainedModel

from sampling.loop.randomness import PositionUniforms
from sampling.loop.stopping import StopRules
from utils.calibration import pass_costs
from utils.cost_model import PassCosts
from utils.runners import Runner, make_runner
from utils.runners.model_info import context_length
from utils.runners.prompt_cache import PromptCache
from utils.validation import check_decoder_start


@dataclass(frozen=True)
class Step:
    """One step of a decoding loop, as streamed to an `on_step` callback.

    drafts: the tokens the drafter proposed (empty for autoregressive decoding);
    accepted: how many leading drafts the target accepted;
    tokens: the tokens appended to the output this step (accepted drafts, then the target's own
    token; cut after an end token or at `max_gen_len`). A batch streams one Step per row and step.
    """

    drafts: tuple[int, ...]
    accepted: int
    tokens: tuple[int, ...]
    row: int = 0  # the row of a batch this step belongs to (0 for one sequence)


OnStep = Callable[[Step], None]


@dataclass
class Generation:
    """A checked request over one or more rows: the target's runner, each row's decoder prefix,
    random numbers and length budget, and the stopping rules."""

    runner: Runner  # the target's runner over the rows still decoding (`utils/runners/`): see `narrow`
    prefixes: list[list[int]]  # decoder-only: the prompts; encoder-decoder: [decoder_start_token_id] each
    encoder_input_ids: list[list[int]] | None
    end_tokens: frozenset[int]
    max_new_tokens: list[int]  # max_gen_len, capped so that each row fits the model's context
    uniforms: list[PositionUniforms]  # each row's random numbers by position
    batched: bool  # the inputs were a batch: results come back as a list, one per row
    stopping: StopRules | None = None  # stop_strings / stopping_criteria (sampling/loop/stopping.py)
    prompt_cache: PromptCache | None = None  # where a one-row call's keys are kept for the next (`prefill`, `results`)
    # Other runners whose keys `results` keeps too, each as a function giving it at the end (a drafter model's).
    also_kept: list[Callable[[], Runner]] = field(default_factory=list)

    @property
    def prefix(self) -> list[int]:
        """The one row's prefix (a single-sequence request)."""
        assert len(self.prefixes) == 1
        return self.prefixes[0]

    def narrow(self, keep: list[int]) -> Runner:
        """Only the running rows at positions `keep` go on: the target's runner over them (the
        loop's, and the one a drafter over the target's cache reads here, `shared_runner`)."""
        self.runner = self.runner.select_rows(keep)
        return self.runner

    def trim(self, row: int, tokens: list[int], generated: int, history: list[int] | None = None,
             logits: torch.Tensor | None = None) -> tuple[list[int], bool]:
        """Cut row `row`'s new `tokens` after the first end token, at its length budget and after the
        first token at which a stopping rule fires (`history`: the row's ids before them; `logits`:
        the target's at the positions that produced them) -> (tokens, finished)."""
        tokens, finished = self._trim_end(row, tokens, generated)
        if self.stopping is not None and history is not None:
            tokens, finished = self.stopping.cut(history, tokens, logits, finished)
        return tokens, finished

    def _trim_end(self, row: int, tokens: list[int], generated: int) -> tuple[list[int], bool]:
        budget = self.max_new_tokens[row] - generated
        for i, token in enumerate(tokens[:budget]):
            if token in self.end_tokens:
                return tokens[: i + 1], True
        return tokens[:budget], len(tokens) >= budget

    def prefill(self) -> None:
        """The prompt pass: each row's prefix but its last token, which the first step feeds (so that every token's
        logits come from a pass of the width of a step's: a prompt-sized pass may round otherwise than a few-token
        one, `utils/lean/kernels.py`), less what the runner holds already (a kept prompt: `start_generation`)."""
        blocks = [(prefix[self.runner.row_length(b):-1], None) for b, prefix in enumerate(self.prefixes)]
        if any(tokens for tokens, _ in blocks):
            self.runner.forward_rows(blocks, [int(len(tokens) > 0) for tokens, _ in blocks])

    def results(self, per_row: list, sequences: list[list[int]]):
        """What the caller gets: the one row's result, or the list of every row's; `sequences`: each row's prefix
        and generated tokens, what a `prompt_cache` keeps of a one-row call."""
        if self.prompt_cache is not None and len(sequences) == 1:
            for runner in (self.runner, *(runner_of() for runner_of in self.also_kept)):
                self.prompt_cache.keep(runner, sequences[0])
        return per_row if self.batched else per_row[0]


@dataclass(frozen=True)
class Request:
    """A checked request, before any model runs: its rows of token ids (decoder-only: the prompts;
    encoder-decoder: the encoder's ids), each row's generator, the end tokens and the settings."""

    model: PreTrainedModel
    encoder_decoder: bool
    use_cache: bool
    inputs: list[list[int]]  # one list of token ids per row
    batched: bool  # the inputs were a batch: results come back as a list, one per row
    end_tokens: frozenset[int]
    max_gen_len: int
    generators: list[torch.Generator | None]  # one per row
    stopping: StopRules | None = None  # stop_strings / stopping_criteria (sampling/loop/stopping.py)
    prompt_cache: PromptCache | None = None  # a conversation's kept keys (`utils/runners/prompt_cache.py`)

    @property
    def num_rows(self) -> int:
        return len(self.inputs)

    def row(self, i: int) -> Request:
        """Row i alone, as a one-sequence request (beam search searches a batch row by row)."""
        return replace(self, inputs=[self.inputs[i]], batched=False, generators=[self.generators[i]])


def max_tokens(prefixes: list[list[int]], max_new: list[int]) -> int:
    """The most tokens any row may hold before its drafts: its prefix and its length budget (what a
    static KV buffer must fit)."""
    return max(len(prefix) + new for prefix, new in zip(prefixes, max_new, strict=True))


def measured_costs(model: PreTrainedModel) -> PassCosts:
    """Measurement, in one visible place: what a pass of `model` over 1 + k tokens costs on this
    machine, with the kernels measured fastest here. The first decoding call with a model
    calibrates it once per machine (it runs the model, with a progress bar on stderr:
    `utils.calibration`); later calls read the stored table. Called once every argument is checked."""
    return pass_costs(model)


def start_generation(request: Request, costs: PassCosts) -> Generation:
    """The target's runner over a checked request's rows, priced by `costs` (`measured_costs`),
    each row's prefix, budget and random numbers."""
    model, rows = request.model, request.inputs
    if request.encoder_decoder:
        prefixes, encoder_input_ids = [[check_decoder_start(model)] for _ in rows], rows
    else:
        prefixes, encoder_input_ids = rows, None
    limit = context_length(model)
    max_gen_len = request.max_gen_len
    max_new = [max_gen_len if limit is None else min(max_gen_len, limit - len(prefix)) for prefix in prefixes]
    uniforms = [PositionUniforms(g, prefix_length=len(prefix)) for g, prefix in zip(request.generators, prefixes, strict=True)]
    runner = make_runner(model, rows=len(rows), use_cache=request.use_cache, encoder_input_ids=encoder_input_ids,
                         costs=costs, max_tokens=max_tokens(prefixes, max_new))
    if request.prompt_cache is not None and not request.encoder_decoder and len(rows) == 1:
        request.prompt_cache.restore(runner, prefixes[0][:-1])
    return Generation(runner, prefixes, encoder_input_ids, request.end_tokens, max_new, uniforms, request.batched,
                      request.stopping, request.prompt_cache)
