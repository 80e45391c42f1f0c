"""A batch whose rows share one KV cache and every pass (decoder-only, eager or SDPA attention, one
kind of layer, with a cache: `model_info.shares_passes`).

Rows advance by different numbers of tokens, so each row's tokens occupy some of the cache's slots
and the others are dead (padding, rejected drafts, other tree nodes): `_live` and `_positions`,
(rows, slots), laid out by `utils/batch_layout.py` (a custom 4D mask and position ids per pass;
dead slots are compacted when they pile up).

Invariant (asserted after every pass): the cache holds `_live.shape[1]` slots per row, and row b's
live slots are its tokens `rows[b]`, in order. A batch down to one row hands its compacted cache
to a `SequenceRunner` (`select_rows` returns it) and is spent.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import PreTrainedModel

from utils.batch_layout import Block, attention_mask, compaction
from utils.cost_model import PassCosts
from utils.runners import compat
from utils.runners.model_info import sliding_window
from utils.runners.passes import ModelPasses, as_float
from utils.runners.protocol import Blocks, Runner, host_blocks
from utils.runners.sequence import SequenceRunner


class SharedBatchRunner(ModelPasses):
    """`rows` sequences of a decoder-only model in one cache: one pass per step for every row."""

    def __init__(self, model: PreTrainedModel, *, rows: int, costs: PassCosts | None = None) -> None:
        super().__init__(model, costs=costs)
        assert not self.encoder_decoder, "a shared batch is decoder-only"
        self.rows: list[list[int]] = [[] for _ in range(rows)]  # each row's tokens in the cache
        self._live = torch.zeros(rows, 0, dtype=torch.bool)
        self._positions = torch.zeros(rows, 0, dtype=torch.long)
        self._cache = compat.new_cache(encoder_decoder=False)

    @property
    def supports_trees(self) -> bool:
        return True  # the mask is built per node (`batch_layout.Block`)

    def row_length(self, row: int) -> int:
        return len(self.rows[row])

    def _check(self) -> None:
        assert compat.cached_length(self._cache) == self._live.shape[1], "cache out of step with the slots"
        assert self._live.sum(dim=1).tolist() == [len(row) for row in self.rows], "live slots out of step with the rows"

    @torch.no_grad()
    def forward_rows(self, blocks: Blocks, num_logits: list[int]) -> list[Tensor]:
        """One pass feeding every row its block, left-padded to the longest (`Runner.forward_rows`)."""
        blocks = host_blocks(blocks)
        if self._live.shape[1] == 0 and all(parents is None for _, parents in blocks):
            return self._prefill_rows(blocks, num_logits)
        self._tidy()
        block = Block.build(blocks, [len(row) for row in self.rows])
        dtype = self.model.get_input_embeddings().weight.dtype
        mask = attention_mask(self._live, self._positions, block, sliding_window(self.model), dtype)
        kwargs = {self._cache_kwarg: self._cache, "use_cache": True, "attention_mask": mask.to(self.device),
                  "position_ids": block.positions.to(self.device)}
        width = block.ids.shape[1]
        keep = max(1, max(num_logits))  # blocks are left-padded: the last positions line up
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = keep
        outputs = self.run_batch(block.ids.to(self.device), kwargs)
        self._live = torch.cat([self._live, block.live], dim=1)
        self._positions = torch.cat([self._positions, block.positions], dim=1)
        for row, (tokens, _) in zip(self.rows, blocks, strict=True):
            row += tokens
        self._check()
        logits = outputs.logits[:, -keep:] if outputs.logits.shape[1] == width else outputs.logits
        logits = as_float(logits)
        return [logits[b, keep - num :] if num else self._no_logits() for b, num in enumerate(num_logits)]

    def _prefill_rows(self, blocks: Blocks, num_logits: list[int]) -> list[Tensor]:
        """An empty shared cache: each row's prompt in a pass of its own (prompts differ in length,
        and padding every row to the longest would multiply the prefill's work), then the rows'
        caches side by side, left-padded to the longest."""
        width = max(len(tokens) for tokens, _ in blocks)
        caches, logits = [], []
        for (tokens, _), num in zip(blocks, num_logits, strict=True):
            alone = SequenceRunner(self.model, costs=self.costs)
            if tokens:
                row_logits = alone.forward(tokens, max(num, 1))
                self.forward_passes += 1
            logits.append(row_logits[-num:] if tokens and num else self._no_logits())
            caches.append(alone._cache if tokens else None)
        self._cache = compat.side_by_side(caches, width)
        starts = torch.tensor([width - len(tokens) for tokens, _ in blocks])[:, None]
        self._live = torch.arange(width)[None, :] >= starts
        self._positions = (torch.arange(width)[None, :] - starts).clamp(min=0)
        for row, (tokens, _) in zip(self.rows, blocks, strict=True):
            row += tokens
        self._check()
        return logits

    def _tidy(self) -> None:
        """Crop slots dead in every row at the end; compact when dead slots are a quarter of the cache."""
        columns = self._live.any(dim=0).nonzero()
        dead_tail = self._live.shape[1] - (int(columns.max()) + 1 if len(columns) else 0)
        if dead_tail:
            compat.crop(self._cache, dead_tail)
            self._live, self._positions = self._live[:, :-dead_tail], self._positions[:, :-dead_tail]
        if self._live.shape[1] > 1.25 * int(self._live.sum(dim=1).max()) + 16:
            self._compact()

    def _compact(self) -> None:
        """Move each row's live slots together (left padding): a gather over the whole cache."""
        index, live = compaction(self._live)
        self._positions = self._positions.gather(1, index)
        compat.gather_slots(self._cache, index)
        self._live = live

    def _row_slots(self, row: int) -> Tensor:
        return self._live[row].nonzero()[:, 0]

    def rollback_row(self, row: int, length: int) -> None:
        assert 0 <= length <= len(self.rows[row])
        self._live[row, self._row_slots(row)[length:]] = False
        del self.rows[row][length:]

    def keep_path_row(self, row: int, root_index: int, path: list[int]) -> None:
        """The row's other tree nodes become dead slots."""
        nodes = self._row_slots(row)[root_index + 1 :]
        dead = [slot for node, slot in enumerate(nodes.tolist()) if node not in set(path)]
        self._live[row, dead] = False
        tokens = self.rows[row]
        self.rows[row] = tokens[: root_index + 1] + [tokens[root_index + 1 + node] for node in path]

    def select_rows(self, keep: list[int]) -> Runner:
        """Keep the rows `keep`; with one left, a `SequenceRunner` goes on from its compacted cache
        (no dead slots, no mask) and this batch is spent."""
        index = torch.tensor(keep, dtype=torch.long)
        compat.select_rows(self._cache, index)
        self._live, self._positions = self._live[index], self._positions[index]
        self.rows = [self.rows[row] for row in keep]
        if len(keep) > 1:
            return self
        self._compact()
        runner = SequenceRunner.adopting(self.model, self._cache, self.rows[0], costs=self.costs,
                                         forward_passes=self.forward_passes)
        self._cache = self._live = self._positions = None  # spent: any later use fails loudly
        self.rows = []
        return runner
