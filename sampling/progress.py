"""Where each row of a generation stands while a loop advances it: its sequence, its generated
tokens, and the rows still decoding. The speculative loop and plain decoding keep their rows here."""

from __future__ import annotations

from sampling.common import Generation
from sampling.randomness import PositionUniforms
from utils.runners.protocol import Runner


class Progress:
    """The rows of `gen` as a loop advances them. `live` holds the indices of the rows still
    decoding, in the runner's (and the drafter's) order; position i of a step's lists is row `live[i]`."""

    def __init__(self, gen: Generation) -> None:
        self.gen = gen
        self.sequences = [list(prefix) for prefix in gen.prefixes]  # the decoder's ids: what processors see
        self.generated: list[list[int]] = [[] for _ in self.sequences]
        self.live = list(range(len(self.sequences)))

    def active(self) -> list[list[int]]:
        """The sequences of the rows still decoding."""
        return [self.sequences[row] for row in self.live]

    def uniforms(self) -> list[PositionUniforms]:
        return [self.gen.uniforms[row] for row in self.live]

    def max_depths(self) -> list[int]:
        """Per row still decoding, the deepest draft that still fits before `max_gen_len` once the
        target's own token is counted (`Drafter.draft`'s `max_depths`)."""
        return [self.gen.max_new_tokens[row] - len(self.generated[row]) - 1 for row in self.live]

    def extend(self, i: int, tokens: list[int]) -> tuple[list[int], bool]:
        """Row `live[i]` gains `tokens`, cut after an end token and at its budget -> (what it gained, finished)."""
        row = self.live[i]
        new_tokens, finished = self.gen.trim(row, tokens, len(self.generated[row]))
        self.sequences[row] += new_tokens
        self.generated[row] += new_tokens
        return new_tokens, finished

    def keep(self, going_on: list[int], runner: Runner) -> tuple[Runner, bool]:
        """Only the rows at positions `going_on` of `live` go on -> (the runner to use from now on,
        whether the rows changed and the drafter should keep the same ones: `select_rows`)."""
        changed = 0 < len(going_on) < len(self.live)
        if changed:  # finished rows stop costing compute
            runner = runner.select_rows(going_on)
        self.live = [self.live[i] for i in going_on]
        return runner, changed
