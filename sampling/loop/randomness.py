"""Randomness by position: the same seed gives the same tokens whatever was drafted.

Every generated position t owns its uniform numbers, drawn from the generator in the order of
positions (a table filled in fixed-size chunks), never in the order in which steps happen to
consume them. Plain sampling emits y_t = F_t^{-1}(u_t), the inverse CDF of the processed
distribution p_t at u_t. A speculative step that verifies a deterministic draft x at position t
(an n-gram, a tree node) accepts it iff y_t == x: that happens with probability p_t(x), the
acceptance probability of speculative sampling with a one-hot q, and when it fails the emitted
y_t follows p_t without x, renormalised: the residual law (with several candidates at a tree
node, the law of multi-candidate speculative sampling). So NASD's sampled output is not only
distributed as plain sampling's: it is the very sequence plain sampling draws from the same
generator, however many drafts each step proposed (the coupling of Leviathan et al.'s rule).

A model drafter's q is not one-hot; its steps keep the standard rule, with the numbers of
position t (`DRAFT`: the drafter's sample, `ACCEPT`: the acceptance test, `TARGET`: the residual or
bonus token) read from the same table, so that its output too depends on the seed alone.
"""

from __future__ import annotations

import torch
from torch import Tensor

from utils.logits_processors import inverse_cdf, supports_float64

__all__ = ["ACCEPT", "CHUNK", "DRAFT", "TARGET", "PositionUniforms", "inverse_cdf"]

TARGET, DRAFT, ACCEPT = 0, 1, 2  # the uniform numbers each position owns
CHUNK = 64  # positions drawn from the generator at a time (any fixed size gives the same streams)


class PositionUniforms:
    """The uniform numbers of generated positions 0, 1, ...: `self(t, TARGET)` is u_t.

    Drawn lazily from `generator` (torch's global generator when None) in chunks of `CHUNK`
    positions x 3 numbers, so the numbers of position t depend on the generator's state at the
    start of the generation and on t only. A generation that needs n positions moves the generator
    by ceil(n / CHUNK) chunks.
    """

    def __init__(self, generator: torch.Generator | None = None, prefix_length: int = 0) -> None:
        self.generator = generator
        self.prefix_length = prefix_length  # generated position t is the token after prefix_length + t tokens
        self._table = torch.empty(0, 3, dtype=torch.float64)
        self._host: list[list[float]] = []  # the table as Python floats, for `__call__`: read once per chunk

    def _extend(self, positions: int) -> None:
        while len(self._table) < positions:
            device = self.generator.device if self.generator is not None else torch.device("cpu")
            dtype = torch.float64 if supports_float64(device) else torch.float32  # an MPS generator: float32 numbers
            chunk = torch.rand(CHUNK, 3, generator=self.generator, dtype=dtype, device=device)
            if chunk.device.type != "cpu":  # a device generator's numbers: one host read per chunk
                chunk = chunk.cpu()
            self._table = torch.cat([self._table, chunk.double()])

    def __call__(self, position: int, stream: int = TARGET) -> float:
        self._extend(position + 1)
        if len(self._host) < len(self._table):  # not one host read per number
            self._host = self._table.tolist()
        return self._host[position][stream]

    def span(self, start: int, count: int, stream: int) -> Tensor:
        """The numbers of positions start .. start + count - 1, (count,) float64."""
        self._extend(start + count)
        return self._table[start : start + count, stream]
