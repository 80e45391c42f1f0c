"""The one-sequence runner: one model, its KV cache and the tokens it has seen.

Invariant (asserted after every call): the cache holds exactly `len(runner)` positions, those of
`runner.tokens`. Decoder-only: `forward(tokens)` extends the sequence. Encoder-decoder: the encoder
runs once, in the constructor, on `encoder_input_ids`; `forward` then extends the decoder's
sequence. With `use_cache=False` every call recomputes the whole sequence (same interface, same
logits, no cache).
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import PreTrainedModel

from utils.batch_layout import Block, attention_mask
from utils.cost_model import PassCosts
from utils.cpu_passes import Shortcuts
from utils.runners import compat
from utils.runners.model_info import shares_passes, sliding_window
from utils.runners.passes import ModelPasses, as_float
from utils.runners.protocol import Blocks, host_blocks


class SequenceRunner(ModelPasses):
    """Feeds new tokens to a model and returns their logits, keeping the KV cache in step.

    The `Runner` protocol's row calls take row 0: `forward_rows`, `rollback_row`, `keep_path_row`
    are `forward` (or `forward_tree`), `rollback` and `keep_path`.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        use_cache: bool = True,
        encoder_input_ids: list[int] | None = None,
        costs: PassCosts | None = None,
        adopted: tuple[object, list[int]] | None = None,
    ) -> None:
        """`adopted`: (a one-row cache, exactly the tokens it holds) to go on from (decoder-only)."""
        super().__init__(model, costs=costs)
        self.use_cache = use_cache
        self.tokens: list[int] = []  # the tokens the cache holds
        self._encoder_outputs = None
        if self.encoder_decoder:
            assert encoder_input_ids is not None, "an encoder-decoder runner needs encoder_input_ids"
            with torch.no_grad():
                ids = torch.tensor([encoder_input_ids], device=self.device)
                self._encoder_outputs = model.get_encoder()(input_ids=ids, return_dict=True)
        self._cache = compat.new_cache(self.encoder_decoder) if use_cache else None
        if adopted is not None:
            self._cache, self.tokens = adopted[0], list(adopted[1])
            assert self._cached_positions() == len(self.tokens), "an adopted cache out of step with its tokens"

    @classmethod
    def adopting(cls, model: PreTrainedModel, cache, tokens: list[int], *, costs: PassCosts | None,
                 forward_passes: int) -> SequenceRunner:
        """A runner that goes on from a one-row `cache` holding exactly `tokens` (decoder-only), its
        pass counter starting at `forward_passes`: a batch down to its last row."""
        runner = cls(model, costs=costs, adopted=(cache, tokens))
        runner.forward_passes = forward_passes  # the batch's passes so far: the count goes on
        return runner

    def __len__(self) -> int:
        return len(self.tokens)

    def _cached_positions(self) -> int:
        return compat.cached_length(self._cache) if self._cache is not None else len(self.tokens)

    @property
    def supports_trees(self) -> bool:
        """Whether `forward_tree` (and tree blocks in `forward_rows`) is exact for this model
        (`model_info.shares_passes`). Others verify chains (`forward`)."""
        return shares_passes(self.model, self.use_cache)

    @torch.no_grad()
    def forward(self, new_tokens: list[int], num_logits: int = 1, *, shortcuts: Shortcuts | None = None) -> Tensor:
        """Append `new_tokens` and return the logits of the last `num_logits` positions.

        Returns (num_logits, vocab), float32 (float64 if the model is), on the model's device.
        Row i is the distribution of the token that follows position len(self) - num_logits + i.
        `shortcuts` overrides the CPU shortcuts chosen by `costs` (calibration uses it).
        """
        assert new_tokens, "forward needs at least one new token"
        assert 1 <= num_logits <= len(self.tokens) + len(new_tokens)
        extends_cache = self.use_cache and len(self.tokens) > 0  # not the prefill: a verification-sized pass
        self.tokens.extend(new_tokens)
        if self.use_cache:
            ids = new_tokens
            kwargs = {self._cache_kwarg: self._cache, "use_cache": True}
        else:
            ids = self.tokens
            kwargs = {"use_cache": False}
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = num_logits
        ids = torch.tensor([ids], device=self.device)
        outputs = self.run(ids, kwargs, timed=extends_cache, shortcuts=shortcuts)
        assert self._cached_positions() == len(self.tokens), "cache out of step with the tokens"
        return as_float(outputs.logits[0, -num_logits:])

    def _call(self, ids: Tensor, kwargs: dict):
        if self.encoder_decoder:
            return self.model(encoder_outputs=self._encoder_outputs, decoder_input_ids=ids, **kwargs)
        if "attention_mask" not in kwargs:
            # One unpadded sequence: an all-ones mask over past + new positions (GPT-2 warns without).
            kwargs["attention_mask"] = torch.ones(1, len(self.tokens), dtype=torch.long, device=self.device)
        return self.model(input_ids=ids, **kwargs)

    @torch.no_grad()
    def forward_tree(self, root: int, tokens: list[int], parents: list[int]) -> Tensor:
        """Append the accepted token `root` and a tree of drafts, all in one pass -> (1 + n, vocab).

        Node i proposes tokens[i] after its parent (parents[i] < i; -1 is `root`). Each node attends
        to the cached sequence, the root and its own ancestors (a float 4D mask, `batch_layout`; a
        sliding window is folded in) at position len(self) + depth. Row 0 scores the token after the
        root, row 1 + i the token after node i. Until `keep_path`, the cache holds every node, in order.
        """
        assert self.supports_trees and all(parent < node for node, parent in enumerate(parents))
        past = len(self.tokens)
        block = Block.build([([root, *tokens], [-1, *(parent + 1 for parent in parents)])], [past])
        dtype = self.model.get_input_embeddings().weight.dtype
        mask = attention_mask(torch.ones(1, past, dtype=torch.bool), torch.arange(past)[None], block,
                              sliding_window(self.model), dtype)
        self.tokens += [root, *tokens]
        kwargs = {self._cache_kwarg: self._cache, "use_cache": True, "attention_mask": mask.to(self.device),
                  "position_ids": block.positions.to(self.device)}
        outputs = self.run(block.ids.to(self.device), kwargs, timed=True)
        assert self._cached_positions() == len(self.tokens), "cache out of step with the tree"
        return as_float(outputs.logits[0])

    def keep_path(self, root_index: int, path: list[int]) -> None:
        """After `forward_tree`, keep the root (at `root_index`) and the accepted nodes `path`
        (root to leaf), forget every other node: the path's keys and values are copied into the
        positions right after the root (only those few rows move), then the rest is cropped."""
        start = root_index + 1
        source = [start + node for node in path]
        if source != list(range(start, start + len(path))):
            compat.move_positions(self._cache, source, start)
        self.tokens[start : start + len(path)] = [self.tokens[i] for i in source]
        self.rollback(start + len(path))

    def rollback(self, length: int) -> None:
        """Forget every position from `length` on (the rejected drafts)."""
        assert 0 <= length <= len(self.tokens)
        removed = len(self.tokens) - length
        if removed == 0:
            return
        del self.tokens[length:]
        if self._cache is not None:
            if length == 0:
                self._cache = compat.new_cache(self.encoder_decoder)
            else:
                compat.crop(self._cache, removed)
        assert self._cached_positions() == len(self.tokens), "cache out of step after rollback"

    # The Runner protocol: one row ----------------------------------------------------------------

    def row_length(self, row: int) -> int:
        assert row == 0, "a one-sequence runner has row 0 only"
        return len(self.tokens)

    def forward_rows(self, blocks: Blocks, num_logits: list[int]) -> list[Tensor]:
        assert len(blocks) == 1, "a one-sequence runner is fed one block"
        (tokens, parents), num = host_blocks(blocks)[0], num_logits[0]
        if not tokens:
            return [self._no_logits()]
        if parents is None:
            return [self.forward(tokens, num)]
        return [self.forward_tree(tokens[0], tokens[1:], [parent - 1 for parent in parents[1:]])[-num:]]

    def rollback_row(self, row: int, length: int) -> None:
        assert row == 0, "a one-sequence runner has row 0 only"
        self.rollback(length)

    def keep_path_row(self, row: int, root_index: int, path: list[int]) -> None:
        assert row == 0, "a one-sequence runner has row 0 only"
        self.keep_path(root_index, path)

    def select_rows(self, keep: list[int]) -> SequenceRunner:
        assert keep == [0], "a one-row runner keeps its row"
        return self
