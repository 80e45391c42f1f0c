"""`SpeculativeStats.logprobs`: the log-probability the target gives each returned token, from the
passes the loop already ran (transformers' `output_logits`, log-softmaxed; no extra pass).

A step's verification pass scores the row's last accepted token and every drafted node: its logits
row 0 predicts the first new token, row `node + 1` the token after drafted node `node`. The tokens a
step returns (the accepted path, then the target's own token) were predicted by the rows
`block_positions(path)`.
"""

from __future__ import annotations

import torch
from torch import Tensor


def block_positions(path: list[int]) -> list[int]:
    """Rows of a step's target logits (1 + len(tree), V) that predicted its accepted path's
    tokens and then the target's own token: the root's row, then the row after each accepted node."""
    return [0, *(node + 1 for node in path)]


def step_logits(logits: Tensor, path: list[int]) -> Tensor:
    """A step's target logits (1 + len(tree), V) -> the rows that predicted its tokens (len(path) + 1, V);
    a view when they are the first rows (a chain's path is 0, 1, ...)."""
    positions = block_positions(path)
    if positions == list(range(len(positions))):
        return logits[: len(positions)]
    return logits[torch.tensor(positions, device=logits.device)]


def token_logprobs(logits: Tensor, tokens: list[int]) -> Tensor:
    """log softmax(logits[j])[tokens[j]] for each j: logits (>= len(tokens), V) raw -> (len(tokens),),
    at least float32, on the logits' device (no host transfer here)."""
    rows = logits[: len(tokens)]
    rows = rows.to(torch.promote_types(rows.dtype, torch.float32))
    index = torch.tensor(tokens, dtype=torch.long, device=rows.device)
    return rows.log_softmax(dim=-1).gather(-1, index[:, None])[:, 0]


class RowLogprobs:
    """Each row's log-probabilities, gathered step by step on the device and read once at the end."""

    def __init__(self, num_rows: int) -> None:
        self.parts: list[list[Tensor]] = [[] for _ in range(num_rows)]

    def add(self, row: int, logits: Tensor, tokens: list[int]) -> None:
        if tokens:
            self.parts[row].append(token_logprobs(logits, tokens))

    def lists(self) -> list[list[float]]:
        """One list of floats per row (one host transfer)."""
        if not any(self.parts):
            return [[] for _ in self.parts]
        flat = torch.cat([part for parts in self.parts for part in parts]).cpu().tolist()
        out, start = [], 0
        for parts in self.parts:
            n = sum(len(part) for part in parts)
            out.append(flat[start : start + n])
            start += n
        return out
