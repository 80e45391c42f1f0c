"""Beam search's runners: a batch of equally long sequences (beams) of a decoder-only model, over transformers'
cache (`BeamRunner`) or as rows of the static buffer our own forward runs (`StaticBeamRunner`, `utils/lean/`).

Invariant (asserted after every step): `sequences` is (beams, length) and the cache holds `length`
positions of each beam.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import PreTrainedModel

from utils.cost_model import PassCosts
from utils.runners import compat
from utils.runners.passes import as_float
from utils.runners.sequence import SequenceRunner
from utils.runners.static import StaticRunner


class BeamRunner(SequenceRunner):
    """A `SequenceRunner` whose cache holds one row per beam; `tokens` is beam 0's, standing for the
    length every beam has."""

    def __init__(self, model: PreTrainedModel, *, use_cache: bool = True, costs: PassCosts | None = None) -> None:
        super().__init__(model, use_cache=use_cache, costs=costs)
        self.sequences = torch.empty(1, 0, dtype=torch.long, device=self.device)

    def start(self, prefix: list[int]) -> Tensor:
        """Prefill one beam with `prefix` -> the logits of its next token, (1, vocab)."""
        self.sequences = torch.tensor([prefix], device=self.device)
        return self.forward(prefix)

    @torch.no_grad()
    def step(self, beam_idx: Tensor, tokens: Tensor) -> Tensor:
        """Beam i continues beam `beam_idx[i]` with `tokens[i]` -> next-token logits (beams, vocab)."""
        self.sequences = torch.cat([self.sequences[beam_idx], tokens[:, None]], dim=1)
        self.tokens = self.sequences[0].tolist()  # beam 0 stands for the length the cache holds
        kwargs = {"use_cache": self.use_cache, "attention_mask": torch.ones_like(self.sequences)}
        if self.use_cache:
            compat.reorder(self._cache, beam_idx)
            kwargs[self._cache_kwarg] = self._cache
            ids = tokens[:, None]
        else:
            ids = self.sequences
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = 1
        logits = self.run(ids, kwargs, timed=False).logits[:, -1]  # a few beams: the measured shortcuts
        assert self._cached_positions() == len(self.tokens), "cache out of step with the beams"
        return as_float(logits)


class StaticBeamRunner:
    """`BeamRunner`'s calls over a `StaticRunner` of `slots` positions a row: a step gathers the rows the surviving
    beams continue (a beam may be continued twice) and feeds each beam its token, all beams in one pass."""

    def __init__(self, model: PreTrainedModel, *, slots: int, costs: PassCosts | None = None) -> None:
        self._rows = StaticRunner(model, rows=1, slots=slots, costs=costs)
        self.sequences = torch.empty(1, 0, dtype=torch.long, device=self._rows.device)

    def start(self, prefix: list[int]) -> Tensor:
        """Prefill one beam with `prefix` -> the logits of its next token, (1, vocab)."""
        self.sequences = torch.tensor([prefix], device=self._rows.device)
        return self._rows.forward_rows([(prefix, None)], [1])[0]

    @torch.no_grad()
    def step(self, beam_idx: Tensor, tokens: Tensor) -> Tensor:
        """Beam i continues beam `beam_idx[i]` with `tokens[i]` -> next-token logits (beams, vocab)."""
        self.sequences = torch.cat([self.sequences[beam_idx], tokens[:, None]], dim=1)
        self._rows.select_rows(beam_idx.tolist())
        logits = self._rows.forward_rows([([token], None) for token in tokens.tolist()], [1] * len(tokens))
        return torch.cat(logits)
