"""generate's habits, checked before any model runs: `tokenizer=`, `stop_strings=`,
`stopping_criteria=`, `num_return_sequences=`, and a `max_gen_len` the model's context can hold.

`num_return_sequences=n` makes every row n rows, each prompt's copies side by side (transformers'
order), so that one prompt returns exactly what a batch of n copies of it returns: n results, each
with its own random stream (one generator is split into one per row, docs/seeds.md; a list of
generators then gives one per returned row).
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedModel

from sampling.loop.stopping import StopRules, check_stop_strings, check_stopping_criteria, stop_rules
from sampling.loop.vocabularies import check_tokenizer
from utils.logits_processors import LogitsProcessor
from utils.runners.model_info import context_length
from utils.validation import check_int


@dataclass(frozen=True)
class Habits:
    """The habit arguments of one call, as the user gave them (checked by `check`, once the model is
    known: the tokenizer and the stop strings are checked against it)."""

    tokenizer: object = None
    stop_strings: object = None
    stopping_criteria: object = None
    num_return_sequences: object = 1

    def check(self, model: PreTrainedModel, processor: LogitsProcessor, model_name: str = "model", *,
              tokenizer_used: bool = False) -> StopRules | None:
        """Raise for a bad habit argument; -> the stopping rules (None without any). `tokenizer_used`:
        something besides the stop strings reads `tokenizer` (a drafter with another tokenizer)."""
        check_int(self.num_return_sequences, "num_return_sequences", 1)
        strings = check_stop_strings(self.stop_strings, self.tokenizer)
        criteria = check_stopping_criteria(self.stopping_criteria)
        if self.tokenizer is not None:
            if not strings and not tokenizer_used:
                raise ValueError("tokenizer is given but nothing uses it: it is the target's tokenizer for "
                                 "stop_strings= (and, in speculative_generate, for drafter_tokenizer=); pass one "
                                 "of those, or leave tokenizer out")
            check_tokenizer(self.tokenizer, "tokenizer", model, model_name)
        return stop_rules(strings, criteria, self.tokenizer, processor)

    def repeat(self, rows: list[list[int]], batched: bool) -> tuple[list[list[int]], bool]:
        """Each row `num_return_sequences` times, copies side by side -> (rows, batched)."""
        n = self.num_return_sequences
        if n == 1:
            return rows, batched
        return [list(row) for row in rows for _ in range(n)], True


def check_gen_len(max_gen_len: int, model: PreTrainedModel) -> None:
    """A `max_gen_len` longer than the model's whole context can never be reached: refused at once
    (a shorter one is capped per row by the room its prompt leaves, as documented)."""
    limit = context_length(model)
    if limit is not None and max_gen_len > limit:
        raise ValueError(f"max_gen_len is {max_gen_len}, but the model's context holds {limit} positions "
                         f"(prompt included): pass max_gen_len <= {limit}")
