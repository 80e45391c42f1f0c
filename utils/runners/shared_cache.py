"""A drafter model that runs over the TARGET's cache: a self-drafter (the target's own weights, quantized;
`sampling/drafters/self_drafting.py`) has the target's architecture, so its attention can read the target's keys
and values for the verified prefix and it never makes a prompt pass of its own.

`SharedCacheRunner` is a `Runner` for the drafter whose passes go through the target's runner with the
drafter's model lent in (its weights, its pass costs and CPU shortcuts). Within one drafting step the drafts'
keys and values are written after the target's verified tokens, where the target's own cache would take them
(a static buffer's slots, a growing cache's tail, a shared batch's new slots); `release` rolls the target's
runner back to what it held when the step began, so the target's verification pass writes its own keys and
values over exactly those positions. Between steps every call that would move the cache is a no-op: the
drafter's "verified length" is the target's (`row_length`).

Invariant: outside a drafting step the target's runner holds what it would hold without a drafter;
inside one, its rows are the target's verified tokens followed by the drafter's fed tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from transformers import PreTrainedModel

from utils import cpu_passes
from utils.cost_model import PassCosts
from utils.lean import lean_decoder
from utils.runners.model_info import input_device, is_encoder_decoder, model_devices
from utils.runners.protocol import Blocks, Runner
from utils.runners.sequence import SequenceRunner
from utils.runners.shared_batch import SharedBatchRunner
from utils.runners.static import StaticRunner

SHAREABLE = (SequenceRunner, SharedBatchRunner, StaticRunner)  # runners whose passes a drafter can borrow


def can_share(target_runner: Runner, drafter: PreTrainedModel) -> bool:
    """Whether `drafter` can run over `target_runner`'s cache: a decoder-only runner with a cache of
    one of the `SHAREABLE` kinds, the drafter on the same devices, computing in the same dtype (the buffer's); over
    a static buffer, a drafter our own forward runs (the only one that writes and reads it)."""
    if not isinstance(target_runner, SHAREABLE) or is_encoder_decoder(drafter) or target_runner.encoder_decoder:
        return False
    if isinstance(target_runner, StaticRunner) and lean_decoder(drafter) is None:
        return False
    if isinstance(target_runner, SequenceRunner) and not target_runner.use_cache:
        return False
    return model_devices(drafter) == target_runner.devices and _pass_dtype(drafter) == _pass_dtype(target_runner.model)


def _pass_dtype(model: PreTrainedModel) -> torch.dtype:
    """The dtype `model`'s passes compute and cache in: its lean forward's, else its embeddings'."""
    lean = lean_decoder(model)
    return model.get_input_embeddings().weight.dtype if lean is None else lean.dtype


class SharedCacheRunner:
    """The drafter `model`'s runner over the runner `target()` returns (the target's, as it is now:
    a batch may hand its rows over to another runner)."""

    def __init__(self, model: PreTrainedModel, target: Callable[[], Runner], *, costs: PassCosts | None = None) -> None:
        self.model = model
        self.device = input_device(model)
        self.devices = model_devices(model)
        self.forward_passes = 0
        self._target = target
        self._costs = costs
        self._few_token_pass = cpu_passes.FewTokenPass(model)
        self._base: list[int] | None = None  # the target's row lengths when this step began; None between steps

    @property
    def costs(self) -> PassCosts | None:
        return self._costs

    @property
    def supports_trees(self) -> bool:
        return self._target().supports_trees

    def row_length(self, row: int) -> int:
        return self._target().row_length(row)

    @torch.no_grad()
    def forward_rows(self, blocks: Blocks, num_logits: list[int]) -> list[Tensor]:
        """One pass of this drafter's model through the target's runner (`ModelPasses.lent`)."""
        target = self._target()
        if self._base is None:
            self._base = [target.row_length(b) for b in range(len(blocks))]
        with target.lent(self.model, self._costs, self._few_token_pass) as passes:
            try:
                return target.forward_rows(blocks, num_logits)
            finally:
                self.forward_passes += passes()

    def rollback_row(self, row: int, length: int) -> None:
        if self._base is not None:  # never below the target's verified tokens
            self._target().rollback_row(row, max(length, self._base[row]))

    def keep_path_row(self, row: int, root_index: int, path: list[int]) -> None:
        if self._base is not None and root_index >= self._base[row]:
            self._target().keep_path_row(row, root_index, path)

    def release(self) -> None:
        """The drafting step is over: the target's runner holds its verified tokens again."""
        if self._base is not None:
            target = self._target()
            for row, length in enumerate(self._base):
                target.rollback_row(row, length)
        self._base = None

    def select_rows(self, keep: list[int]) -> SharedCacheRunner:
        assert self._base is None, "rows are selected between drafting steps"
        return self
