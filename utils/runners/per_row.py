"""A batch with one `SequenceRunner` per row: for models that cannot share passes (encoder-decoder,
flash attention, `use_cache=False`; `model_info.shares_passes`). One pass per row and step, the
same tokens as a shared batch, chains only.

Invariant: each row's runner holds its own invariant (its cache holds exactly its tokens); this
runner holds no cache, and counts every pass of its rows' runners in `forward_passes`.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import PreTrainedModel

from utils.cost_model import PassCosts
from utils.runners.model_info import input_device, model_devices
from utils.runners.protocol import Blocks, host_blocks
from utils.runners.sequence import SequenceRunner


class PerRowRunner:
    """`rows` sequences, each in its own one-sequence runner (built with the same costs)."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        rows: int,
        use_cache: bool = True,
        encoder_input_ids: list[list[int]] | None = None,
        costs: PassCosts | None = None,
    ) -> None:
        assert encoder_input_ids is None or len(encoder_input_ids) == rows
        self.model = model
        self.device = input_device(model)
        self.devices = model_devices(model)
        self.forward_passes = 0
        self._costs = costs
        self._rows = [SequenceRunner(model, use_cache=use_cache, encoder_input_ids=ids, costs=costs)
                      for ids in (encoder_input_ids or [None] * rows)]

    @property
    def costs(self) -> PassCosts | None:
        return self._costs

    @property
    def supports_trees(self) -> bool:
        return False  # a tree needs the shared batch's mask: these models verify chains

    def row_length(self, row: int) -> int:
        return len(self._rows[row])

    def forward_rows(self, blocks: Blocks, num_logits: list[int]) -> list[Tensor]:
        """One pass per row fed a (chain) block."""
        out = []
        for runner, (tokens, parents), num in zip(self._rows, host_blocks(blocks), num_logits, strict=True):
            assert parents is None, "a one-pass-per-row batch verifies chains"
            out.append(runner.forward(tokens, num) if tokens else torch.empty(0, 0, device=self.device))
            self.forward_passes += bool(tokens)
        return out

    def rollback_row(self, row: int, length: int) -> None:
        self._rows[row].rollback(length)

    def keep_path_row(self, row: int, root_index: int, path: list[int]) -> None:
        self._rows[row].keep_path(root_index, path)

    def select_rows(self, keep: list[int]) -> PerRowRunner:
        self._rows = [self._rows[row] for row in keep]
        return self
