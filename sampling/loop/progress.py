"""Where each row of a generation stands while a loop advances it: its sequence, its generated
tokens, its drafts proposed and accepted, and the rows still decoding. The speculative loop and plain
decoding keep their rows here; the target's runner over those rows is the loop's (`Generation.narrow`)."""

from __future__ import annotations

from torch import Tensor

from sampling.loop.common import Generation
from sampling.loop.logprobs import RowLogprobs
from sampling.loop.randomness import PositionUniforms


class Progress:
    """The rows of `gen` as a loop advances them. `live` holds the indices of the rows still
    decoding, in the runner's (and the drafter's) order; position i of a step's lists is row `live[i]`."""

    def __init__(self, gen: Generation, *, logprobs: bool = False) -> None:
        self.gen = gen
        # `logprobs`: each returned token's log-probability (`SpeculativeStats.logprobs`), from the logits
        # that `extend` is given; those logits also feed the stopping rules.
        self.logprobs = RowLogprobs(len(gen.prefixes)) if logprobs else None
        self.needs_logits = logprobs or gen.stopping is not None
        self.sequences = [list(prefix) for prefix in gen.prefixes]  # the decoder's ids: what processors see
        self.generated: list[list[int]] = [[] for _ in self.sequences]
        self.live = list(range(len(self.sequences)))
        self.drafted, self.accepted = [0] * len(self.sequences), [0] * len(self.sequences)

    def active(self) -> list[list[int]]:
        """The sequences of the rows still decoding."""
        return [self.sequences[row] for row in self.live]

    def uniforms(self) -> list[PositionUniforms]:
        return [self.gen.uniforms[row] for row in self.live]

    def max_depths(self) -> list[int]:
        """Per row still decoding, the deepest draft that still fits before `max_gen_len` once the
        target's own token is counted (`Drafter.draft`'s `max_depths`)."""
        return [self.gen.max_new_tokens[row] - len(self.generated[row]) - 1 for row in self.live]

    def extend(self, i: int, tokens: list[int], logits: Tensor | None = None) -> tuple[list[int], bool]:
        """Row `live[i]` gains `tokens`, cut after an end token, at its budget and where a stopping rule
        fires (`logits`: the target's raw logits at the positions that predicted them, (len(tokens), V),
        when `needs_logits`) -> (what it gained, finished)."""
        row = self.live[i]
        new_tokens, finished = self.gen.trim(row, tokens, len(self.generated[row]), self.sequences[row], logits)
        if self.logprobs is not None and logits is not None:
            self.logprobs.add(row, logits, new_tokens)
        self.sequences[row] += new_tokens
        self.generated[row] += new_tokens
        return new_tokens, finished

    def count(self, i: int, drafted: int, accepted: int) -> None:
        """Row `live[i]`'s step drafted `drafted` nodes, `accepted` of them accepted (its alpha's counts)."""
        self.drafted[self.live[i]] += drafted
        self.accepted[self.live[i]] += accepted

    def alphas(self) -> list[float]:
        """Each row's drafts accepted / drafts proposed (0.0 where it drafted nothing)."""
        return [accepted / drafted if drafted else 0.0 for drafted, accepted in zip(self.drafted, self.accepted, strict=True)]

    def keep(self, going_on: list[int]) -> bool:
        """Only the rows at positions `going_on` of `live` go on -> whether some rows left and others go
        on (the target's runner and the drafter should then keep the same ones: `select_rows`)."""
        changed = 0 < len(going_on) < len(self.live)
        self.live = [self.live[i] for i in going_on]
        return changed
