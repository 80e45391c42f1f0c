"""How a batch's rows sit in one KV cache: pure functions of slots, positions and blocks.

Rows of a batch advance by different numbers of tokens (ragged acceptance), but a transformers
cache appends the same number of slots to every row. So each row's tokens occupy some of the
slots, in order, and the others are dead (padding, rejected drafts); `live` (B, S) says which,
`positions` (B, S) gives each slot's position in its row's sequence. Every pass then feeds one
block per row, left-padded to the longest block: a chain, or a tree (`parents`, -1 for the
block's first token, which follows the row's last live slot). Each query sees its row's live
slots, its own ancestors in the block, and itself, within the sliding window if the model has
one: a float 4D mask, with per-row position ids. A dead slot is never seen by a live query, and
its weight in attention is exactly zero (exp(finfo.min) underflows), so each row's logits are
those of the row alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Block:
    """The new slots of one pass: (B, L) ids, live flags and positions, (B, L, L) ancestry."""

    ids: Tensor
    live: Tensor
    positions: Tensor
    ancestry: Tensor

    @classmethod
    def build(cls, blocks: list[tuple[list[int], list[int] | None]], lengths: list[int]) -> Block:
        """`blocks[b]` = (tokens, parents or None for a chain) for a row whose sequence holds
        `lengths[b]` tokens; row b's block is left-padded to the longest one."""
        width = max(1, max(len(tokens) for tokens, _ in blocks))
        rows = len(blocks)
        ids = torch.zeros(rows, width, dtype=torch.long)
        live = torch.zeros(rows, width, dtype=torch.bool)
        positions = torch.zeros(rows, width, dtype=torch.long)
        ancestry = torch.eye(width, dtype=torch.bool).repeat(rows, 1, 1)  # a padding query sees itself: no empty row
        for b, (tokens, parents) in enumerate(blocks):
            offset = width - len(tokens)
            parents = list(range(-1, len(tokens) - 1)) if parents is None else parents
            depth: list[int] = []
            for j, parent in enumerate(parents):
                depth.append(0 if parent < 0 else depth[parent] + 1)
                if parent >= 0:
                    ancestry[b, offset + j] |= ancestry[b, offset + parent]
            ids[b, offset:] = torch.tensor(tokens, dtype=torch.long)
            live[b, offset:] = True
            positions[b, offset:] = lengths[b] + torch.tensor(depth, dtype=torch.long)
        return cls(ids, live, positions, ancestry)


def attention_mask(live: Tensor, positions: Tensor, block: Block, window: int | None, dtype: torch.dtype) -> Tensor:
    """The float mask (B, 1, L, S + L) of a pass feeding `block` after slots `live`, `positions` (B, S)."""
    rows, width = block.ids.shape
    visible = torch.cat([live[:, None, :].expand(rows, width, live.shape[1]), block.ancestry], dim=2)
    if window is not None:  # key position > query position - window, as the model's own mask
        keys = torch.cat([positions, block.positions], dim=1)
        visible &= keys[:, None, :] > block.positions[:, :, None] - window
    mask = torch.zeros(rows, 1, width, visible.shape[2], dtype=dtype)
    return mask.masked_fill(~visible[:, None], torch.finfo(dtype).min)


def compaction(live: Tensor) -> tuple[Tensor, Tensor]:
    """Gather index (B, S') moving each row's live slots, in order, to the right end of S' = the
    most live slots of any row (left padding) -> (index, live after)."""
    counts = live.sum(dim=1)
    width = int(counts.max()) if len(counts) else 0
    index = torch.zeros(live.shape[0], width, dtype=torch.long)
    after = torch.zeros(live.shape[0], width, dtype=torch.bool)
    for b in range(live.shape[0]):
        slots = live[b].nonzero()[:, 0]
        index[b, width - len(slots) :] = slots
        after[b, width - len(slots) :] = True
    return index, after
