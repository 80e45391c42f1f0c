"""`stop_strings=` and `stopping_criteria=`: generate's stopping rules, exact under speculation.

Plain decoding asks the criteria after every token; a speculative step adds a block of tokens (the
accepted drafts, then the target's own token) at once. `StopRules.cut` asks the criteria after each
token of the block in turn, with the very ids plain decoding would have at that point, and cuts the
block after the first token at which one fires, so a speculative call stops where plain decoding
stops and returns the same tokens.

A criterion is called as transformers' `generate` calls it: `criterion(input_ids, scores)` with
`input_ids` a (1, length) int64 tensor (on the scores' device) of the row's ids so far (decoder-only: the prompt and the
generated tokens; encoder-decoder: the decoder's start token and the generated tokens) and
`scores` a one-item tuple holding the processed scores (1, V) of the position that produced the
newest token (`scores[-1]`, what `generate` gives criteria with `output_scores=True`). It returns a
bool, or a bool tensor of one item per row (transformers' `StoppingCriteria`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from utils.logits_processors import LogitsProcessor

Criterion = Callable[..., object]  # (input_ids (1, length), scores) -> bool or a bool tensor


def check_stop_strings(stop_strings: object, tokenizer: object) -> tuple[str, ...]:
    """`stop_strings`: None, a string or a list of non-empty strings; they need `tokenizer=`."""
    if stop_strings is None:
        return ()
    strings = [stop_strings] if isinstance(stop_strings, str) else stop_strings
    if not isinstance(strings, (list, tuple)) or not strings or not all(isinstance(s, str) and s for s in strings):
        raise TypeError(f"stop_strings must be a non-empty string or a list of them, got {stop_strings!r}")
    if tokenizer is None:
        raise ValueError("stop_strings is given but tokenizer is not: pass the target's tokenizer as tokenizer= "
                         "(stop strings are matched on the tokens' text, as in transformers' generate)")
    return tuple(strings)


def check_stopping_criteria(stopping_criteria: object) -> tuple[Criterion, ...]:
    """`stopping_criteria`: None, one criterion, or a list (`StoppingCriteriaList`) of them; each callable."""
    if stopping_criteria is None:
        return ()
    criteria = list(stopping_criteria) if isinstance(stopping_criteria, (list, tuple)) else [stopping_criteria]
    for i, criterion in enumerate(criteria):
        if not callable(criterion):
            raise TypeError(f"stopping_criteria[{i}] must be a transformers StoppingCriteria (or a function "
                            f"(input_ids, scores) -> bool), got {type(criterion).__name__}")
    return tuple(criteria)


def _fired(result: object) -> bool:
    """A criterion's answer for one row: a bool, or a tensor of one bool."""
    if isinstance(result, Tensor):
        if result.numel() != 1:
            raise ValueError(f"a stopping criterion called on one row returned {result.numel()} values; expected one")
        return bool(result.item())
    return bool(result)


@dataclass(frozen=True)
class StopRules:
    """Checked stopping rules: the criteria in their order (stop strings first) and the processor
    that gives the user's criteria their scores."""

    criteria: tuple[Criterion, ...]
    processor: LogitsProcessor
    needs_scores: tuple[bool, ...]  # per criterion: False for our own stop-string one (it ignores scores)

    def stops(self, history: Sequence[int], scores: Tensor | None) -> bool:
        """Whether a criterion fires on the row's ids `history` (the newest token last)."""
        ids = torch.tensor([list(history)], dtype=torch.long, device=scores.device if scores is not None else "cpu")
        return any(_fired(criterion(ids, (scores[None],) if needs and scores is not None else None))
                   for criterion, needs in zip(self.criteria, self.needs_scores, strict=True))

    def cut(self, history: Sequence[int], tokens: list[int], logits: Tensor | None,
            finished: bool) -> tuple[list[int], bool]:
        """A step's `tokens` after the row's ids `history`, cut after the first token at which a
        criterion fires -> (tokens, finished). `logits`: the target's raw logits (len(tokens) or
        more, V) at the positions that produced each token (None: the criteria get no scores)."""
        scores = None
        if logits is not None and any(self.needs_scores):
            block = list(history) + tokens[:-1]  # row j of the block scores the token after block[: len(history) + j]
            scores = self.processor.scores(logits[: len(tokens)], block)
        for j in range(len(tokens)):
            if self.stops([*history, *tokens[: j + 1]], None if scores is None else scores[j]):
                return tokens[: j + 1], True
        return tokens, finished


def stop_rules(stop_strings: tuple[str, ...], criteria: tuple[Criterion, ...], tokenizer: object,
               processor: LogitsProcessor) -> StopRules | None:
    """The rules of checked `stop_strings` (transformers' `StopStringCriteria`, what `generate`
    builds from them) and `criteria`; None when there are none."""
    if not stop_strings and not criteria:
        return None
    own: tuple[Criterion, ...] = ()
    if stop_strings:
        from transformers import PreTrainedTokenizerBase, StopStringCriteria

        if not isinstance(tokenizer, PreTrainedTokenizerBase):
            raise TypeError(f"tokenizer must be a transformers tokenizer (PreTrainedTokenizerBase) for stop_strings, "
                            f"got {type(tokenizer).__name__}")
        own = (StopStringCriteria(tokenizer=tokenizer, stop_strings=list(stop_strings)),)
    return StopRules(own + criteria, processor, (False,) * len(own) + (True,) * len(criteria))
