"""What the decoding loops and the drafters need from a model runner, whatever its mode.

A runner holds a batch of rows (one row: one sequence), each with the tokens its KV cache holds.
Lists go by row, in the order of the rows still running. Modes (`factory.make_runner` chooses):
one sequence (`sequence.py`), a batch sharing one cache and every pass (`shared_batch.py`), a batch
with one sequence runner per row (`per_row.py`). Beam search has its own (`beam.py`).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import Tensor
from transformers import PreTrainedModel

from utils.cost_model import PassCosts

# One block per row: (tokens, parents), parents None for a chain, else a tree (-1 for the block's
# first token, the root, which follows the row's last cached token). An empty block feeds nothing.
# A chain's tokens may be a (n,) int64 tensor on the runner's device: a drafter's drafts, fed to its
# next pass without a host read (`StaticRunner` writes them into the pass's ids on the device; the
# other runners read them to the host first, `host_blocks`).
Tokens = list[int] | Tensor
Blocks = list[tuple[Tokens, list[int] | None]]


def host_blocks(blocks: Blocks) -> list[tuple[list[int], list[int] | None]]:
    """`blocks` with every tensor block read to a list of ids (one host read per tensor block): for
    a runner that builds its passes from host lists."""
    return [(tokens.tolist() if isinstance(tokens, Tensor) else tokens, parents) for tokens, parents in blocks]


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share (a cache's tokens and the new ones: what it can keep)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@runtime_checkable
class Runner(Protocol):
    model: PreTrainedModel
    device: torch.device  # where input ids go
    devices: tuple[torch.device, ...]  # every device the model spans: what a timing waits for
    forward_passes: int  # passes of the model so far (the prefill's included)

    @property
    def costs(self) -> PassCosts | None:
        """The model's pass costs, given at construction: CPU shortcuts, and timings refined."""

    @property
    def supports_trees(self) -> bool:
        """Whether tree blocks are exact here; otherwise every block is a chain."""

    def row_length(self, row: int) -> int:
        """How many tokens of row `row` the cache holds."""

    def forward_rows(self, blocks: Blocks, num_logits: list[int]) -> list[Tensor]:
        """Feed each row its block -> per row the logits of the block's last `num_logits[b]` tokens,
        (num_logits[b], vocab), float32 (float64 if the model is); (0, 0) for an empty block.
        A tree block's logits are `SequenceRunner.forward_tree`'s rows."""

    def rollback_row(self, row: int, length: int) -> None:
        """Forget row `row`'s tokens from `length` on (its rejected drafts)."""

    def keep_path_row(self, row: int, root_index: int, path: list[int]) -> None:
        """After a tree block, keep row `row`'s root (at `root_index`) and its accepted nodes `path`
        (root to leaf); forget the other nodes."""

    def select_rows(self, keep: list[int]) -> Runner:
        """Keep only the rows `keep` (finished rows stop costing compute) -> the runner to use from
        now on (this one, or one that took its cache over: then this one is spent)."""
